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
  over tokens is the mean over the whole sequence once gradients are averaged over cp; but a product of two
  such means (a load-balancing loss), or another nonlinear function of one, is refused. An expert module
  whose code is known dropless is taken as token-local as a whole (flow_tokens.py).
* under ``tp``: any reduction over the split features (a norm over the whole width, ``sum(-1)``), a
  matrix product contracting over them outside the module's row-parallel sibling, a split of the
  features into heads whose count is fixed and width inferred (``view(b, t, heads, -1)``: every head
  spread over ranks), slicing them, a loss over them, and the output reaching the model's output.

A torch error raised by an operation on a marked tensor (a view with a model's global head count on a rank's
features) is re-raised as the refusal, naming the operation, the module, the source and the fix, chained.

The planner runs it in a traced step (``trace=``; :class:`~shardplan.errors.PlanError`) and the runtime
in the first forward of a plan that was not traced (:class:`~shardplan.errors.RuntimeShardingError`),
with the same messages. [Note: what it cannot see: operations outside torch (a custom CUDA kernel, a
Triton kernel, flash-attn called directly), data-dependent control flow, and unknown operations that
change a marked tensor's shape (the mark is dropped there). A mean over the sequence for pooling (a
classifier over whole sequences) is allowed like a loss's mean and is wrong under cp: keep such models
off the cp axis.]
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

# [Note: the rules per operation (and Mark, the tables) live in flow_rules.py; the names are re-exported here,
# where flow_guard.py and the planner have always imported them]
from .errors import ShardingError
from .flow_marks import HEADS_FIX
from .flow_rules import _BEFORE, ATTENTION_FIX, SEQUENCE, SHIFT_FIX, Mark, reshaped, rule  # noqa: F401
from .flow_tokens import PARTIAL_FIX, Frame, mark_outputs, open_frame, partial_rule, trusted_experts, why_not

_LIVE: list = []  # the checks entered now (dispatch and combine report to them: routed())


def routed(module, what: str) -> None:
    """``sp.expert_parallel.dispatch`` (``what="dispatch"``) and ``combine`` report that ``module`` moved its
    tokens through them: a check that holds the module's call open takes it as token-local (flow_tokens.py)."""
    for chk in _LIVE:
        for f in chk.frames:
            if f.module is module:
                f.routed.add(what)


