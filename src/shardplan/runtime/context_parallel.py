"""Context parallelism at run time: each rank of the ``cp`` axis holds two chunks of every sequence, and
attention sees the whole sequence by gathering keys and values over ``cp``.

The sequence is cut into ``2*cp`` equal chunks; rank ``i`` holds chunks ``i`` and ``2*cp-1-i``, so under
the causal mask every rank has the same work (an early chunk attends to little, its partner to much).
The training loop shards a batch with :func:`shard_batch` (its positions are those of the full
sequence) and the model's attention calls :func:`attention` instead of
``F.scaled_dot_product_attention``; outside the forward and backward of a sharded model with ``cp > 1`` that is
the plain call::

    x, y, pos = sp.context_parallel.shard_batch(plan, rank, x, y)   # [B/dp, T/cp] each, pos: [T/cp]
    loss = model(x, y, positions=pos)                                # mean over this rank's tokens

Gradients are averaged over ``cp`` like over ``dp`` (the plan reduces them over every axis that does not
shard them), which is the mean over all tokens since every cp rank holds as many.

[Note: why all-gather, not ring. Keys and values of the whole sequence are all-gathered before the local
queries attend (and their gradients reduce-scattered back in backward): one collective per attention
call, exact, on any backend and with any attention kernel that takes a boolean mask. Ring attention
(send/recv of K/V blocks overlapped with blockwise compute, torch's ``context_parallel`` on SDPA) holds
only two blocks at a time and hides the transfer behind compute; it needs online-softmax merging per
block and is what long sequences on GPUs want. The all-gather holds ``T`` keys and values per layer
during the call: fine up to sequences whose K/V fit, which is where this starts.]
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
from ..optraffic import tensors_in
from ..units import cp_attention, in_cp_attention, tracing
from . import collectives as C
from .axis_ops import BACKWARD, AxisOps
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
    if g is None:
        return []
    handles = _root_hooks(module, g)
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


def shard_batch(plan, rank: int, *tensors: torch.Tensor, seq_dim: int = 1):
    """This rank's part of a global batch: the batch split by ``plan.data_index(rank)`` (cp ranks share it),
    each sequence by :func:`positions`; returns the local tensors and then the positions ([T/cp]).

    >>> x, y, pos = shard_batch(plan, rank, x, y)
    """
    x0 = tensors[0]
    per = x0.shape[0] // plan.data_size
    if x0.shape[0] % plan.data_size:
        raise ShardingError(f"batch of {x0.shape[0]} does not split into the plan's {plan.data_size} data slices")
    i = plan.data_index(rank)
    cp = plan.mesh.axis_size(CONTEXT_AXIS) if CONTEXT_AXIS in plan.mesh.axis_names else 1
    idx = plan.mesh.axis_index(rank, (CONTEXT_AXIS,)) if cp > 1 else 0
    pos = positions(x0.shape[seq_dim], cp, idx, device=x0.device)
    out = [t[i * per:(i + 1) * per].index_select(seq_dim, pos) for t in tensors]
    return (*out, pos)


def loss_mean(loss: torch.Tensor, model=None) -> torch.Tensor:
    """The mean over the cp group of each rank's loss (a mean over its tokens): the loss of the whole
    sequences, for logging (training needs nothing: gradients are averaged over cp). The group is ``model``'s
    (:func:`group_of`); without it, that of the context-parallel model whose forward ran last in this thread.

    >>> whole = sp.context_parallel.loss_mean(loss, model)
    """
    if model is not None:
        g = group_of(model)
    else:
        last = _LAST.get()
        g = last() if last is not None else None
    if g is None:
        return loss
    t = loss.detach().clone()
    C.all_reduce(t, g.group, async_op=False)
    return t


class _GatherKV(torch.autograd.Function):
    """Keys and values all-gathered along dim 0 over the cp group, in one autograd node; backward: their summed
    gradients reduce-scattered, this rank's block, keys' first (the plan's order). ``run(i, phase, work)``
    runs the call's ``i``-th op of ``phase`` (0: keys, 1: values) through the executor (:class:`AxisOps`)."""

    @staticmethod
    def forward(ctx, k, v, group, run):
        ctx.group, ctx.run = group, run
        phase = AxisOps.phase()
        out = []
        for i, x in enumerate((k, v)):
            def gather(x=x):
                rows = x.new_empty((x.shape[0] * group.size,) + tuple(x.shape[1:]))
                C.all_gather_rows(rows, x.contiguous(), group)
                return rows
            out.append(run(i, phase, gather))
        return tuple(out)

    @staticmethod
    def backward(ctx, gk, gv):
        group = ctx.group
        out = []
        for i, g in enumerate((gk, gv)):
            def scatter(g=g):
                part = g.new_empty((g.shape[0] // group.size,) + tuple(g.shape[1:]))
                C.reduce_scatter_rows_sum(part, g.contiguous(), group)
                return part
            out.append(ctx.run(i, BACKWARD, scatter) if g is not None else None)
        return out[0], out[1], None, None


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group: C.Group, run) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, h, t, d] on each rank -> [b, h, cp*t, d], ranks' sequence blocks in group order (keys, values)."""
    keys, values = _GatherKV.apply(k.permute(2, 0, 1, 3).contiguous(), v.permute(2, 0, 1, 3).contiguous(), group, run)
    return keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: Optional[float] = None, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` over the whole sequence while this rank holds its chunks of it
    (``[b, heads, T/cp, head_dim]``, in :func:`positions` order): keys and values are all-gathered over cp
    and the causal mask follows the full-sequence positions. Not context-parallel: the plain call.

    >>> y = attention(q, k, v, is_causal=True)
    """
    g = active()
    if g is None or tracing():  # (the planner's traced step: one rank's shapes, no collective)
        with cp_attention():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, **kwargs)
    if attn_mask is not None:
        raise RuntimeShardingError("context-parallel attention got an attn_mask: a mask over the full sequence cannot "
                                   "be honoured on sequence chunks here; use is_causal=True (or no mask), or train "
                                   "without the cp axis")
    t = q.shape[-2]
    seq = t * g.size
    qpos = positions(seq, g.size, g.group.rank, device=q.device)
    path = g.calling[-1] if g.calling else None
    keys, values = _gather_kv(k, v, g.group, lambda i, phase, work: g.ops.run(path, phase, i, work))
    mask = None
    if is_causal:
        kpos = torch.cat([positions(seq, g.size, j, device=q.device) for j in range(g.size)])
        mask = kpos[None, :] <= qpos[:, None]
    with cp_attention():  # (the guard lets it through)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                              **kwargs)


# -- Hugging Face models ---------------------------------------------------------------------------------

HF_ATTENTION = "shardplan_cp"  # the name shardplan's attention is registered under in Hugging Face's AttentionInterface

# [Note: Hugging Face attention under cp. A transformers model picks its attention function by name
# (config._attn_implementation) from AttentionInterface, which any library may extend. Under this name the
# model's attention calls attention() above: keys and values gathered over cp, the causal mask of the
# full-sequence positions. The name is not in AttentionMaskInterface, so transformers builds no mask for it
# and passes the caller's 2-D attention_mask as is (its own masks, made from this rank's local positions,
# would be wrong under cp). Outside context parallelism it is Hugging Face's sdpa function, and refuses what
# sdpa would need a mask for (padding, packed position_ids), instead of attending without it.]

_CHECKED = weakref.WeakValueDictionary()  # what was last found fine, by role (each layer gets the same tensors)


def _checked(role: str, t: torch.Tensor) -> bool:
    if _CHECKED.get(role) is t:
        return True
    _CHECKED[role] = t
    return False


def _hf_refuse(module, what: str, fix: str):
    return RuntimeShardingError(f"Hugging Face attention {HF_ATTENTION!r} in {type(module).__name__} {what}; {fix}")


def _layer_window(module, kwargs) -> Optional[int]:
    """The sliding window this attention module's layer uses (``None``: full causal attention), as the model's
    own mask would apply it: the ``sliding_window=`` argument where the model passes one (Mistral, Qwen2,
    Gemma2/3), else the module's ``sliding_window`` attribute (Qwen2-MoE sets it on its sliding layers and
    passes the window through the mask only), else ``config.layer_types`` at the module's ``layer_idx``.

    [Note: a window passed through the mask only] transformers builds no mask for an attention name it does
    not know, so a model that windows a layer through its mask alone would attend fully here, silently. A
    config with a window that none of the above places on this layer (PhiMoE masks every layer with
    ``config.sliding_window`` and says so nowhere else; other models keep a window in the config unused) is
    refused, naming the fix, rather than guessed.]"""
    window = kwargs.get("sliding_window")
    if window is not None:
        return int(window)
    window = getattr(module, "sliding_window", None)
    if window:
        return int(window)
    cfg = getattr(module, "config", None)
    types, idx = getattr(cfg, "layer_types", None), getattr(module, "layer_idx", None)
    if types is not None and isinstance(idx, int) and 0 <= idx < len(types):
        if types[idx] == "sliding_attention":
            return int(cfg.sliding_window)
        if types[idx] != "full_attention":
            raise _hf_refuse(module, f"is a {types[idx]!r} layer (config.layer_types[{idx}])",
                             "it runs full or sliding-window causal attention only; use attn_implementation='sdpa' "
                             "without the cp axis")
        return None
    if hasattr(module, "sliding_window") or not getattr(cfg, "sliding_window", None):
        return None  # (the module says it attends fully, or there is no window)
    raise _hf_refuse(module, f"cannot tell whether its layer uses config.sliding_window={cfg.sliding_window} (the "
                             f"model passes no sliding_window= argument, the module has no sliding_window attribute "
                             f"and the config no layer_types)",
                     "set the window each attention module uses as its sliding_window attribute (None for full "
                     "attention), e.g. `for layer in model.model.layers: layer.self_attn.sliding_window = "
                     "config.sliding_window` where the model masks every layer with it")


