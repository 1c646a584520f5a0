"""The rules of :mod:`shardplan.flow`'s check, one family of operations each: how a split dimension's mark
moves from an operation's inputs to its outputs (views, permutations, indexing, reductions, normalisations,
attention, matrix products, einsum, convolutions, losses, pads, splits, joins, repeats, elementwise), and which
operations are refused because they mix it. ``Mark`` and the operation tables live here too; the mode that
calls :func:`rule` for each marked argument (and the messages) is ``flow.py``'s ``FlowCheck``, passed in as
``chk`` (its ``mark``, ``refuse``, ``rowwise``, ``stack`` and ``through_attention``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._pytree import tree_leaves

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


class _Call:
    """One marked argument ``x`` (its mark ``m``) of one call of operation ``name``: the argument readers and
    the carry of a mark to an output that every rule family uses."""

    def __init__(self, chk, name: str, args, kwargs, out, marked):
        self.chk, self.name, self.args, self.kwargs, self.marked = chk, name, args, kwargs, marked
        self.seq = marked[0][1].source == SEQUENCE
        self.x, self.m = marked[0]
        self.outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]

    def dim_arg(self, pos: int, default=None, keys=("dim", "axis", "dims")):
        for k in keys:
            if k in self.kwargs:
                return self.kwargs[k]
        return self.args[pos] if len(self.args) > pos else default

    @staticmethod
    def dims_of(d, ndim) -> list[int]:
        if d is None:
            return list(range(ndim))
        return [_dim(int(i), ndim) for i in (d if isinstance(d, (tuple, list, torch.Size)) else (d,))]

    def carry(self, t, dim, mark=None):
        if dim is not None:
            self.chk.mark(t, (mark or self.m).at(dim))

    def refuse(self, how: str, op: str, fix: str = "") -> None:
        self.chk.refuse(self.m, how, op, fix)


def rule(chk, name: str, args, kwargs, out, marked) -> None:
    """Where the mark of ``marked[0]`` (a (tensor, Mark) pair of this call's arguments) goes in ``out``, or
    ``chk.refuse`` when the operation mixes it. The families are tried in this order (a name in two tables
    takes the first); an operation none of them knows is elementwise."""
    c = _Call(chk, name, args, kwargs, out, marked)
    if name in ("unsqueeze", "squeeze"):
        return _squeeze(c)
    if name in _CARRY:
        return _carry(c)
    if name in _PERMUTE:
        return _permute(c)
    if name == "__getitem__":
        return _index(chk, args[1], c.x, c.m, c.outs)
    if name in _ALONG or name == "msort":
        return _along(c)
    if name in _REDUCE and not (name in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor)):
        return _reduce(c)
    if name in _NORM:
        return _norm(c)
    if name == "multi_head_attention_forward":  # nn.MultiheadAttention: [seq, batch, embed] (or unbatched)
        return _multi_head_attention(c)
    if name in _MATMUL or name in ("linear", "einsum", "scaled_dot_product_attention", "bilinear"):
        return _contract(chk, name, args, kwargs, c.outs, marked)
    if name.startswith("conv") or "pool" in name or name in ("interpolate", "upsample"):
        return _conv(c)
    if name in ("embedding", "one_hot", "embedding_bag"):
        return _embedding(c)
    if name in _LOSS:
        return _loss(c)
    if name == "pad":
        return _pad(c)
    if name in _SPLIT:
        return _split(c)
    if name in _JOIN:
        return _join(c)
    if name in ("expand", "expand_as", "broadcast_to", "repeat", "tile", "repeat_interleave"):
        return _repeat(c)
    return _elementwise(c)


def _squeeze(c: _Call) -> None:
    x, m = c.x, c.m
    for o in c.outs:
        if c.name == "unsqueeze":
            k = _dim(int(c.dim_arg(1)), o.ndim)
            c.carry(o, m.dim + (k <= m.dim))
        else:
            d = c.dim_arg(1)
            gone = [i for i in (c.dims_of(d, x.ndim) if d is not None else range(x.ndim)) if x.shape[i] == 1]
            c.carry(o, None if m.dim in gone else m.dim - sum(1 for i in gone if i < m.dim))


def _carry(c: _Call) -> None:
    for o in c.outs:
        if c.name in ("view", "reshape") and not c.seq:
            _heads_check(c.chk, c.args, c.m, c.x, o)
        c.carry(o, reshaped(c.m.dim, tuple(c.x.shape), tuple(o.shape)))


def _permute(c: _Call) -> None:
    name, args, kwargs = c.name, c.args, c.kwargs
    nd = c.x.ndim
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
        src, dst = c.dims_of(args[1], nd), c.dims_of(args[2], nd)
        rest = [i for i in range(nd) if i not in src]
        perm = [None] * nd
        for s, d in zip(src, dst):
            perm[d] = s
        it = iter(rest)
        perm = [p if p is not None else next(it) for p in perm]
    for o in c.outs:
        c.carry(o, perm.index(c.m.dim))


def _along(c: _Call) -> None:
    name, args, x, m, seq = c.name, c.args, c.x, c.m, c.seq
    d = c.dim_arg(_ALONG.get(name, 1), _ALONG_DEFAULT.get(name))
    if name == "roll" and d is None or name == "flip" and d is None or m.dim in c.dims_of(d, x.ndim):
        if name in ("narrow",) and len(args) > 3 and args[2] == 0 and args[3] == x.shape[m.dim]:
            pass
        else:
            c.refuse("is mixed along its split dimension", f"{name}",
                     ATTENTION_FIX if name in ("softmax", "log_softmax", "_softmax", "softmin") and seq
                     else SHIFT_FIX if seq and name in ("roll", "narrow", "select", "diff") else "")
    e = m.dim - (name == "select" and _dim(c.dim_arg(1), x.ndim) < m.dim)
    for o in c.outs:
        if o.ndim > e and o.shape[e] == x.shape[m.dim]:
            c.carry(o, e)


def _reduce(c: _Call) -> None:
    name, args, kwargs, x, m = c.name, c.args, c.kwargs, c.x, c.m
    d = c.dim_arg(1)
    if name in ("norm", "linalg_vector_norm", "vector_norm", "quantile", "nanquantile") and "dim" not in kwargs:
        d = args[2] if len(args) > 2 else None
    if d is not None and not isinstance(d, (int, tuple, list, torch.Size)):
        d = None
    over = c.dims_of(d, x.ndim)
    if m.dim in over:
        if not (c.seq and name in _TOKEN_REDUCE):
            c.refuse("is reduced over its split dimension", name)
        return
    keep = kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
    e = m.dim if keep else m.dim - sum(1 for i in over if i < m.dim)
    for o in c.outs:
        if o.ndim > e and o.shape[e] == x.shape[m.dim]:
            c.carry(o, e)


def _norm(c: _Call) -> None:
    name, args, kwargs, x, m = c.name, c.args, c.kwargs, c.x, c.m
    if name in ("layer_norm", "rms_norm"):
        shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
        over = list(range(x.ndim - len(shape), x.ndim))
    elif name == "normalize":
        over = c.dims_of(c.dim_arg(2, 1, ("dim",)), x.ndim)
    elif name == "batch_norm":
        over = [i for i in range(x.ndim) if i != 1]
    elif name == "instance_norm":
        over = list(range(2, x.ndim))
    else:
        over = list(range(1, x.ndim))
    if m.dim in over and x is args[0]:
        c.refuse("is normalised over its split dimension", name)
    for o in c.outs:
        c.carry(o, m.dim if o.shape == x.shape else None)


def _multi_head_attention(c: _Call) -> None:
    name, args, kwargs, x, m = c.name, c.args, c.kwargs, c.x, c.m
    key = args[1] if len(args) > 1 else kwargs.get("key")
    if x is key or x is (args[2] if len(args) > 2 else kwargs.get("value")):
        if m.dim == 0:
            c.refuse("holds the keys and values attended over", name, ATTENTION_FIX if c.seq else "")
        if m.dim == x.ndim - 1:
            c.refuse("is contracted (the embedding)", name)
    elif x is args[0] and m.dim == x.ndim - 1:
        c.refuse("is contracted (the embedding)", name)
    o = c.outs[0] if c.outs else None
    if o is not None and x is args[0] and m.dim < x.ndim - 1:
        c.carry(o, m.dim)


def _conv(c: _Call) -> None:
    name, x, m = c.name, c.x, c.m
    if x is c.args[0] and m.dim >= 1 and not (name.startswith("conv") and m.dim == 1 and c.seq):
        c.refuse("is convolved or pooled along its split dimension", name)
    for o in c.outs:
        c.carry(o, m.dim if m.dim == 0 else None)


def _embedding(c: _Call) -> None:
    if c.x.dtype in (torch.long, torch.int, torch.int16, torch.int8, torch.uint8):
        for o in c.outs:
            c.carry(o, c.m.dim)


def _loss(c: _Call) -> None:
    name, x, m = c.name, c.x, c.m
    cls = 1 if x.ndim >= 2 and name in ("cross_entropy", "nll_loss") else None
    red = c.kwargs.get("reduction", "mean")
    if not c.seq or m.dim == cls:
        c.refuse("is reduced over its split dimension", name)
    if red == "none":
        for o in c.outs:
            c.carry(o, m.dim - (cls is not None and cls < m.dim))


def _pad(c: _Call) -> None:
    x, m = c.x, c.m
    pad = c.args[1] if len(c.args) > 1 else c.kwargs.get("pad")
    for i in range(0, len(pad), 2):
        d = x.ndim - 1 - i // 2
        if d == m.dim and (pad[i] or pad[i + 1]):
            c.refuse("is padded along its split dimension (a shift?)", "pad", SHIFT_FIX if c.seq else "")
    for o in c.outs:
        c.carry(o, m.dim)


def _split(c: _Call) -> None:
    name, m = c.name, c.m
    d = _dim(c.dim_arg(_SPLIT[name], 0, ("dim",)), c.x.ndim)
    if d == m.dim and len(c.outs) > 1:
        c.refuse("is split into pieces along its split dimension", name)
    for o in c.outs:
        c.carry(o, m.dim - (name == "unbind" and d < m.dim))


def _join(c: _Call) -> None:
    name, x, m = c.name, c.x, c.m
    tensors = c.args[0] if c.args else c.kwargs.get("tensors")
    d = c.dim_arg(1, 0)
    ref = x
    if name == "stack":
        e = m.dim + (_dim(d, ref.ndim + 1) <= m.dim)
    else:
        if _dim(d, ref.ndim) == m.dim and any(t is not x and t.numel() for t in tensors):
            c.refuse("is concatenated along its split dimension", name)  # (an empty cache's cat: no)
        e = m.dim
    for o in c.outs:
        c.carry(o, e)


def _repeat(c: _Call) -> None:
    name, x, m = c.name, c.x, c.m
    for o in c.outs:
        e = m.dim + (o.ndim - x.ndim)
        if name == "repeat_interleave":
            d = c.dim_arg(2, None, ("dim",))
            if d is not None and _dim(d, x.ndim) == m.dim and c.seq:
                c.refuse("is repeated along its split dimension", name)
            c.carry(o, m.dim if d is not None else None)
        elif o.shape[e] != x.shape[m.dim]:
            c.refuse("is repeated along its split dimension", name)
        else:
            c.carry(o, e)


def _elementwise(c: _Call) -> None:
    """Elementwise (and unknown operations): the mark follows broadcasting, when the shapes say so."""
    for o in c.outs:
        for t, mm in c.marked:
            e = mm.dim + (o.ndim - t.ndim)
            if 0 <= e < o.ndim and o.shape[e] == t.shape[mm.dim]:
                c.carry(o, e, mm)
                break


def _heads_check(chk, args, m: Mark, x, o) -> None:
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
        chk.refuse(m, f"is split into {o.shape[e]} groups of an inferred width", f"{tuple(shape)}: a fixed count "
                   f"before -1", "")


def _index(chk, idx, x, m: Mark, outs) -> None:
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(isinstance(i, torch.Tensor) or isinstance(i, (list,)) for i in idx):
        # advanced indexing: refused on the split dimension, elsewhere the mark is dropped
        pos = _positions(idx, x.ndim)
        if pos.get(m.dim) is not None and not (isinstance(pos[m.dim], slice) and pos[m.dim] == slice(None)):
            chk.refuse(m, "is indexed along its split dimension", "indexing", SHIFT_FIX if m.source == SEQUENCE else "")
        return
    pos = _positions(idx, x.ndim)
    entry = pos.get(m.dim, slice(None))
    if isinstance(entry, slice):
        n = x.shape[m.dim]
        full = entry.step in (None, 1) and entry.start in (None, 0) and (entry.stop is None or entry.stop >= n)
        if not full and tuple(range(n)[entry]) != tuple(range(n)):
            chk.refuse(m, "is sliced along its split dimension", "indexing",
                       SHIFT_FIX if m.source == SEQUENCE else "")
    else:
        chk.refuse(m, "is indexed along its split dimension", "indexing", SHIFT_FIX if m.source == SEQUENCE else "")
    # the output dimension: count the entries before the split one that keep or add a dimension
    e = 0
    d_in = 0
    for i in _expanded(idx, x.ndim):
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
            chk.mark(o, m.at(e))


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


def _positions(idx, ndim: int) -> dict:
    pos, d = {}, 0
    for i in _expanded(idx, ndim):
        if i is None:
            continue
        pos[d] = i
        d += 1
    return pos


def _contract(chk, name, args, kwargs, outs, marked) -> None:
    if name == "scaled_dot_product_attention":
        q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")][len(args):])[:3]
        o = outs[0] if outs else None
        for t, m in marked:
            if t is q:
                if m.dim == q.ndim - 1:
                    chk.refuse(m, "is contracted (queries' head width)", "scaled_dot_product_attention")
                if o is not None:
                    chk.mark(o, m.at(m.dim + o.ndim - q.ndim))
            elif t is k or t is v:
                if m.dim == t.ndim - 2:
                    if m.source == SEQUENCE and chk.through_attention():
                        continue
                    chk.refuse(m, "holds the keys and values attended over", "scaled_dot_product_attention",
                               ATTENTION_FIX if m.source == SEQUENCE else "")
                if m.dim == t.ndim - 1 and t is k:
                    chk.refuse(m, "is contracted (keys' head width)", "scaled_dot_product_attention")
                if o is not None and m.dim < t.ndim - 2:
                    chk.mark(o, m.at(m.dim + o.ndim - t.ndim))
        return
    if name == "linear" or name == "bilinear":
        x = args[0] if args else kwargs.get("input")
        for t, m in marked:
            if t is x and m.dim == x.ndim - 1:
                inside = chk.rowwise.get(chk.stack[-1]) if chk.stack else None
                if m.source != SEQUENCE and inside == m.axis:
                    return  # a row-parallel module: its partial sums are all-reduced (the plan's own op)
                chk.refuse(m, "is contracted by a linear layer that is not its row-parallel sibling", name)
            if t is x:
                for o in outs:
                    chk.mark(o, m.at(m.dim))
        return
    if name == "einsum":
        return _einsum(chk, args, outs, marked)
    pairs = {"addmm": (1, 2), "baddbmm": (1, 2), "addbmm": (1, 2), "addmv": (1, 2)}
    ia, ib = pairs.get(name, (0, 1))
    a, b = args[ia], args[ib]
    o = outs[0] if outs else None
    for t, m in marked:
        if t is a:
            if m.dim == a.ndim - 1:
                chk.refuse(m, "is contracted by a matrix product", name,
                           ATTENTION_FIX if m.source == SEQUENCE else "")
            if o is not None and b.ndim >= 2:
                chk.mark(o, m.at(m.dim + o.ndim - a.ndim))
            elif o is not None:
                chk.mark(o, m.at(m.dim + o.ndim - (a.ndim - 1)))
        elif t is b:
            if b.ndim == 1 or m.dim == b.ndim - 2:
                chk.refuse(m, "is contracted by a matrix product", name,
                           ATTENTION_FIX if m.source == SEQUENCE else "")
            if o is not None:
                chk.mark(o, m.at(o.ndim - 1 if m.dim == b.ndim - 1 else m.dim + o.ndim - b.ndim))


def _einsum(chk, args, outs, marked) -> None:
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
            chk.refuse(m, "is contracted by einsum", f"einsum({eq!r})",
                       ATTENTION_FIX if m.source == SEQUENCE else "")
        elif o is not None:
            chk.mark(o, m.at(out_letters.index(c)))
