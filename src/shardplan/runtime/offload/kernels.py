"""The host step's compute: torch's AdamW kernels over one offloaded buffer's host tensors (one flat span of
the shard where it can), run by the worker thread or in ``opt.step()``, and by ``OffloadAdamW`` on the device
buffers."""

from __future__ import annotations

import time
from typing import Optional

import torch

from .host import HostBuffer


def _host_compute(hb: HostBuffer, members: list, group: dict, fused: Optional[bool], d2h, h2d) -> tuple:
    """The AdamW kernels over ``hb``'s host tensors (the worker runs this; no device work, no Python state
    shared with the main thread but ``hb``'s host tensors). Returns ``(seconds in all, seconds in the
    kernels)``: the rest waited for the gradient's copy to the host (or the master's last copy back)."""
    t0 = time.perf_counter()
    if d2h is not None:  # the gradient copy has landed in hb.grad
        d2h.synchronize()
    if h2d is not None:  # the last copy of the master to the device has read it
        h2d.synchronize()
    t1 = time.perf_counter()
    with torch.no_grad():
        for group_members in _by_step(hb, members):
            views, steps, followers = _spans(hb, group_members)
            adamw(*views, steps, group, fused)
            for m in followers:  # pieces stepped within the flat span, or empty ones: the same count
                hb.steps[m.index].copy_(steps[0])
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def _by_step(hb: HostBuffer, members: list) -> list[list]:
    """Members grouped by their step count (one group, usually: they all stepped together)."""
    groups: dict[float, list] = {}
    for m in members:
        groups.setdefault(float(hb.steps[m.index]), []).append(m)
    return list(groups.values())


def _spans(hb: HostBuffer, members: list):
    """``((params, grads, exp_avgs, exp_avg_sqs), steps, followers)`` for the AdamW kernel: one flat span of
    the shard when ``members`` are every trainable piece this rank holds (the padding between them is
    zero and stays zero), else one view per member; ``followers`` take the first step count afterwards
    (members inside the flat span, and members of which this rank holds nothing)."""
    held = [m for m in hb.trainable if m.held]
    mine = [m for m in members if m.held]
    if mine and len(mine) == len(held):
        lo, hi = min(m.shard.start for m in mine), max(m.shard.stop for m in mine)
        spans, steps = [slice(lo, hi)], [hb.steps[mine[0].index]]
        followers = [m for m in members if m is not mine[0]]
    else:
        spans, steps = [m.shard for m in mine], [hb.steps[m.index] for m in mine]
        followers = [m for m in members if not m.held]
        if not mine:  # nothing held: the count still advances, as torch steps an empty tensor
            steps = [hb.steps[members[0].index]]
            steps[0].add_(1)
            followers = members[1:]
            return ([], [], [], []), steps, followers
    return tuple([t[s] for s in spans] for t in (hb.master, hb.grad, hb.exp_avg, hb.exp_avg_sq)), steps, followers


def adamw(params, grads, exp_avgs, exp_avg_sqs, steps, group: dict, fused: Optional[bool]) -> None:
    """torch's AdamW kernels (``torch.optim.adamw.adamw``) with ``group``'s hyper-parameters; ``fused``:
    torch's fused CPU/CUDA kernel (``None``: torch's default for the tensors' device)."""
    if not params:
        return
    from torch.optim.adamw import adamw as _adamw
    b1, b2 = group["betas"]
    _adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=fused, amsgrad=False, beta1=b1, beta2=b2,
           lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
