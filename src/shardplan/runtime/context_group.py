"""Context parallelism's group at run time: which ``cp`` group :func:`~shardplan.runtime.context_attention.attention`
gathers over now, bound to the sharded model (its root's hooks for the forward, the autograd graph task for the
backward), the guard against attention a cp model computes itself, and :func:`positions`, the chunks each rank
holds (the face, :mod:`shardplan.runtime.context_parallel`, re-exports what users call).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import RuntimeShardingError, ShardingError
from ..metatrace import forward_parameters, training_call
from ..optraffic import tensors_in
from ..units import in_cp_attention, tracing
from . import collectives as C
from .axis_ops import AxisOps
from .builder import engine_of

CONTEXT_AXIS = "cp"


@dataclass(frozen=True, eq=False)
class ContextGroup:
    """The ``cp`` group of this rank: its size and this rank's index (``group.rank``); ``ops``: a traced plan's
    K/V ops by (calling module, phase), which :func:`attention` runs through the executor (runtime/axis_ops.py);
    ``calling``: the stack of those modules now running (their forward hooks keep it)."""

    group: C.Group
    ops: AxisOps = field(default_factory=AxisOps)
    calling: list = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def engine(self) -> Optional[Callable[[], object]]:
        """A weak reference to the executor (``None``: none records this group's ops)."""
        return self.ops.engine


# [Note: the group is the sharded model's, not the process's] attention() is context-parallel only while the
# model whose plan has cp > 1 runs: during its forward (bound by hooks on its root module, in this thread's
# context: _BOUND) and during its backward (bound for the autograd graph task that runs it: _BACKWARD, keyed by
# the task's id, set by a hook on the forward's outputs and dropped by a callback when the task ends). The
# backward binding covers what module hooks alone miss: an activation-checkpointed unit's recompute, which
# calls attention() again inside the backward, on the autograd engine's thread (a GPU's backward runs on a
# thread of its own). Any other model in the process (a reference, an evaluation copy) attends plainly when it
# runs outside that model's forward and backward; disabled() is not needed for it.
_BOUND: contextvars.ContextVar[tuple] = contextvars.ContextVar("shardplan_cp_bound", default=())
_BACKWARD: dict = {}  # graph task id -> the group of the model whose backward it runs (_Mixed: two models')
_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # executor -> its ContextGroup
_LAST: contextvars.ContextVar = contextvars.ContextVar("shardplan_cp_last", default=None)  # loss_mean's default


def active() -> Optional[ContextGroup]:
    """The context-parallel group :func:`attention` gathers over now: that of the sharded model whose forward or
    backward is running (``None``: no such model runs, or inside :func:`disabled`)."""
    bound = _BOUND.get()
    if bound:
        return bound[-1]
    if _BACKWARD:
        g = _BACKWARD.get(torch._C._current_graph_task_id())
        if isinstance(g, _Mixed):
            raise RuntimeShardingError(
                f"context-parallel attention ran again inside one backward through two context-parallel models "
                f"(cp={g.groups[0].size} and cp={g.groups[1].size}, each its own group): an activation-checkpointed "
                f"attention's recompute, which cannot tell whose keys and values it gathers, nor over which group. "
                f"Run one backward per model (loss_a.backward(retain_graph=...) then loss_b.backward()), or keep "
                f"attention out of activation checkpointing in these models")
        return g
    return None


@dataclass(frozen=True)
class _Mixed:
    """The binding of a graph task that runs the backward of two context-parallel models (see :func:`active`)."""
    groups: tuple


@contextlib.contextmanager
def disabled():
    """Plain attention inside, even while a context-parallel model runs (a model that is not context-parallel
    called from inside one's forward). A model run outside the context-parallel model's forward and backward
    attends plainly without it; it stays for code written when the group was the process's.

    >>> with sp.context_parallel.disabled(): ref_loss = reference(x, y)
    """
    token = _BOUND.set(_BOUND.get() + (None,))
    try:
        yield
    finally:
        _BOUND.reset(token)


def group_of(model) -> Optional[ContextGroup]:
    """The context-parallel group of a model ``shard()`` ran with a plan of ``cp > 1`` (``None``: not one).

    >>> sp.context_parallel.group_of(model).size
    2
    """
    try:
        exe = engine_of(model)
    except ShardingError:
        return None
    return _GROUPS.get(exe) if exe is not None else None


_SDPA = F.scaled_dot_product_attention
_MHA = F.multi_head_attention_forward


class _Guard(TorchFunctionMode):
    """Active while a context-parallel model's forward runs: refuses attention the model computes itself.

    [Note: a model that calls ``F.scaled_dot_product_attention`` itself (Hugging Face's sdpa attention, a user's
    block), or ``nn.MultiheadAttention``, would attend over this rank's sequence chunks only: a wrong loss,
    silently. Inside the forward such a call is refused, naming the fix; ``attention()`` marks its own call
    (units.cp_attention), and a traced step (the planner's) and ``disabled()`` blocks pass through. Seen through
    torch's override protocol, so a name the model bound to the function itself is seen too. The dataflow check
    of an untraced plan's first forward (runtime/flow_guard.py) runs above this mode and refuses first, naming
    the module.]"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (func is _SDPA or func is _MHA) and not in_cp_attention() and not tracing():
            g = active()
            if g is not None:
                what = "F.scaled_dot_product_attention" if func is _SDPA else \
                    "F.multi_head_attention_forward (nn.MultiheadAttention)"
                raise RuntimeShardingError(
                    f"{what} was called directly while context parallelism is on (cp={g.size}): it would attend "
                    f"over this rank's 1/{g.size} of the sequence only. Call "
                    f"shardplan.context_parallel.attention(q, k, v, is_causal=True) in the model instead, or run a "
                    f"model that is not context-parallel inside shardplan.context_parallel.disabled()")
        return func(*args, **(kwargs or {}))


def _push(g: ContextGroup) -> None:
    _BOUND.set(_BOUND.get() + (g,))


def _pop(g: ContextGroup) -> None:
    bound = _BOUND.get()
    for i in range(len(bound) - 1, -1, -1):
        if bound[i] is g:
            _BOUND.set(bound[:i] + bound[i + 1:])
            return


def _bind_backward(g: ContextGroup, output) -> None:
    """Bind ``g`` for the backward that will reach ``output``: a hook on each of its tensors that takes gradients
    names ``g`` for the graph task running it (the first gradient of the model's outputs comes before any of its
    recomputes), until the task ends."""
    for stale in [k for k, v in _BACKWARD.items() if v is g or (isinstance(v, _Mixed) and g in v.groups)]:
        _BACKWARD.pop(stale, None)  # a backward of the model's that raised

    def bind(_grad) -> None:
        task = torch._C._current_graph_task_id()
        now = _BACKWARD.get(task)
        if now is None:
            _BACKWARD[task] = g

            def unbind() -> None:
                _BACKWARD.pop(task, None)
            torch.autograd.Variable._execution_engine.queue_callback(unbind)
        elif now is not g and not isinstance(now, _Mixed):
            # [Note: one graph task, two models' groups] a recompute in this backward could be either model's:
            # refused when one asks (active()), rather than gathered over the group bound last
            _BACKWARD[task] = _Mixed((now, g))

    for t in tensors_in(output):
        if t.requires_grad:
            t.register_hook(bind)


def _root_hooks(module, g: ContextGroup) -> list:
    """``g`` bound (and the guard on) for the calls of ``module``'s forward, and for its backward; a call inside
    a forward that bound ``g`` already (a unit's, inside the root's) does nothing."""
    guards: list = []  # per call: the guard entered, or None where the call was bound already

    @torch._dynamo.disable
    def enter(_m, _args) -> None:
        bound = _BOUND.get()
        if bound and bound[-1] is g:
            guards.append(None)
            return
        _push(g)
        guard = _Guard()
        guard.__enter__()
        guards.append(guard)

    @torch._dynamo.disable
    def leave(_m, _args, out) -> None:  # (always called, also when the forward raised)
        guard = guards.pop() if guards else None
        if guard is None:
            return
        guard.__exit__(None, None, None)
        _pop(g)
        _LAST.set(weakref.ref(g))
        if out is not None and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            _bind_backward(g, out)

    # [Note: enter runs before every other pre-hook of the root (prepend) and leave after its forward hooks: the
    # flow check's mode (runtime/flow_guard.py, installed before the axes) is entered above the guard and left
    # before it, as modes nest]
    return [module.register_forward_pre_hook(enter, prepend=True),
            module.register_forward_hook(leave, always_call=True)]


_NAMES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # module class -> its forward's parameters


def _forward_names(module) -> list:
    """``forward_parameters(module)``, read once per class (functional_call installs at every call)."""
    if "forward" in module.__dict__:
        return forward_parameters(module)
    cls = type(module)
    if cls not in _NAMES:
        _NAMES[cls] = forward_parameters(module)
    return _NAMES[cls]


def _no_cache(module) -> list:
    """A pre-hook on the root that calls it with ``use_cache=False`` where its forward takes ``use_cache`` and the
    call does not say (Hugging Face's default is ``True``); ``use_cache=True`` refused, naming the fix. A root
    that does not take it (a wrapper whose forward passes ``**kwargs`` on) gets it on the outermost modules
    inside it that do (the Hugging Face model it wraps).

    [Note: no KV cache under cp] a training step uses no cache (transformers trains with ``use_cache=False``),
    and under cp one would hold this rank's chunks only: Gemma2's and Mistral's sliding-window caches slice them,
    which the flow check refuses as a shift of the sequence. The traced step does the same (metatrace.py)."""
    handles, hooked = [], []
    for path, sub in module.named_modules():
        if any(h == "" or path.startswith(h + ".") for h in hooked):
            continue  # (inside a module hooked already: it passes use_cache on)
        names = _forward_names(sub)
        if "use_cache" not in names:
            continue
        hooked.append(path)

        def hook(m, args, kwargs, names=names):
            return training_call(m, args, kwargs, where="the context-parallel forward", error=RuntimeShardingError,
                                 why="under context parallelism a cache would hold this rank's chunks of the "
                                     "sequence only", names=names)
        handles.append(sub.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


IGNORE_INDEX = -100  # the label Hugging Face's losses (and torch's cross_entropy by default) leave out
_BATCH_IGNORED: dict = {}  # id(plan) -> (a weak reference to it, whether its last batch had ignored labels)


def note_batch(plan, tensors) -> None:
    """What :func:`shard_batch` saw of the global batch it split: whether a label tensor (an integer tensor after
    the first) holds ignored positions anywhere (every rank splits the same global batch: they agree)."""
    ignored = any(not t.is_floating_point() and bool((t == IGNORE_INDEX).any()) for t in tensors[1:])
    for k in [k for k, (ref, _) in _BATCH_IGNORED.items() if ref() is None]:
        del _BATCH_IGNORED[k]
    _BATCH_IGNORED[id(plan)] = (weakref.ref(plan), ignored)


def _batch_ignored(plan) -> bool:
    ref, ignored = _BATCH_IGNORED.get(id(plan), (None, False))
    return ignored and ref is not None and ref() is plan


def _ignored_labels(module, plan) -> list:
    """A pre-hook on the root refusing ``labels`` / ``shift_labels`` from a batch with ignored positions (``-100``,
    as :func:`shard_batch` saw it) unless the call passes ``num_items_in_batch``.

    [Note: ignored labels under cp] each rank's loss is the mean over *its* labelled tokens and gradients are
    averaged over cp, so every rank's tokens weigh 1/cp of the step whatever their count. Where the ranks hold
    different numbers of ignored positions (the last position of Hugging Face's shifted labels, padding), the
    step is not the whole sequences' mean: 15 labelled tokens on one rank against 16 on the other moved a tiny
    Mistral's loss, silently. Hugging Face's losses divide a sum by ``num_items_in_batch`` where it is given, which
    makes every rank's share exact: the whole batch's labelled tokens / cp. The decision is the global batch's
    (``shard_batch`` sees it whole on every rank), not this rank's chunks: ranks refuse together or not at all.]"""
    names = forward_parameters(module)
    if "labels" not in names and "shift_labels" not in names:
        return []

    def hook(_m, args, kwargs):
        if kwargs.get("num_items_in_batch") is not None or not _batch_ignored(plan):
            return None
        key = next((k for k in ("labels", "shift_labels") if isinstance(kwargs.get(k), torch.Tensor)), None)
        if key is not None:
            raise RuntimeShardingError(
                f"{type(module).__name__} was called with {key}= from a batch holding ignored positions "
                f"({IGNORE_INDEX}) under context parallelism: each rank averages its loss over its own labelled "
                f"tokens and the ranks hold different numbers of them, so the step would not be the whole sequences' "
                f"mean. Pass num_items_in_batch=n / cp, n the labelled tokens of the global batch's sequences on "
                f"this data slice, e.g. `n = (ys != -100).sum()` over the slice before "
                f"sp.context_parallel.shard_batch (Hugging Face's loss then divides its sum by it), or labels with no "
                f"ignored position")
        return None
    return [module.register_forward_pre_hook(hook, with_kwargs=True)]


def _no_padding(module, cp: bool = True) -> list:
    """A pre-hook on the root that refuses an ``attention_mask`` that masks tokens (a padded batch), naming the fix.

    [Note: padding is not seen in the attention] transformers 5.x builds no mask for an attention name without a
    mask function of its own ("shardplan_cp") and passes it none, the caller's padding included: the model
    would attend to the padding tokens, silently. So the model's call is checked, once per forward.]"""
    names = forward_parameters(module)
    if "attention_mask" not in names:
        return []
    i = names.index("attention_mask")

    def hook(m, args, kwargs):
        mask = kwargs["attention_mask"] if "attention_mask" in kwargs else args[i] if i < len(args) else None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not tracing() and not bool(mask.all()):
            where, fix = (("under context parallelism, which attends with the causal mask of the full sequences only",
                           "or train without the cp axis") if cp else
                          ("with attn_implementation='shardplan_cp', to which transformers passes no padding mask",
                           "or use attn_implementation='sdpa' where there is no cp axis"))
            raise RuntimeShardingError(
                f"{type(m).__name__} was called with an attention_mask (shape {tuple(mask.shape)}) that masks tokens "
                f"(padding) {where}, and would attend to the padding tokens. Train on unpadded (e.g. packed-free, "
                f"equal-length) batches and leave attention_mask out (or all ones), {fix}")
    return [module.register_forward_pre_hook(hook, with_kwargs=True)]


def _group(plan, groups, exe) -> Optional[ContextGroup]:
    """The executor's context group, made once (``None``: the plan has no cp axis, or a plain one of one rank)."""
    if CONTEXT_AXIS not in plan.mesh.axis_names:
        return None
    g = _GROUPS.get(exe) if exe is not None else None
    if g is None:
        axis = groups.axis(CONTEXT_AXIS)
        if axis.size == 1 and axis.pg is None:
            return None
        # one call's K and V (a module calling attention twice runs its first call's ops)
        g = ContextGroup(axis, AxisOps.of(plan, exe, lambda o: tuple(o.axes) == (CONTEXT_AXIS,), per_key=2))
        if exe is not None:
            _GROUPS[exe] = g
    return g


def install(module, plan, groups, exe=None) -> list:
    """Make :func:`attention` gather over the plan's ``cp`` axis while ``module`` runs (``shard()`` calls this
    through runtime/axes.py, once; ``functional_call`` at every call); returns the hooks' handles. A ``cp``
    axis of one rank runs the plain call, unless ``SHARDPLAN_SINGLETON_GROUPS=1`` made it a real group (then the
    gathering path runs over one rank: what benchmarks/cp_ep_overhead.py measures). With a traced plan's
    attention calls, forward hooks on their modules say which call records which ops."""
    g = _group(plan, groups, exe)
    if g is None:  # (no cp: "shardplan_cp" is sdpa, to which transformers passes no padding mask either)
        uses = getattr(getattr(module, "config", None), "_attn_implementation", None) == "shardplan_cp"
        return _no_padding(module, cp=False) if uses else []
    handles = _root_hooks(module, g) + _no_cache(module) + _ignored_labels(module, plan) + _no_padding(module)
    # [Note: a unit called on its own] a block or a submodule of the model called directly (model.model(...),
    # model.layers[i](h) on this rank's chunks) runs without the root's hooks: its units bind the group too,
    # or its attention would run over this rank's chunks only, silently
    for path in sorted({p for up in plan.units for p in up.module_paths if p}):
        handles += _root_hooks(module.get_submodule(path), g)
    if not g.ops.ops:
        return handles

    def enter(path: str):
        def hook(_m, _args) -> None:
            g.calling.append(path)
        return hook

    def leave(_m, _args, _out) -> None:  # (a hook that returns something replaces the output)
        g.calling.pop()

    for path in sorted({p for p, _ in g.ops.ops}):
        mod = module.get_submodule(path)
        handles += [mod.register_forward_pre_hook(enter(path)), mod.register_forward_hook(leave)]
    return handles


def positions(seq: int, cp: int, index: int, device=None) -> torch.Tensor:
    """The positions (in the full sequence of ``seq``) that rank ``index`` of ``cp`` holds: chunks ``index``
    and ``2*cp-1-index`` of ``2*cp``.

    >>> positions(8, 2, 0).tolist()
    [0, 1, 6, 7]
    """
    if seq % (2 * cp):
        raise ShardingError(f"sequence length {seq} is not divisible by 2*cp = {2 * cp}: context parallelism cuts each "
                            f"sequence into 2*cp equal chunks (two per rank, for balanced causal work); use a length "
                            f"that is a multiple of {2 * cp}, e.g. {seq + (-seq) % (2 * cp)}, or pad the batch")
    c = seq // (2 * cp)
    first = torch.arange(index * c, (index + 1) * c, device=device)
    return torch.cat([first, first + (2 * cp - 1 - 2 * index) * c])