def _plain(t) -> bool:
    """Only plain tensors carry marks (a DTensor is the runtime's own, already placed)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


class _Refused(Exception):
    def __init__(self, error: Exception, seq: bool = False):
        super().__init__(str(error))
        self.error, self.seq = error, seq


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
        self.partial = WeakIdKeyDictionary()  # a rank's partial means over the sequence -> the mark reduced
        self.frames: list[Frame] = []          # expert modules' calls held open (flow_tokens.py)
        self.stack: list[str] = [""]
        self.live = True

    def __enter__(self):
        _LIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        if self in _LIVE:
            _LIVE.remove(self)
        return super().__exit__(*exc)

    # -- marks ---------------------------------------------------------------------------------------------
    def mark(self, t, m: Optional[Mark]) -> None:
        """Add ``m`` to ``t``'s marks (a tensor may carry the sequence's and a column-parallel output's)."""
        if m is not None and isinstance(t, torch.Tensor) and _plain(t) and 0 <= m.dim < t.ndim:
            have = self.marks.get(t, ())
            self.marks[t] = tuple(h for h in have if h.source != m.source) + (m,)

    def of(self, t) -> tuple:
        return self.marks.get(t, ()) if isinstance(t, torch.Tensor) and _plain(t) else ()

    def mark_partial(self, t, m: Mark) -> None:
        """``t`` is this rank's partial mean (or sum, or count) over the split sequence (flow_tokens.py's Note)."""
        if isinstance(t, torch.Tensor) and _plain(t):
            self.partial[t] = m

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
            def hook(mod, args):
                if self.live:
                    self.stack.append(path)
                    frame = open_frame(path, mod, args, self.of, SEQUENCE)
                    if frame is not None:
                        self.frames.append(frame)
            return hook

        def leave(path):
            def hook(_m, args, out):
                if not self.live:
                    return
                if self.stack and self.stack[-1] == path:
                    self.stack.pop()
                if self.frames and self.frames[-1].path == path and self.frames[-1].module is _m:
                    self.close(self.frames.pop(), out)
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

    def close(self, frame: Frame, out) -> None:
        """An expert module's call returned: token-local (its outputs marked like its token input) when the code
        that ran is known dropless, else the refusal held back is raised (flow_tokens.py's Note)."""
        if trusted_experts(frame.module) or frame.routed >= {"dispatch", "combine"}:
            mark_outputs(frame, out, self.mark)
        elif frame.held is not None:
            raise self.error(str(frame.held) + why_not(frame)) from frame.held

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
        raise _Refused(self._error(m, how, op, fix), m.source == SEQUENCE)

    def _error(self, m: Mark, how: str, op: str, fix: str) -> Exception:
        where = self.stack[-1] if self.stack else ""
        where = repr(where) if where else "the root module"
        if m.source == SEQUENCE:
            return self.error(
                f"{op} in {where} {how}: the sequence is split over {m.axis!r} (cp={m.size}, each rank holds 2 of "
                f"{2 * m.size} chunks), so it would see this rank's chunks only and compute a wrong result, silently. "
                f"Fix: {fix or 'keep this operation out of a model trained on the cp axis, or plan without it'}")
        default = (f"let only its row-parallel sibling read it (a sibling nn.Linear whose weight is split on dim 1 "
                   f"over {m.axis!r}), give {m.source!r} style 'colwise_gather' (styles=[(regex, 'colwise_gather')]: "
                   f"its output is all-gathered), or keep {m.axis!r} out of its weight's spec (replicated compute)")
        return self.error(
            f"the output of column-parallel module {m.source!r} (split over compute axis {m.axis!r}, {m.size} ranks) "
            f"{how} in {where} ({op}): each rank holds 1/{m.size} of its features"
            + (f". Fix: {fix}" if fix else f", so this computes per-rank pieces, silently. Fix: {default}"))

    def _failed(self, m: Mark, op: str, exc: Exception) -> Exception:
        """The refusal for a torch error raised by an operation on a split tensor: it computes on this rank's
        part with a size the model took from the whole (a head count from its config, a sequence length)."""
        where = self.stack[-1] if self.stack else ""
        where = repr(where) if where else "the root module"
        raised = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if m.source == SEQUENCE:
            return self.error(
                f"{op} in {where} failed on a tensor whose sequence is split over {m.axis!r} (cp={m.size}, each rank "
                f"holds 2 of {2 * m.size} chunks: 1/{m.size} of the tokens) ({raised}): the model computes with a size "
                f"of the whole sequence. Fix: take sizes from the local shapes (x.shape), or keep this module out of "
                f"a model trained on the cp axis (docs/context_parallel.md)")
        return self.error(
            f"{op} in {where} failed on the output of column-parallel module {m.source!r} (split over compute axis "
            f"{m.axis!r}, {m.size} ranks: each rank holds 1/{m.size} of its features) ({raised}): the model computes "
            f"with a size of the whole width. Fix: " + HEADS_FIX.format(axis=m.axis))

    # -- the mode ------------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "") if self.marks else ""
        marked = [(t, m) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for m in self.of(t)] \
            if name and name != "__get__" else []
        if name in _BEFORE:  # refused before it runs (whatever it calls inside would refuse otherwise)
            self._rules(name, args, kwargs, None, marked)
        try:
            out = func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised as the refusal it is, chained
            if not marked or isinstance(exc, (_Refused, ShardingError)):
                raise
            raise self._failed(marked[0][1], name, exc) from exc
        self._rules(name, args, kwargs, out, marked)
        if name and self.partial:
            self._partial(name, args, kwargs, out)
        return out

    def _rules(self, name, args, kwargs, out, marked) -> None:
        for pair in marked:
            try:
                rule(self, name, args, kwargs, out, [pair])
            except Exception as exc:  # noqa: BLE001
                if isinstance(exc, _Refused):
                    self._raise(exc)
                    return
                # an argument form the rules do not know: the mark is dropped rather than the step failed

    def _raise(self, exc: _Refused) -> None:
        """Raise a refusal, or hold back one about the sequence inside an expert module's call (flow_tokens.py)."""
        if exc.seq and self.frames:
            if self.frames[-1].held is None:
                self.frames[-1].held = exc.error
            return
        raise exc.error from None

    def _partial(self, name, args, kwargs, out) -> None:
        """Partial means over the sequence: kept through linear operations, refused in any other."""
        found = {id(t): self.partial[t] for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and _plain(t) and t in self.partial}
        if not found:
            return
        what = partial_rule(name, args, kwargs, found)
        if what == "keep":
            for t in tree_leaves(out):
                self.mark_partial(t, next(iter(found.values())))
        elif what != "drop":
            try:
                self.refuse(next(iter(found.values())), what, name, PARTIAL_FIX)
            except _Refused as exc:
                self._raise(exc)


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
