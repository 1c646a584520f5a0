"""CPU offload at run time: host copies of the offloaded buffers, the schedule's copy ops, the host step.

For every buffer the plan offloads (``BufferPlan.offload``) this rank keeps four flat host tensors the size
of its shard, in the parameters' dtype (pinned on CUDA): the master shard, the gradient shard, and AdamW's
two moments. :mod:`shardplan.plan.accounting` counts exactly these (``plan.memory().host``).

* ``copy_d2h grads`` (after the unit's reduction wait, ``sync`` backwards only): the local gradient shards
  go to the host gradient on a side copy stream, overlapping the rest of backward.
* the host step (:class:`OffloadAdamW.step`, called by the user after backward and clipping): per buffer,
  wait for its gradient copy, step the master shard and moments on the CPU (torch's AdamW kernels over
  one flat tensor: fused on the host by default), and issue the copy of the new shard back to the
  device at once, so buffer ``k``'s copy overlaps buffer ``k+1``'s host step.
* ``copy_h2d params`` (``before_forward``, after a step): the updated shards are on the device before any
  gather reads them; it issues any copy not yet issued and orders the compute stream after them.

[Note: what overlaps when] The device-to-host gradient copies overlap backward. The host step runs in
``opt.step()``, after the backward and after ``sp.clip_grad_norm_`` (whose global norm it needs): it
does not overlap backward in this version. The host-to-device copies overlap the host steps of the
buffers after them. On CPU the copies are plain tensor copies: the same code path, synchronous.

[Note: clipping] ``sp.clip_grad_norm_`` scales the device gradients after they were copied; it tells this
module the coefficient (:meth:`OffloadState.grads_scaled`), and the host gradient is scaled by the same
number before the step. Any other change to a gradient after its copy (its tensor or version differs
at step time) makes the step copy that gradient again: slower, never stale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import RuntimeShardingError
from ..plan.kinds import COPY_D2H, Offload
from .buffers import BufferState


def _pin(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.pin_memory() if device.type == "cuda" else t


@dataclass(eq=False)
class HostBuffer:
    """One offloaded buffer's host tensors and the copies in flight (CUDA events; ``None`` on CPU)."""

    b: BufferState
    mode: str
    master: torch.Tensor              # flat, shard-sized, the parameters' dtype
    grad: torch.Tensor                # the reduced gradient shard, as last copied
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: dict = field(default_factory=dict)     # member index -> 0-dim float32 step count (torch's "step")
    copied: dict = field(default_factory=dict)    # member index -> (id, version) of the device grad copied
    scales: list = field(default_factory=list)    # clip coefficients applied to the device grads since the copy
    d2h: Any = None                   # event: the gradient copy is done
    h2d: Any = None                   # event: the master's copy to the device is done
    dirty: bool = False               # the master changed since it was last copied to the device

    @property
    def trainable(self) -> list:
        return [m for m in self.b.members if m.info.requires_grad]


