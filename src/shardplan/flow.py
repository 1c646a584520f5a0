"""Where a split dimension flows in one forward: the operations that would compute per-rank pieces,
silently, under context parallelism (each rank holds 2 of ``2*cp`` chunks of every sequence) or tensor
parallelism (each rank holds ``1/tp`` of a column-parallel module's output features).

One forward runs under a ``TorchFunctionMode`` that follows every tensor carrying a split dimension:
the model's inputs (dimension 1, the sequence, under ``cp``; the 1-D positions too) and the output of
every ``colwise`` module (its last dimension, the features). Views, transposes, elementwise operations,
per-head attention and the like carry the mark along; an operation that *mixes* the split dimension
refuses the step, naming the operation, the module that runs it and the fix:

* under ``cp``: a softmax, cumulative op, sort, flip, roll, diff, pad, slice, index, convolution or
  pooling along the sequence, a matrix product contracting over it, attention whose keys are this rank's
  chunks (``F.scaled_dot_product_attention`` not through ``sp.context_parallel.attention``, eager
  ``matmul`` + ``softmax``), a normalisation over it. A sum or mean over it stays allowed: a loss's mean
  over tokens is the mean over the whole sequence once gradients are averaged over cp.
* under ``tp``: any reduction over the split features (a norm over the whole width, ``sum(-1)``), a
  matrix product contracting over them outside the module's row-parallel sibling, a split of the
  features into heads whose count is fixed and width inferred (``view(b, t, heads, -1)``: every head
  spread over ranks), slicing them, a loss over them, and the output reaching the model's output.

The planner runs it in a traced step (``trace=``; :class:`~shardplan.errors.PlanError`) and the runtime
in the first forward of a plan that was not traced (:class:`~shardplan.errors.RuntimeShardingError`),
with the same messages. [Note: what it cannot see: operations outside torch (a custom CUDA kernel, a
Triton kernel, flash-attn called directly), data-dependent control flow, and unknown operations that
change a marked tensor's shape (the mark is dropped there). A mean over the sequence for pooling (a
classifier over whole sequences) is allowed like a loss's mean and is wrong under cp: keep such models
off the cp axis.]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

SEQUENCE = ""  # the source of a sequence mark (a module path names a column-parallel output's)

ATTENTION_FIX = ("compute attention with sp.context_parallel.attention(q, k, v, is_causal=True), which gathers keys "
                 "and values over cp (a Hugging Face model: build it with attn_implementation=\"shardplan_cp\" after "
                 "sp.context_parallel.hf_attention(); docs/context_parallel.md)")
SHIFT_FIX = ("shift the labels of the whole sequences before sp.context_parallel.shard_batch (a Hugging Face model: "
             "pass shift_labels= the shifted, sharded labels instead of labels=)")


@dataclass(frozen=True)
class Mark:
    """A tensor's split dimension: ``dim``; ``source``: ``SEQUENCE`` or the column-parallel module whose
    output it derives from; ``axis``: the mesh axis that splits it; ``size``: that axis's size."""

    dim: int
    source: str
    axis: str
    size: int

    def at(self, dim: int) -> "Mark":
        return Mark(dim, self.source, self.axis, self.size)


_CARRY = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as", "reshape_as", "squeeze", "unsqueeze",
          "contiguous", "clone", "to", "float", "double", "half", "bfloat16", "type", "type_as", "detach",
          "requires_grad_", "cpu", "cuda", "_reshape_alias", "ravel", "atleast_2d", "atleast_3d"}
_PERMUTE = {"transpose", "swapaxes", "swapdims", "t", "permute", "movedim", "moveaxis"}
_ALONG = {"softmax": 1, "log_softmax": 1, "_softmax": 1, "softmin": 1, "cumsum": 1, "cumprod": 1,
          "logcumsumexp": 1, "cummax": 1, "cummin": 1, "sort": 1, "argsort": 1, "topk": 2, "kthvalue": 2,
          "flip": 1, "roll": 2, "diff": 2, "unfold": 1, "index_select": 1, "gather": 1, "take_along_dim": 2,
          "narrow": 1, "select": 1, "scatter": 1, "scatter_add": 1, "index_add": 1, "index_copy": 1,
          "index_fill": 1, "glu": 1}