def _window_mask(t: int, window: int, device) -> torch.Tensor:
    """transformers' sliding-window causal mask over ``t`` positions (masking_utils: key kept where
    ``kv_idx <= q_idx`` and ``kv_idx > q_idx - sliding_window``), ``[1, 1, t, t]``."""
    q = torch.arange(t, device=device)[:, None]
    k = torch.arange(t, device=device)[None, :]
    return ((k <= q) & (k > q - window))[None, None]


def _hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                  **kwargs):
    """The ``AttentionInterface`` function registered as ``"shardplan_cp"`` (:func:`hf_attention`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    for key_name in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(key_name) is not None:
            raise _hf_refuse(module, f"was given {key_name}={kwargs[key_name]!r}",
                             "it runs plain causal (or full) attention only; train this model without the cp axis")
    window = _layer_window(module, kwargs)
    kwargs.pop("sliding_window", None)
    if attention_mask is not None and not (attention_mask.ndim == 2 and (_checked("mask", attention_mask)
                                                                       or bool(attention_mask.all()))):
        if attention_mask.ndim == 2:
            _CHECKED.pop("mask", None)
        raise _hf_refuse(module, f"got an attention_mask (shape {tuple(attention_mask.shape)}) that masks tokens",
                         "context-parallel attention runs the causal mask of the full sequence only: train on unpadded "
                         "(or packed-free) batches without attention_mask, or without the cp axis")
    g = active()
    position_ids = kwargs.get("position_ids")
    if g is None and not tracing():
        if position_ids is not None and not _checked("positions_plain", position_ids):
            t = position_ids.shape[-1]
            if not bool((position_ids == torch.arange(t, device=position_ids.device)).all()):
                _CHECKED.pop("positions_plain", None)
                raise _hf_refuse(module, "got position_ids other than 0..T-1 outside context parallelism (packed "
                                 "sequences?)", "use attn_implementation='sdpa' for such batches")
        mask = None
        # (transformers' sdpa mask: none while the window covers every key, as masking_utils skips it)
        if window is not None and query.shape[-2] >= window:
            mask = _window_mask(query.shape[-2], window, query.device)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if window is not None and not tracing():
        raise _hf_refuse(module, f"uses a sliding window of {window}", "it runs plain causal (or full) attention "
                         "under context parallelism only; train this model without the cp axis")
    if g is not None:
        t = query.shape[-2]
        if position_ids is None:
            raise _hf_refuse(module, "got no position_ids under context parallelism",
                             "pass position_ids=pos[None] (pos from sp.context_parallel.shard_batch): without them the "
                             "model numbers each rank's chunks 0..T/cp-1")
        if not _checked("positions", position_ids):
            want = positions(t * g.size, g.size, g.group.rank, device=position_ids.device)
            if position_ids.shape[-1] != t or not bool((position_ids == want).all()):
                _CHECKED.pop("positions", None)
                raise _hf_refuse(module, f"got position_ids that are not this rank's positions {want.tolist()[:8]}...",
                                 "pass position_ids=pos[None] with pos from sp.context_parallel.shard_batch")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    extra = {"enable_gqa": True} if getattr(module, "num_key_value_groups", 1) > 1 else {}
    out = attention(query, key, value, dropout_p=dropout, is_causal=bool(causal), scale=scaling, **extra)
    return out.transpose(1, 2).contiguous(), None


def hf_attention() -> str:
    """Register shardplan's context-parallel attention with Hugging Face's ``AttentionInterface`` and return
    its name, ``"shardplan_cp"``: build the model with it (or switch a built one) to train it on a ``cp`` axis.

    >>> cfg = transformers.LlamaConfig(..., attn_implementation=sp.context_parallel.hf_attention())
    >>> model.set_attn_implementation(sp.context_parallel.hf_attention())   # or on a built model

    Under a plan with cp > 1 it gathers keys and values over cp like :func:`attention` (pass
    ``position_ids`` from :func:`shard_batch`; no padding mask); otherwise it is Hugging Face's ``"sdpa"``."""
    from transformers import AttentionInterface
    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    return HF_ATTENTION
