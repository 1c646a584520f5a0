"""Context-parallel attention: keys and values all-gathered over ``cp`` in one autograd node, the local queries
attending to the whole sequence under the mask of the full-sequence positions (causal, optionally a sliding
window), with attention logit soft-capping where asked (see :mod:`shardplan.runtime.context_parallel`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import RuntimeShardingError
from ..units import cp_attention, tracing
from . import collectives as C
from .axis_ops import BACKWARD, AxisOps
from .context_group import active, positions

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


def _mask(qpos: torch.Tensor, kpos: torch.Tensor, is_causal: bool, window: Optional[int]) -> Optional[torch.Tensor]:
    """``[q, k]`` True where a query at ``qpos`` attends to a key at ``kpos``: causal (``k <= q``) and, with a
    sliding ``window``, ``k > q - window`` (transformers' ``sliding_window_overlay``); ``None``: every key."""
    if not is_causal:
        return None
    mask = kpos[None, :] <= qpos[:, None]
    if window is not None:
        mask &= kpos[None, :] > qpos[:, None] - window
    return mask


def _softcapped(q, k, v, mask, dropout_p: float, scale: Optional[float], softcap: float, enable_gqa: bool = False):
    """Attention with soft-capped logits, as transformers' eager attention computes it (Gemma2): scores scaled,
    then ``softcap * tanh(scores / softcap)``, then the mask, softmax in fp32 cast back, dropout, values.

    [Note: soft-capping is not sdpa] the cap is applied to the logits before the mask, which no fused sdpa kernel
    takes (transformers' sdpa refuses ``softcap``); the scores are computed explicitly, ``[b, h, q, k]`` per call."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    w = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    w = torch.tanh(w / softcap) * softcap
    if mask is not None:
        w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p:
        w = F.dropout(w, p=dropout_p)
    return torch.matmul(w, v)


def _attend(q, k, v, mask, dropout_p: float, scale: Optional[float], softcap: Optional[float], kwargs: dict):
    with cp_attention():  # (the guard lets it through)
        if softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, **kwargs)
        return _softcapped(q, k, v, mask, dropout_p, scale, softcap, **kwargs)


def _check_variant(attn_mask, is_causal: bool, window: Optional[int], softcap: Optional[float], q, k) -> None:
    if attn_mask is not None:
        raise RuntimeShardingError("attention() got an attn_mask with window= or softcap=: give the mask as "
                                   "is_causal=True and window= instead")
    if window is not None and (not is_causal or int(window) < 1):
        raise RuntimeShardingError(f"attention() got window={window!r}{'' if is_causal else ' without is_causal=True'}: "
                                   f"a sliding window is causal (a query at i attends to keys i-window < j <= i); pass "
                                   f"is_causal=True and a window of at least 1")
    if softcap is not None and not softcap > 0:
        raise RuntimeShardingError(f"attention() got softcap={softcap!r}: the cap is a positive number (or None)")
    if q.shape[-2] != k.shape[-2] and active() is None and not tracing():
        raise RuntimeShardingError(f"attention() with window= or softcap= takes as many keys as queries (got "
                                   f"{k.shape[-2]} keys for {q.shape[-2]} queries): no KV cache")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: Optional[float] = None, *, window: Optional[int] = None,
              softcap: Optional[float] = None, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` over the whole sequence while this rank holds its chunks of it
    (``[b, heads, T/cp, head_dim]``, in :func:`positions` order): keys and values are all-gathered over cp
    and the causal mask follows the full-sequence positions. Not context-parallel: the plain call.

    ``window`` (with ``is_causal=True``): a sliding window, a query at position ``i`` attends to the keys at
    ``i - window < j <= i`` (transformers' ``sliding_window``). ``softcap``: the logits soft-capped,
    ``softcap * tanh(scores / softcap)`` before the mask (Gemma2's ``attn_logit_softcapping``), computed explicitly
    as transformers' eager attention does.

    >>> y = attention(q, k, v, is_causal=True)
    >>> y = attention(q, k, v, is_causal=True, window=4096, softcap=50.0)
    """
    variant = window is not None or softcap is not None
    if variant:
        _check_variant(attn_mask, is_causal, window, softcap, q, k)
    g = active()
    if tracing() or (g is None and not variant):  # (the planner's traced step: one rank's shapes, no collective)
        with cp_attention():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, **kwargs)
    if g is None:
        pos = torch.arange(q.shape[-2], device=q.device)
        return _attend(q, k, v, _mask(pos, pos, is_causal, window), dropout_p, scale, softcap, kwargs)
    if attn_mask is not None:
        raise RuntimeShardingError("context-parallel attention got an attn_mask: a mask over the full sequence cannot "
                                   "be honoured on sequence chunks here; use is_causal=True (or no mask, or window=), "
                                   "or train without the cp axis")
    t = q.shape[-2]
    seq = t * g.size
    qpos = positions(seq, g.size, g.group.rank, device=q.device)
    path = g.calling[-1] if g.calling else None
    keys, values = _gather_kv(k, v, g.group, lambda i, phase, work: g.ops.run(path, phase, i, work))
    kpos = torch.cat([positions(seq, g.size, j, device=q.device) for j in range(g.size)])
    return _attend(q, keys, values, _mask(qpos, kpos, is_causal, window), dropout_p, scale, softcap, kwargs)