class OffloadState:
    """The host side of one sharded model (``exe.offload``); built by :func:`attach`."""

    def __init__(self, exe):
        self.exe = exe
        self.cuda = exe.device.type == "cuda"
        self.stream = torch.cuda.Stream(exe.device) if self.cuda else None
        self.hosts: dict[int, HostBuffer] = {}
        for u in exe.unit_list:
            for b in u.buffers:
                if not b.bp.offload:
                    continue
                if b.bp.offload == Offload.PARAMS:
                    raise RuntimeShardingError(
                        "shardplan: offload='params' is planned (memory, copies, schedule) but this version runs "
                        "offload='optimizer' only; plan with offload='optimizer' (or strategy-level 3 without offload)")
                zeros = lambda: _pin(torch.zeros(b.shard.numel(), dtype=b.dtype), exe.device)
                hb = HostBuffer(b, b.bp.offload, master=_pin(b.shard.detach().to("cpu", copy=True), exe.device),
                                grad=zeros(), exp_avg=zeros(), exp_avg_sq=zeros())
                hb.steps = {m.index: torch.tensor(0.0) for m in hb.trainable}
                self.hosts[b.bp.index] = hb

    # -- the schedule's ops (executor handlers) ------------------------------------------------------
    def run(self, op) -> None:
        if op.kind == COPY_D2H:
            self.copy_grads([self.hosts[i] for i in op.buffers])
        else:
            self.copy_params([self.hosts[i] for i in op.buffers])

    def copy_grads(self, hosts: list[HostBuffer]) -> None:
        """The reduced local gradients of ``hosts`` to host memory (a side stream on CUDA)."""
        with self._side():
            for hb in hosts:
                dsts, srcs = [], []
                for m in hb.trainable:
                    g = m.local.grad
                    if m.held and g is not None:
                        dsts.append(hb.grad[m.shard])
                        srcs.append(g.detach().reshape(-1))
                    hb.copied[m.index] = None if g is None else (id(g), g._version)
                if dsts:
                    torch._foreach_copy_(dsts, srcs, non_blocking=self.cuda)
                hb.scales.clear()
                hb.d2h = self._event()

    def copy_params(self, hosts: list[HostBuffer]) -> None:
        """The stepped master shards on the device before anything reads them (idempotent)."""
        for hb in hosts:
            if hb.dirty:
                self._issue_h2d(hb)
            if self.cuda and hb.h2d is not None:
                torch.cuda.current_stream().wait_event(hb.h2d)

    # -- the host step ------------------------------------------------------------------------------
    def grads_scaled(self, coef: torch.Tensor) -> None:
        """``sp.clip_grad_norm_`` multiplied the device gradients by ``coef``: do the same to the copies."""
        c = coef.detach().to("cpu")
        for hb in self.hosts.values():
            hb.scales.append(c)
            for m in hb.trainable:
                g = m.local.grad
                if hb.copied.get(m.index) is not None and g is not None and hb.copied[m.index][0] == id(g):
                    hb.copied[m.index] = (id(g), g._version)

    def host_step(self, hb: HostBuffer, group: dict, fused: Optional[bool]) -> None:
        """AdamW on ``hb``'s master shard, on the CPU; then its copy back to the device is issued."""
        if hb.d2h is not None:
            hb.d2h.synchronize()
            hb.d2h = None
        active = []
        for m in hb.trainable:
            g = m.local.grad
            if g is None:  # no gradient this step: skipped, as torch's optimizers skip it
                continue
            if hb.copied.get(m.index) != (id(g), g._version):  # changed after its copy (or never copied): again
                if m.held:
                    hb.grad[m.shard].copy_(g.detach().reshape(-1))
                hb.copied[m.index] = (id(g), g._version)
                # [Note: a fresh copy holds whatever scaling the device gradient has: no pending scale]
                active.append((m, True))
            else:
                active.append((m, False))
        if not active:
            return
        with torch.no_grad():
            for m, fresh in active:
                if hb.scales and not fresh and m.held:
                    for c in hb.scales:
                        hb.grad[m.shard].mul_(c.to(hb.grad.dtype))
            hb.scales.clear()
            for members in _by_step(hb, [m for m, _ in active]):
                views, steps, followers = _spans(hb, members)
                adamw(*views, steps, group, fused)
                for m in followers:  # pieces stepped within the flat span, or empty ones: the same count
                    hb.steps[m.index].copy_(steps[0])
        hb.dirty = True
        self._issue_h2d(hb)

    def _issue_h2d(self, hb: HostBuffer) -> None:
        with self._side():
            with torch.no_grad():
                hb.b.shard.copy_(hb.master, non_blocking=self.cuda)
            hb.h2d = self._event()
        hb.dirty = False

    def finish_step(self) -> None:
        """After the host step: anything the compute stream runs next sees the new shards."""
        if self.cuda:
            for hb in self.hosts.values():
                if hb.h2d is not None:
                    torch.cuda.current_stream().wait_event(hb.h2d)

    def shards_changed(self) -> None:
        """The device shards were written outside a step (a checkpoint load): the masters follow them."""
        for hb in self.hosts.values():
            hb.master.copy_(hb.b.shard.detach())
            hb.dirty, hb.h2d = False, None

    # -- inspection --------------------------------------------------------------------------------------
    def host_bytes(self) -> int:
        """Bytes of host memory held (plan.memory().host counts the same tensors)."""
        seen = {}
        for hb in self.hosts.values():
            for t in (hb.master, hb.grad, hb.exp_avg, hb.exp_avg_sq):
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.size()
        return sum(seen.values())

    # -- helpers ------------------------------------------------------------------------------------------
    def _side(self):
        if not self.cuda:
            import contextlib
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self.stream)

    def _event(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev


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


def attach(exe) -> None:
    """Give an executor whose plan offloads its host side (``shard()`` calls this)."""
    exe.offload = OffloadState(exe) if exe.plan.offload else None