_ALONG_DEFAULT = {"sort": -1, "argsort": -1, "topk": -1, "kthvalue": -1, "diff": -1, "glu": -1, "msort": 0}
_REDUCE = {"sum", "mean", "nansum", "nanmean", "amax", "amin", "max", "min", "argmax", "argmin", "logsumexp", "prod",
           "std", "var", "std_mean", "var_mean", "norm", "median", "nanmedian", "mode", "quantile", "nanquantile",
           "all", "any", "count_nonzero", "aminmax", "linalg_vector_norm", "vector_norm"}
_TOKEN_REDUCE = {"sum", "mean", "nansum", "nanmean", "all", "any", "count_nonzero"}
_MATMUL = {"matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "inner"}
_SPLIT = {"split": 2, "chunk": 2, "tensor_split": 2, "split_with_sizes": 2, "unbind": 1}
_JOIN = {"cat", "concat", "concatenate", "stack"}
_LOSS = {"cross_entropy", "nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "mse_loss",
         "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "poisson_nll_loss", "soft_margin_loss",
         "multilabel_soft_margin_loss", "multi_margin_loss", "gaussian_nll_loss"}
_BEFORE = {"multi_head_attention_forward", "scaled_dot_product_attention"}
_NORM = {"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "normalize", "local_response_norm"}


def _dim(d, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _plain(t) -> bool:
    """Only plain tensors carry marks (a DTensor is the runtime's own, already placed)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def reshaped(d: int, shape_in, shape_out) -> Optional[int]:
    """The dimension of a reshape's output holding the outermost part of input dimension ``d`` (a split
    keeps the outer factor split: whole heads; a merge keeps the merged dimension split)."""
    if tuple(shape_in) == tuple(shape_out):
        return d
    if math.prod(shape_in) != math.prod(shape_out):
        return None
    outer = math.prod(shape_in[d:])
    for e in range(len(shape_out)):  # a split keeps its outer factor split (of size 1 too: one head per rank)
        if math.prod(shape_out[e:]) == outer:
            return e
    for e in range(len(shape_out)):  # a merge: the merged dimension
        lo, hi = math.prod(shape_out[e + 1:]), math.prod(shape_out[e:])
        if lo < outer <= hi:
            return e
    return None


class _Refused(Exception):
    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class FlowCheck(TorchFunctionMode):
    """The mode (enter it around one forward, with :meth:`hooks` registered on the model). ``error``
    makes the exception to raise from a message; ``colwise``: {module path: (axis, size)} whose outputs
    are split; ``rowwise``: {module path: axis} that may contract their split input; ``cp``: the context
    axis's size (1: no sequence marks); ``through_attention``: whether an attention call now comes from
    ``sp.context_parallel.attention`` (the planner's traced step, where it does not gather)."""

    def __init__(self, error: Callable[[str], Exception], colwise=None, rowwise=None, cp: int = 1,
                 through_attention: Callable[[], bool] = lambda: False):
        super().__init__()
        self.error, self.colwise, self.rowwise, self.cp = error, dict(colwise or {}), dict(rowwise or {}), cp
        self.through_attention = through_attention
        self.marks = WeakIdKeyDictionary()
        self.stack: list[str] = [""]
        self.live = True

    # -- marks ---------------------------------------------------------------------------------------------
    def mark(self, t, m: Optional[Mark]) -> None:
        """Add ``m`` to ``t``'s marks (a tensor may carry the sequence's and a column-parallel output's)."""
        if m is not None and isinstance(t, torch.Tensor) and _plain(t) and 0 <= m.dim < t.ndim:
            have = self.marks.get(t, ())
            self.marks[t] = tuple(h for h in have if h.source != m.source) + (m,)

    def of(self, t) -> tuple:
        return self.marks.get(t, ()) if isinstance(t, torch.Tensor) and _plain(t) else ()

    def mark_inputs(self, args, kwargs, seq_dim: int = 1) -> None:
        """Under cp, the model's inputs: dimension ``seq_dim`` of every tensor with the first one's
        sequence length, and 1-D tensors of that length (positions)."""
        if self.cp <= 1:
            return
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        t0 = next((t for t in tensors if t.ndim > seq_dim), None)
        if t0 is None:
            return
        n = t0.shape[seq_dim]
        for t in tensors:
            if t.ndim > seq_dim and t.shape[seq_dim] == n:
                self.mark(t, Mark(seq_dim, SEQUENCE, "cp", self.cp))
            elif t.ndim == 1 and t.shape[0] == n:
                self.mark(t, Mark(0, SEQUENCE, "cp", self.cp))

    # -- module hooks ----------------------------------------------------------------------------------------
    def hooks(self, model, root_output: bool = True) -> list:
        """Forward hooks on every module: the module stack (for messages), the marks of column-parallel
        outputs, and (``root_output``) the check that no column-parallel piece leaves the model."""
        handles = []

        def enter(path):
            def hook(_m, _args):
                if self.live:
                    self.stack.append(path)
            return hook

        def leave(path):
            def hook(_m, args, out):
                if not self.live:
                    return
                if self.stack and self.stack[-1] == path:
                    self.stack.pop()
                if path in self.colwise or path in self.rowwise:
                    self.carry_through(args, out)
                if path in self.colwise:
                    axis, size = self.colwise[path]
                    for t in tree_leaves(out):
                        if isinstance(t, torch.Tensor) and t.ndim:
                            self.mark(t, Mark(t.ndim - 1, path, axis, size))
                if path == "" and root_output:
                    self.check_root_output(out)
            return hook

        for path, mod in model.named_modules():
            handles.append(mod.register_forward_pre_hook(enter(path)))
            handles.append(mod.register_forward_hook(leave(path)))
        return handles

    def carry_through(self, args, out) -> None:
        """A tensor-parallel module computes on DTensors at run time, out of the mode's sight: its input's
        marks on leading dimensions (the sequence) go to its output, whose leading dimensions are the same."""
        x = next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor)), None)
        o = out if isinstance(out, torch.Tensor) else None
        if x is None or o is None:
            return
        for m in self.of(x):
            if m.source == SEQUENCE and m.dim < o.ndim - 1 and m.dim < x.ndim and o.shape[m.dim] == x.shape[m.dim]:
                self.mark(o, m)

    def check_root_output(self, out) -> None:
        """No column-parallel piece may leave the model (raises the error itself)."""
        try:
            self.check_output(out)
        except _Refused as exc:
            raise exc.error from None

    def check_output(self, out) -> None:
        leaves = tree_leaves(out)
        if isinstance(out, Mapping) and len(leaves) == 1 and leaves[0] is out:
            leaves = list(out.values())  # a mapping pytree does not know (a Hugging Face ModelOutput)
        for t in leaves:
            for m in self.of(t):
                if m.source != SEQUENCE:
                    self.refuse(m, "reaches the model's output", "the model returns it")

    # -- messages --------------------------------------------------------------------------------------------
    def refuse(self, m: Mark, how: str, op: str, fix: str = "") -> None:
        raise _Refused(self._error(m, how, op, fix))

    def _error(self, m: Mark, how: str, op: str, fix: str) -> Exception:
        where = self.stack[-1] if self.stack else ""
        where = repr(where) if where else "the root module"
        if m.source == SEQUENCE:
            return self.error(
                f"{op} in {where} {how}: the sequence is split over {m.axis!r} (cp={m.size}, each rank holds 2 of "
                f"{2 * m.size} chunks), so it would see this rank's chunks only and compute a wrong result, silently. "
                f"Fix: {fix or 'keep this operation out of a model trained on the cp axis, or plan without it'}")
        return self.error(
            f"the output of column-parallel module {m.source!r} (split over compute axis {m.axis!r}, {m.size} ranks) "
            f"{how} in {where} ({op}): each rank holds 1/{m.size} of its features, so this computes per-rank pieces, "
            f"silently. Fix: let only its row-parallel sibling read it (a sibling nn.Linear whose weight is split on "
            f"dim 1 over {m.axis!r}), give {m.source!r} style 'colwise_gather' (styles=[(regex, 'colwise_gather')]: "
            f"its output is all-gathered), or keep {m.axis!r} out of its weight's spec (replicated compute)")

    # -- the mode ------------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "") if self.marks else ""
        marked = [(t, m) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for m in self.of(t)] \
            if name and name != "__get__" else []
        if name in _BEFORE:  # refused before it runs (whatever it calls inside would refuse otherwise)
            self._rules(name, args, kwargs, None, marked)
        out = func(*args, **kwargs)
        self._rules(name, args, kwargs, out, marked)
        return out

    def _rules(self, name, args, kwargs, out, marked) -> None:
        for pair in marked:
            try:
                self.rule(name, args, kwargs, out, [pair])
            except Exception as exc:  # noqa: BLE001
                if isinstance(exc, _Refused):
                    raise exc.error from None
                # an argument form the rules do not know: the mark is dropped rather than the step failed

    def rule(self, name: str, args, kwargs, out, marked) -> None:
        seq = marked[0][1].source == SEQUENCE
        x, m = marked[0]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]

        def dim_arg(pos: int, default=None, keys=("dim", "axis", "dims")):
            for k in keys:
                if k in kwargs:
                    return kwargs[k]
            return args[pos] if len(args) > pos else default

        def dims_of(d, ndim) -> list[int]:
            if d is None:
                return list(range(ndim))
            return [_dim(int(i), ndim) for i in (d if isinstance(d, (tuple, list, torch.Size)) else (d,))]

        def carry(t, dim, mark=m):
            if dim is not None:
                self.mark(t, mark.at(dim))

        if name in ("unsqueeze", "squeeze"):
            for o in outs:
                if name == "unsqueeze":
                    k = _dim(int(dim_arg(1)), o.ndim)
                    carry(o, m.dim + (k <= m.dim))
                else:
                    d = dim_arg(1)
                    gone = [i for i in (dims_of(d, x.ndim) if d is not None else range(x.ndim)) if x.shape[i] == 1]
                    carry(o, None if m.dim in gone else m.dim - sum(1 for i in gone if i < m.dim))
            return
        if name in _CARRY:
            for o in outs:
                if name in ("view", "reshape") and not seq:
                    self._heads_check(args, m, x, o)
                carry(o, reshaped(m.dim, tuple(x.shape), tuple(o.shape)))
            return
        if name in _PERMUTE:
            nd = x.ndim
            if name == "t":
                perm = [1, 0] if nd == 2 else list(range(nd))
            elif name in ("transpose", "swapaxes", "swapdims"):
                a, b = _dim(args[1], nd), _dim(args[2], nd)
                perm = list(range(nd))
                perm[a], perm[b] = perm[b], perm[a]
            elif name == "permute":
                perm = [_dim(int(i), nd) for i in (args[1] if len(args) == 2 and isinstance(args[1], (tuple, list))
                                                   else args[1:] or kwargs.get("dims"))]
            else:
                src, dst = dims_of(args[1], nd), dims_of(args[2], nd)
                rest = [i for i in range(nd) if i not in src]
                perm = [None] * nd
                for s, d in zip(src, dst):
                    perm[d] = s
                it = iter(rest)
                perm = [p if p is not None else next(it) for p in perm]
            for o in outs:
                carry(o, perm.index(m.dim))
            return
        if name == "__getitem__":
            return self._index(args[1], x, m, outs)
        if name in _ALONG or name == "msort":
            d = dim_arg(_ALONG.get(name, 1), _ALONG_DEFAULT.get(name))
            if name == "roll" and d is None or name == "flip" and d is None or m.dim in dims_of(d, x.ndim):
                if name in ("narrow",) and len(args) > 3 and args[2] == 0 and args[3] == x.shape[m.dim]:
                    pass
                else:
                    self.refuse(m, "is mixed along its split dimension", f"{name}",
                                ATTENTION_FIX if name in ("softmax", "log_softmax", "_softmax", "softmin") and seq
                                else SHIFT_FIX if seq and name in ("roll", "narrow", "select", "diff") else "")
            e = m.dim - (name == "select" and _dim(dim_arg(1), x.ndim) < m.dim)
            for o in outs:
                if o.ndim > e and o.shape[e] == x.shape[m.dim]:
                    carry(o, e)
            return
        if name in _REDUCE and not (name in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor)):
            d = dim_arg(1)
            if name in ("norm", "linalg_vector_norm", "vector_norm", "quantile", "nanquantile") and "dim" not in kwargs:
                d = args[2] if len(args) > 2 else None
            if d is not None and not isinstance(d, (int, tuple, list, torch.Size)):
                d = None
            over = dims_of(d, x.ndim)
            if m.dim in over:
                if not (seq and name in _TOKEN_REDUCE):
                    self.refuse(m, "is reduced over its split dimension", name)
                return
            keep = kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
            e = m.dim if keep else m.dim - sum(1 for i in over if i < m.dim)
            for o in outs:
                if o.ndim > e and o.shape[e] == x.shape[m.dim]:
                    carry(o, e)
            return
        if name in _NORM:
            if name in ("layer_norm", "rms_norm"):
                shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
                over = list(range(x.ndim - len(shape), x.ndim))
            elif name == "normalize":
                over = dims_of(dim_arg(2, 1, ("dim",)), x.ndim)
            elif name == "batch_norm":
                over = [i for i in range(x.ndim) if i != 1]
            elif name == "instance_norm":
                over = list(range(2, x.ndim))
            else:
                over = list(range(1, x.ndim))
            if m.dim in over and x is args[0]:
                self.refuse(m, "is normalised over its split dimension", name)
            for o in outs:
                carry(o, m.dim if o.shape == x.shape else None)
            return
        if name == "multi_head_attention_forward":  # nn.MultiheadAttention: [seq, batch, embed] (or unbatched)
            key = args[1] if len(args) > 1 else kwargs.get("key")
            if x is key or x is (args[2] if len(args) > 2 else kwargs.get("value")):
                if m.dim == 0:
                    self.refuse(m, "holds the keys and values attended over", name,
                                ATTENTION_FIX if seq else "")
                if m.dim == x.ndim - 1:
                    self.refuse(m, "is contracted (the embedding)", name)
            elif x is args[0] and m.dim == x.ndim - 1:
                self.refuse(m, "is contracted (the embedding)", name)
            o = outs[0] if outs else None
            if o is not None and x is args[0] and m.dim < x.ndim - 1:
                carry(o, m.dim)
            return
        if name in _MATMUL or name in ("linear", "einsum", "scaled_dot_product_attention", "bilinear"):
            return self._contract(name, args, kwargs, outs, marked)
        if name.startswith("conv") or "pool" in name or name in ("interpolate", "upsample"):
            if x is args[0] and m.dim >= 1 and not (name.startswith("conv") and m.dim == 1 and seq):
                self.refuse(m, "is convolved or pooled along its split dimension", name)
            for o in outs:
                carry(o, m.dim if m.dim == 0 else None)
            return
        if name in ("embedding", "one_hot", "embedding_bag"):
            if x.dtype in (torch.long, torch.int, torch.int16, torch.int8, torch.uint8):
                for o in outs:
                    carry(o, m.dim)
            return
        if name in _LOSS:
            cls = 1 if x.ndim >= 2 and name in ("cross_entropy", "nll_loss") else None
            red = kwargs.get("reduction", "mean")
            if not seq or m.dim == cls:
                self.refuse(m, "is reduced over its split dimension", name)
            if red == "none":
                for o in outs:
                    carry(o, m.dim - (cls is not None and cls < m.dim))
            return
        if name == "pad":
            pad = args[1] if len(args) > 1 else kwargs.get("pad")
            for i in range(0, len(pad), 2):
                d = x.ndim - 1 - i // 2
                if d == m.dim and (pad[i] or pad[i + 1]):
                    self.refuse(m, "is padded along its split dimension (a shift?)", "pad", SHIFT_FIX if seq else "")
            for o in outs:
                carry(o, m.dim)
            return
        if name in _SPLIT:
            d = _dim(dim_arg(_SPLIT[name], 0, ("dim",)), x.ndim)
            if d == m.dim and len(outs) > 1:
                self.refuse(m, "is split into pieces along its split dimension", name)
            for o in outs:
                carry(o, m.dim - (name == "unbind" and d < m.dim))
            return
        if name in _JOIN:
            tensors = args[0] if args else kwargs.get("tensors")
            d = dim_arg(1, 0)
            ref = x
            if name == "stack":
                e = m.dim + (_dim(d, ref.ndim + 1) <= m.dim)
            else:
                if _dim(d, ref.ndim) == m.dim and any(t is not x and t.numel() for t in tensors):
                    self.refuse(m, "is concatenated along its split dimension", name)  # (an empty cache's cat: no)
                e = m.dim
            for o in outs:
                carry(o, e)
            return
        if name in ("expand", "expand_as", "broadcast_to", "repeat", "tile", "repeat_interleave"):
            for o in outs:
                e = m.dim + (o.ndim - x.ndim)
                if name == "repeat_interleave":
                    d = dim_arg(2, None, ("dim",))
                    if d is not None and _dim(d, x.ndim) == m.dim and seq:
                        self.refuse(m, "is repeated along its split dimension", name)
                    carry(o, m.dim if d is not None else None)
                elif o.shape[e] != x.shape[m.dim]:
                    self.refuse(m, "is repeated along its split dimension", name)
                else:
                    carry(o, e)
            return
        # elementwise (and unknown operations): the mark follows broadcasting, when the shapes say so
        for o in outs:
            for t, mm in marked:
                e = mm.dim + (o.ndim - t.ndim)
                if 0 <= e < o.ndim and o.shape[e] == t.shape[mm.dim]:
                    carry(o, e, mm)
                    break

    def _heads_check(self, args, m: Mark, x, o) -> None:
        """``view(b, t, heads, -1)`` of a column-parallel output: the head count fixed, the width inferred,
        so every head is spread over the ranks (``view(b, t, -1, head_dim)`` keeps whole heads on each)."""
        shape = args[1:] if len(args) > 1 and not isinstance(args[1], (tuple, list, torch.Size)) else \
            (args[1] if len(args) > 1 else ())
        shape = list(shape)
        if -1 not in shape or len(shape) != o.ndim:
            return
        e = reshaped(m.dim, tuple(x.shape), tuple(o.shape))
        inferred = shape.index(-1)
        if e is not None and inferred > e and o.shape[e] != x.shape[m.dim] and \
                math.prod(o.shape[e:]) == math.prod(x.shape[m.dim:]):
            self.refuse(m, f"is split into {o.shape[e]} groups of an inferred width", f"{tuple(shape)}: a fixed count "
                        f"before -1", "")

    def _index(self, idx, x, m: Mark, outs) -> None:
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(i, torch.Tensor) or isinstance(i, (list,)) for i in idx):
            # advanced indexing: refused on the split dimension, elsewhere the mark is dropped
            pos = self._positions(idx, x.ndim)
            if pos.get(m.dim) is not None and not (isinstance(pos[m.dim], slice) and pos[m.dim] == slice(None)):
                self.refuse(m, "is indexed along its split dimension", "indexing", SHIFT_FIX if m.source == SEQUENCE else "")
            return
        pos = self._positions(idx, x.ndim)
        entry = pos.get(m.dim, slice(None))
        if isinstance(entry, slice):
            n = x.shape[m.dim]
            full = entry.step in (None, 1) and entry.start in (None, 0) and (entry.stop is None or entry.stop >= n)
            if not full and tuple(range(n)[entry]) != tuple(range(n)):
                self.refuse(m, "is sliced along its split dimension", "indexing",
                            SHIFT_FIX if m.source == SEQUENCE else "")
        else:
            self.refuse(m, "is indexed along its split dimension", "indexing", SHIFT_FIX if m.source == SEQUENCE else "")
        # the output dimension: count the entries before the split one that keep or add a dimension
        e = 0
        d_in = 0
        for i in self._expanded(idx, x.ndim):
            if i is None:
                e += 1
                continue
            if d_in == m.dim:
                break
            if isinstance(i, slice):
                e += 1
            d_in += 1
        for o in outs:
            if o.ndim > e and o.shape[e] == x.shape[m.dim]:
                self.mark(o, m.at(e))

    @staticmethod
    def _expanded(idx, ndim: int) -> list:
        used = sum(1 for i in idx if i is not None and i is not Ellipsis)
        out = []
        for i in idx:
            if i is Ellipsis:
                out += [slice(None)] * (ndim - used)
            else:
                out.append(i)
        real = sum(1 for i in out if i is not None)
        return out + [slice(None)] * (ndim - real)

    @classmethod
    def _positions(cls, idx, ndim: int) -> dict:
        pos, d = {}, 0
        for i in cls._expanded(idx, ndim):
            if i is None:
                continue
            pos[d] = i
            d += 1
        return pos

    def _contract(self, name, args, kwargs, outs, marked) -> None:
        if name == "scaled_dot_product_attention":
            q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")][len(args):])[:3]
            o = outs[0] if outs else None
            for t, m in marked:
                if t is q:
                    if m.dim == q.ndim - 1:
                        self.refuse(m, "is contracted (queries' head width)", "scaled_dot_product_attention")
                    if o is not None:
                        self.mark(o, m.at(m.dim + o.ndim - q.ndim))
                elif t is k or t is v:
                    if m.dim == t.ndim - 2:
                        if m.source == SEQUENCE and self.through_attention():
                            continue
                        self.refuse(m, "holds the keys and values attended over", "scaled_dot_product_attention",
                                    ATTENTION_FIX if m.source == SEQUENCE else "")
                    if m.dim == t.ndim - 1 and t is k:
                        self.refuse(m, "is contracted (keys' head width)", "scaled_dot_product_attention")
                    if o is not None and m.dim < t.ndim - 2:
                        self.mark(o, m.at(m.dim + o.ndim - t.ndim))
            return
        if name == "linear" or name == "bilinear":
            x = args[0] if args else kwargs.get("input")
            for t, m in marked:
                if t is x and m.dim == x.ndim - 1:
                    inside = self.rowwise.get(self.stack[-1]) if self.stack else None
                    if m.source != SEQUENCE and inside == m.axis:
                        return  # a row-parallel module: its partial sums are all-reduced (the plan's own op)
                    self.refuse(m, "is contracted by a linear layer that is not its row-parallel sibling", name)
                if t is x:
                    for o in outs:
                        self.mark(o, m.at(m.dim))
            return
        if name == "einsum":
            return self._einsum(args, outs, marked)
        pairs = {"addmm": (1, 2), "baddbmm": (1, 2), "addbmm": (1, 2), "addmv": (1, 2)}
        ia, ib = pairs.get(name, (0, 1))
        a, b = args[ia], args[ib]
        o = outs[0] if outs else None
        for t, m in marked:
            if t is a:
                if m.dim == a.ndim - 1:
                    self.refuse(m, "is contracted by a matrix product", name,
                                ATTENTION_FIX if m.source == SEQUENCE else "")
                if o is not None and b.ndim >= 2:
                    self.mark(o, m.at(m.dim + o.ndim - a.ndim))
                elif o is not None:
                    self.mark(o, m.at(m.dim + o.ndim - (a.ndim - 1)))
            elif t is b:
                if b.ndim == 1 or m.dim == b.ndim - 2:
                    self.refuse(m, "is contracted by a matrix product", name,
                                ATTENTION_FIX if m.source == SEQUENCE else "")
                if o is not None:
                    self.mark(o, m.at(o.ndim - 1 if m.dim == b.ndim - 1 else m.dim + o.ndim - b.ndim))

    def _einsum(self, args, outs, marked) -> None:
        eq = args[0].replace(" ", "")
        ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
        lhs, _, rhs = eq.partition("->")
        terms = lhs.split(",")
        most = max((t.ndim - (len(s) - 3) if "..." in s else 0) for s, t in zip(terms, ops))
        ell = [chr(ord("A") + i) for i in range(most)]

        def expand(s, nd):
            if "..." not in s:
                return list(s)
            n = nd - (len(s) - 3)
            head, tail = s.split("...")
            return list(head) + ell[most - n:] + list(tail)

        letters = [expand(s, t.ndim) for s, t in zip(terms, ops)]
        if "->" in eq:
            out_letters = expand(rhs, len(rhs.replace("...", "")) + most) if "..." in rhs else list(rhs)
        else:
            flat = [c for ls in letters for c in ls if c not in ell]
            out_letters = ell + sorted(c for c in set(flat) if flat.count(c) == 1)
        o = outs[0] if outs else None
        for t, m in marked:
            i = next((j for j, u in enumerate(ops) if u is t), None)
            if i is None:
                continue
            c = letters[i][m.dim]
            if c not in out_letters:
                self.refuse(m, "is contracted by einsum", f"einsum({eq!r})",
                            ATTENTION_FIX if m.source == SEQUENCE else "")
            elif o is not None:
                self.mark(o, m.at(out_letters.index(c)))


def check(model, args, kwargs, error: Callable[[str], Exception], colwise=None, rowwise=None, cp: int = 1,
          through_attention: Callable[[], bool] = lambda: False, run: Optional[Callable[[], object]] = None) -> None:
    """Run one forward (``run()``, else ``model(*args, **kwargs)``) under the check; raises ``error(message)``
    at the first operation that mixes a split dimension."""
    mode = FlowCheck(error, colwise, rowwise, cp, through_attention)
    mode.mark_inputs(args, kwargs)
    handles = mode.hooks(model)
    try:
        with mode:
            run() if run is not None else model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
