"""CPU offload at run time: host copies of the offloaded buffers, the schedule's host ops, the host step.

For every buffer the plan offloads (``BufferPlan.offload``) this rank keeps four flat host tensors the size
of its shard, in the parameters' dtype (pinned on CUDA; views of a few power-of-two slabs, [Note: slabs]): the
master shard, the gradient shard, and AdamW's two moments. :mod:`shardplan.plan.accounting` counts exactly
these (``plan.memory().host``).

* ``copy_d2h grads`` (after the unit's reduction wait, ``sync`` backwards only): the local gradient shards
  go to the host gradient on a side copy stream, overlapping the rest of backward.
* ``optim_step params`` (right after it): the host step of those buffers is handed to a worker thread
  (torch's CPU kernels release the GIL), so it runs while backward goes on; see [Note: the overlapped step].
* ``copy_h2d params`` (ZeRO-3: just before the unit's first forward gather; ZeRO-1/2: ``before_forward``,
  after a step): the updated shards are on the device before any gather reads them; it waits for the
  unit's host step, issues its copy if not yet issued and orders the gather after it.

[Note: the overlapped step] At ``optim_step`` a buffer steps on the host at once (in the worker) when
the step is known now to be the one ``opt.step()`` would take: the optimizer is built with ``overlap=True``
(the default) and without ``max_grad_norm`` (clipping needs the global norm, known only after the whole
backward), and every trainable parameter of the buffer got a gradient on this rank (otherwise the used-
parameter exchange at ``end_backward`` may still turn a gradient into ``None``, which skips it: such a
buffer steps in ``opt.step()``). The step reads the optimizer's hyper-parameters (the learning rate a
scheduler set) when it starts, i.e. during backward; ``opt.step()`` checks that they and the gradients
are still what the step used, and raises naming the fix otherwise (never a silently different step).
The new shard goes back to the device as soon as the executor next sees the worker done (at the next
host op, at ``opt.step()`` or at the next ``copy_h2d``), on a host-to-device stream that waits only for
the device's last read of the shard (``ready``, recorded at ``optim_step``). ``opt.step()`` checks the
steps in flight, hands the worker the buffers that could not overlap backward, steps the device-resident
buffers, and waits for the host steps (the parameters after ``step()`` are the new ones, torch's contract);
with ``offload_optimizer(..., overlap_forward=True)`` it returns without waiting: [Note: the host step
overlaps the next forward].

[Note: the host step overlaps the next forward] Each offloaded buffer's step is a :class:`HostStep` state
and a future (:class:`InFlightStep`): ``QUEUED`` when backward handed it to the worker, ``CLAIMED`` once
``opt.step()`` checked it is the step it would take (hyper-parameters, gradients), ``IDLE`` once it ran and
the copy of the new shard to the device is issued (landed). With ``overlap_forward`` ``opt.step()`` does not
wait for the worker:
the wait is the unit's own ``copy_h2d``, which ZeRO-3 runs just before the unit's first all-gather of the
next forward (at the schedule's prefetch depth), and which waits for that unit's step only; the worker steps
the units in forward order once they are all queued (runtime/host_worker.py, [Note: host step order]). So
unit k's forward in step t+1 reads its parameters after step t's update (no staleness), while the host
still steps units k+1, ... . Under ZeRO-1/2 every gather runs at ``before_forward``, so the first forward
op waits for every host step (the overlap is then backward's only). Whatever reads the shards or the
host state between ``opt.step()`` and that forward waits first (:meth:`OffloadState.settle`): checkpoints,
``model.state_dict()``, ``opt.state_dict()``, ``Executor.local_value`` / ``shard_of``; a loop reading
``model.parameters()`` directly there calls ``opt.synchronize()`` first.

[Note: hosted parameter shards] Under ``offload="params"`` (ZeRO-3) a buffer's master *is* its shard: the
device shard's storage is freed at start-up (the local parameters keep their shapes, with no storage, as the
gathered parameters do between gathers). The ``copy_h2d`` before each of the unit's all-gathers (at the
schedule's prefetch depth) allocates it on the compute stream and copies the master in on the host-to-device
stream through a view with its own version counter (a copy in is not a change of the shard); the gather
stream, not the compute stream, waits for that copy, so a prefetched copy overlaps the compute before it.
The gather's wait frees it again (:meth:`OffloadState.gathered`), so the device holds it exactly where
``plan.memory()`` counts it. The host step writes the master (the copy back of optimizer offload is
nothing here: the next gather reads the master). Checkpoints read and write the master
(``Executor.local_value`` / ``shard_of``); ``model.state_dict()`` refuses such parameters naming them.

[Note: keeping copies' tensors alive] A non-blocking copy reads its source after the call returns. The
device gradients a ``copy_d2h`` reads are marked with ``record_stream`` (the caching allocator does not
reuse them before the copy stream is past them, even if ``zero_grad`` drops them at once); the host
tensors are ours: the worker waits for a buffer's gradient copy (``d2h``) before reading the host gradient
and for its last copy to the device (``h2d``) before writing the master again.

[Note: clipping] Without overlap, ``sp.clip_grad_norm_`` scales the device gradients after they were
copied; it tells this module the coefficient (:meth:`OffloadState.grads_scaled`), and the host gradient is
scaled by the same number before the step. Any other change to a gradient after its copy (its tensor or
version differs at step time) makes the step copy that gradient again: slower, never stale. With
overlap, ``clip_grad_norm_`` after a host step already ran raises (pass ``max_grad_norm=`` instead).
"""

from __future__ import annotations

import contextlib
import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import RuntimeShardingError
from ..plan.kinds import COPY_D2H, OPTIM_STEP, PRE_FORWARD, Offload
from ..plan.offload import slab_layout
from .buffers import BufferState, alias, alloc_storage, free_storage
from .host_worker import HostWorker

HYPER = ("lr", "betas", "eps", "weight_decay")  # what the host step reads from the optimizer's param group
# opt.host_stats(): seconds of host steps (kernel_s of them in the AdamW kernels, the rest waiting for the
# gradient's copy), seconds opt.step() waited for them, buffer steps, of which during backward
STATS = dict(host_step_s=0.0, kernel_s=0.0, exposed_s=0.0, steps=0, overlapped=0)


def _slabs(buffers: list, device: torch.device) -> dict:
    """``{buffer index: [4 zeroed host tensors of its shard's size]}`` (pinned on CUDA: master, gradient, two
    moments), cut from the slabs of :func:`shardplan.plan.offload.slab_layout` ([Note: slabs] there: torch's
    pinned allocator rounds every block up to a power of two, so on CUDA the slabs are powers of two
    themselves, each tensor placed on its own; on CPU one exact slab per dtype). ``plan.memory().host`` /
    ``host_pinned`` count the same slabs. Empty shards get empty tensors."""
    pin = device.type == "cuda"
    by_dtype: dict = {}
    for b in buffers:
        by_dtype.setdefault(b.dtype, []).append(b)
    out = {}
    for dt, bs in by_dtype.items():
        item = torch.empty(0, dtype=dt).element_size()
        for b in [b for b in bs if b.shard.numel() == 0]:
            out[b.bp.index] = [torch.zeros(0, dtype=dt) for _ in range(4)]
        # a frozen buffer's host holds its master only (no gradient, no moments), as plan.memory().host counts it
        need = {(b.bp.index, k): b.shard.numel() * item for b in bs if b.shard.numel()
                for k in range(4 if b.requires_grad else 1)}
        for size, placed in slab_layout(need, pinned=pin):
            slab = torch.zeros(size // item, dtype=dt, pin_memory=pin)
            for (index, k), offset in placed:
                out.setdefault(index, [None] * 4)[k] = slab[offset // item:(offset + need[index, k]) // item]
        for b in bs:
            if b.shard.numel() and not b.requires_grad:
                out[b.bp.index][1:] = [torch.zeros(0, dtype=dt) for _ in range(3)]
    return out


def _snapshot(group: dict) -> dict:
    """``group`` for a step the worker runs later: tensor hyper-parameters copied (torch's LR schedulers update
    a tensor learning rate in place, and ``scheduler.step()`` right after ``opt.step()`` must not reach a host step
    still queued: it would step with the next step's learning rate)."""
    def own(v):
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        return tuple(own(x) for x in v) if isinstance(v, tuple) else v
    return {k: (v if k == "params" else own(v)) for k, v in group.items()}


def _hyper(group: dict) -> dict:
    """The hyper-parameters a step uses, as plain values (a tensor learning rate by value)."""
    return {k: (float(group[k]) if isinstance(group[k], torch.Tensor) else group[k]) for k in HYPER}


class HostStep(enum.Enum):
    """Where one offloaded buffer's host step stands ([Note: the host step overlaps the next forward])."""

    IDLE = "idle"        # none in flight: the master's copy to the device is issued (or nothing changed)
    QUEUED = "queued"    # handed to the worker during backward; opt.step() has not claimed it yet
    CLAIMED = "claimed"  # opt.step() took it as its step; the unit's next copy_h2d waits for it


@dataclass(eq=False)
class InFlightStep:
    """A host step handed to the worker (during backward at ``optim_step``, or by ``opt.step()``)."""

    future: Future                    # -> (seconds the host step took, seconds in the kernels)
    hyper: dict                       # the hyper-parameters it used
    ready: Any = None                 # event: the device read the shard for the last time before the copy back
    in_backward: bool = True          # handed over during backward (host_stats' "overlapped")


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
    inflight: Optional[InFlightStep] = None  # its host step, in the worker (or done, not yet landed)
    state: HostStep = HostStep.IDLE
    hyper: Optional[dict] = None      # the hyper-parameters its last host step used (checked by opt.step())
    staged: bool = False              # offload="params": the device shard holds the master (copy_h2d to gather)
    device_view: Any = None           # offload="params": the device shard's storage, its own version counter

    @property
    def params(self) -> bool:
        """offload="params": the parameter shard itself lives on the host ([Note: hosted parameter shards])."""
        return self.mode == Offload.PARAMS

    @property
    def trainable(self) -> list:
        return [m for m in self.b.members if m.info.requires_grad]


class OffloadState:
    """The host side of one sharded model (``exe.offload``); built by :func:`attach`."""

    def __init__(self, exe):
        self.exe = exe
        self.cuda = exe.device.type == "cuda"
        # one stream per direction: PCIe copies both ways at once
        self.d2h_stream = torch.cuda.Stream(exe.device) if self.cuda else None
        self.h2d_stream = torch.cuda.Stream(exe.device) if self.cuda else None
        self.optimizer_ref = None         # weak reference to the OffloadAdamW stepping this model (it registers)
        self.worker: Optional[HostWorker] = None
        # the worker's priority of a unit's host step: its place in the forward ([Note: host step order])
        self.priority = {u.name: k for k, u in enumerate(exe.plan.units)}
        self.stats = dict(STATS)
        self.hosts: dict[int, HostBuffer] = {}
        self.submitted: list[HostBuffer] = []  # steps queued during backward, in the order they were queued
        self.values: dict[str, torch.Tensor] = {}  # offload="params": parameter name -> view of its host master
        offloaded = [b for u in exe.unit_list for b in u.buffers if b.bp.offload]
        slabs = _slabs(offloaded, exe.device)
        for b in offloaded:
            n = b.shard.numel()
            master, grad, exp_avg, exp_avg_sq = slabs[b.bp.index]
            master.copy_(b.shard.detach())
            hb = HostBuffer(b, b.bp.offload, master=master, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
            hb.steps = {m.index: torch.tensor(0.0) for m in hb.trainable}
            self.hosts[b.bp.index] = hb
            if hb.params:  # [Note: hosted parameter shards]: the master is the shard; the device copy goes
                hb.device_view = alias(b.shard, 0, (b.shard.numel(),))  # (its own version counter)
                free_storage(b.shard)
                for m in b.members:
                    self.values[m.name] = hb.master[m.shard].view(m.piece.shape)

    # -- the schedule's ops (executor handlers) ------------------------------------------------------
    def run(self, op) -> None:
        hosts = [self.hosts[i] for i in op.buffers]
        if op.kind == COPY_D2H:
            self.copy_grads(hosts)
        elif op.kind == OPTIM_STEP:
            self.start_steps(hosts)
        else:
            self.copy_params(hosts, before_gather=op.event == PRE_FORWARD)
        self.harvest()

    def copy_grads(self, hosts: list[HostBuffer]) -> None:
        """The reduced local gradients of ``hosts`` to host memory (a side stream on CUDA)."""
        with self._side(self.d2h_stream):
            for hb in hosts:
                dsts, srcs = [], []
                for m in hb.trainable:
                    g = m.local.grad
                    if m.held and g is not None:
                        src = g.detach().reshape(-1)  # (a copy, when strided, made on the copy stream itself)
                        dsts.append(hb.grad[m.shard])
                        srcs.append(src)
                        if self.cuda:  # [Note: keeping copies' tensors alive]: made on the compute stream
                            g.record_stream(self.d2h_stream)
                    hb.copied[m.index] = None if g is None else (id(g), g._version)
                if dsts:
                    torch._foreach_copy_(dsts, srcs, non_blocking=self.cuda)
                hb.scales.clear()
                hb.d2h = self._event(self.d2h_stream)

    def copy_params(self, hosts: list[HostBuffer], before_gather: bool = False) -> None:
        """The stepped master shards on the device before anything reads them (idempotent): waits for these
        buffers' host steps only ([Note: the host step overlaps the next forward]). A hosted parameter shard
        ([Note: hosted parameter shards]) is copied in for the all-gather that follows. ``before_gather``
        (ZeRO-3's copy before a unit's forward gather): only the gather reads a sharded buffer's shard, so a
        gather that runs on the gather stream waits for the copy, not the compute stream."""
        for hb in hosts:
            if hb.inflight is not None:
                self._land(hb, block=True)
            if hb.params:
                self._stage(hb)
                continue
            if hb.dirty:
                self._issue_h2d(hb)
            if self.cuda and hb.h2d is not None:
                bp = hb.b.bp
                if before_gather and bp.sharded and self.exe.comm.groups.gather(bp.axes).pg is not None:
                    self.exe.comm.streams.side_waits("gather", hb.h2d)
                else:
                    torch.cuda.current_stream().wait_event(hb.h2d)

    def _stage(self, hb: HostBuffer) -> None:
        """offload="params": allocate the device shard and copy the master into it on the host-to-device
        stream; the gather stream (not the compute stream) waits for the copy, so a prefetched copy overlaps
        the compute before it."""
        if hb.staged:
            return
        alloc_storage(hb.b.shard)  # on the compute stream, like every buffer ([Note: streams], streams.py)
        if self.cuda:
            self.h2d_stream.wait_stream(torch.cuda.current_stream())
        with (torch.cuda.stream(self.h2d_stream) if self.cuda else contextlib.nullcontext()):
            with torch.no_grad():
                hb.device_view.copy_(hb.master, non_blocking=self.cuda)
            hb.h2d = self._event(self.h2d_stream)
        if self.exe.comm.groups.gather(hb.b.bp.axes).pg is not None:
            self.exe.comm.streams.side_waits("gather", hb.h2d)
        elif self.cuda:  # a gather that moves nothing (a shard group of one) copies on the compute stream
            torch.cuda.current_stream().wait_event(hb.h2d)
        hb.staged = True

    def gathered(self, indices) -> None:
        """The all-gather of these buffers completed (the compute stream waited for it): the device copies
        of hosted parameter shards are freed until the next gather's ``copy_h2d``."""
        for i in indices:
            hb = self.hosts.get(i)
            if hb is not None and hb.params and hb.staged:
                free_storage(hb.b.shard)
                hb.staged = False

    def hosted_shard(self, index: int) -> Optional[torch.Tensor]:
        """The host master of buffer ``index`` when its parameter shard is hosted, else ``None``."""
        hb = self.hosts.get(index)
        if hb is None or not hb.params:
            return None
        self.settle()
        return hb.master

    def hosted_value(self, name: str) -> Optional[torch.Tensor]:
        """A view of parameter ``name``'s host master when its shard is hosted, else ``None``."""
        v = self.values.get(name)
        if v is not None:
            self.settle()
        return v

    # -- the overlapped host step ([Note: the overlapped step]) --------------------------------------------
    def start_steps(self, hosts: list[HostBuffer]) -> None:
        """``optim_step``: hand the host steps of ``hosts`` to the worker, where that gives opt.step()'s result."""
        opt = self.optimizer_ref() if self.optimizer_ref is not None else None
        if opt is None or not opt.overlap or opt.max_grad_norm is not None:
            return  # the step runs in opt.step()
        used = self.exe.grads.used
        group = opt.param_groups[0]
        for hb in hosts:
            if hb.state == HostStep.QUEUED:
                raise RuntimeShardingError(
                    f"shardplan: the host stepped buffer #{hb.b.bp.index} in the previous synchronising backward, "
                    f"but opt.step() was not called before this one: with the overlapped host step every "
                    f"synchronising backward is an optimizer step. Call opt.step() after each (no_sync for "
                    f"accumulation), or build the optimizer with shardplan.offload_optimizer(..., overlap=False)")
            if not all(used[m.index] for m in hb.trainable):
                continue  # a gradient may still become None at end_backward: opt.step() decides
            active = [m for m in hb.trainable if m.local.grad is not None]
            if not active:
                continue
            if hb.inflight is not None:  # (the last step's, landed by the forward in every normal loop)
                self._land(hb, block=True)
            self._submit(hb, active, group, opt.fused, in_backward=True)
            hb.state = HostStep.QUEUED
            self.submitted.append(hb)

    def _submit(self, hb: HostBuffer, active: list, group: dict, fused: Optional[bool], in_backward: bool) -> None:
        """Hand ``hb``'s AdamW to the worker ([Note: host step order]); the copy back waits for ``ready``."""
        ready = self._event(torch.cuda.current_stream()) if self.cuda else None
        fut = self._pool().submit(self.priority.get(hb.b.bp.unit, len(self.priority)), _host_compute,
                                  (hb, active, _snapshot(group), fused, hb.d2h, hb.h2d), ready=hb.d2h)
        hb.hyper = _hyper(group)
        hb.inflight, hb.d2h = InFlightStep(fut, hb.hyper, ready, in_backward), None

    def harvest(self) -> None:
        """Issue the copy back of every host step the worker finished (without waiting for the others)."""
        for hb in self.hosts.values():
            if hb.inflight is not None and hb.inflight.future.done():
                self._land(hb, block=False)

    def _land(self, hb: HostBuffer, block: bool) -> None:
        rec = hb.inflight
        t0 = time.perf_counter()
        seconds, kernel = rec.future.result()  # re-raises what the worker raised
        if block:
            self.stats["exposed_s"] += time.perf_counter() - t0
        self.stats["host_step_s"] += seconds
        self.stats["kernel_s"] += kernel
        self.stats["steps"] += 1
        self.stats["overlapped"] += rec.in_backward
        hb.inflight = None
        hb.dirty = True
        self._issue_h2d(hb, after=rec.ready)
        if hb.state == HostStep.CLAIMED:
            hb.state = HostStep.IDLE

    def claim(self, group: dict) -> set:
        """``opt.step()``: check the steps queued during backward are the steps it would take now, without
        waiting for them ([Note: the host step overlaps the next forward]); returns the indices of the
        buffers they step (opt.step() hands the others to the worker, or steps them itself)."""
        done = set()
        now = _hyper(group)
        submitted, self.submitted = self.submitted, []
        for hb in submitted:
            if hb.state != HostStep.QUEUED:
                continue
            rec = hb.inflight
            hb.state = HostStep.CLAIMED if rec is not None else HostStep.IDLE
            done.add(hb.b.bp.index)
            used = hb.hyper
            if used != now:
                raise RuntimeShardingError(
                    f"shardplan: the optimizer's hyper-parameters changed between backward and opt.step() ({used} "
                    f"-> {now}), but the host steps ran during backward with the old ones: set the learning rate "
                    f"(scheduler.step()) before backward, e.g. right after opt.step(), or build the optimizer with "
                    f"shardplan.offload_optimizer(..., overlap=False)")
            for m in hb.trainable:
                g = m.local.grad
                if hb.copied.get(m.index) is not None and (g is None or hb.copied[m.index] != (id(g), g._version)):
                    raise RuntimeShardingError(
                        f"shardplan: the gradient of {m.name!r} changed after backward, but its host step already ran "
                        f"during backward with the gradient backward produced: to clip, pass max_grad_norm= to "
                        f"shardplan.offload_optimizer (it clips before stepping); to change gradients by hand, build "
                        f"it with overlap=False")
        return done

    def check_clip(self) -> None:
        """``sp.clip_grad_norm_`` is about to scale the gradients: impossible once host steps used them."""
        if any(hb.state == HostStep.QUEUED for hb in self.hosts.values()):
            raise RuntimeShardingError(
                "shardplan: clip_grad_norm_ after backward, but the host optimizer step of the offloaded buffers "
                "already ran during backward (overlapped) with the unclipped gradients: pass max_grad_norm= to "
                "shardplan.offload_optimizer(model, ..., max_grad_norm=1.0) (it clips by the global norm before its "
                "steps), or build it with overlap=False to keep calling clip_grad_norm_ yourself")

    def wait_all(self) -> None:
        """Finish every step in flight (before anything else reads or writes the host tensors)."""
        for hb in self.hosts.values():
            if hb.inflight is not None:
                self._land(hb, block=True)

    def settle(self) -> None:
        """Every host step done and its shard on the device, the compute stream after the copies: what a
        reader of the shards or the host state between ``opt.step()`` and the next forward calls first."""
        if any(hb.inflight is not None or hb.dirty for hb in self.hosts.values()):
            self.wait_all()
            for hb in self.hosts.values():
                if hb.dirty:
                    self._issue_h2d(hb)
        self.finish_step()

    # -- the host step in opt.step() ----------------------------------------------------------------------
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
        """AdamW on ``hb``'s master shard, on the CPU, in ``opt.step()``; then its copy back to the device."""
        t0 = time.perf_counter()
        active = self._prepare(hb)
        if not active:
            return
        _, kernel = _host_compute(hb, active, group, fused, hb.d2h, hb.h2d)
        hb.d2h = None
        seconds = time.perf_counter() - t0
        self.stats["host_step_s"] += seconds
        self.stats["kernel_s"] += kernel
        self.stats["exposed_s"] += seconds
        self.stats["steps"] += 1
        hb.dirty = True
        self._issue_h2d(hb)

    def submit_step(self, hb: HostBuffer, group: dict, fused: Optional[bool]) -> None:
        """``opt.step()``'s host step of a buffer that did not step during backward, handed to the worker:
        the gradients it reads are settled here (copied again, scaled); the next forward waits for it."""
        if hb.inflight is not None:
            self._land(hb, block=True)
        active = self._prepare(hb)
        if active:
            self._submit(hb, active, group, fused, in_backward=False)
            hb.state = HostStep.CLAIMED

    def _prepare(self, hb: HostBuffer) -> list:
        """The members of ``hb`` that step now, their host gradients made current (copied again when the
        device gradient changed after its copy, scaled by the clip coefficients applied since)."""
        active = []
        for m in hb.trainable:
            g = m.local.grad
            if g is None:  # no gradient this step: skipped, as torch's optimizers skip it
                continue
            if hb.copied.get(m.index) != (id(g), g._version):  # changed after its copy (or never copied): again
                if hb.d2h is not None:  # the pending copy into the host gradient lands first
                    hb.d2h.synchronize()
                    hb.d2h = None
                if m.held:
                    hb.grad[m.shard].copy_(g.detach().reshape(-1))
                hb.copied[m.index] = (id(g), g._version)
                # [Note: a fresh copy holds whatever scaling the device gradient has: no pending scale]
                active.append((m, True))
            else:
                active.append((m, False))
        if not active:
            return []
        with torch.no_grad():
            for m, fresh in active:
                if hb.scales and not fresh and m.held:
                    if hb.d2h is not None:
                        hb.d2h.synchronize()
                        hb.d2h = None
                    for c in hb.scales:
                        hb.grad[m.shard].mul_(c.to(hb.grad.dtype))
            hb.scales.clear()
        return [m for m, _ in active]

    def _issue_h2d(self, hb: HostBuffer, after=None) -> None:
        """The master to the device shard, non-blocking on the host-to-device stream. ``after``: an event
        the copy waits for (the device's last read of the shard); else everything issued so far. A hosted
        parameter shard has no device copy between gathers: the next gather's ``copy_h2d`` copies it."""
        if hb.params:
            hb.dirty = False
            return
        if self.cuda:
            if after is not None:
                self.h2d_stream.wait_event(after)
            else:
                self.h2d_stream.wait_stream(torch.cuda.current_stream())
        with (torch.cuda.stream(self.h2d_stream) if self.cuda else contextlib.nullcontext()):
            with torch.no_grad():
                hb.b.shard.copy_(hb.master, non_blocking=self.cuda)
            hb.h2d = self._event(self.h2d_stream)
        hb.dirty = False

    def finish_step(self) -> None:
        """After the host step: anything the compute stream runs next sees the new shards."""
        if self.cuda:
            for hb in self.hosts.values():
                if hb.h2d is not None:
                    torch.cuda.current_stream().wait_event(hb.h2d)

    def shards_changed(self) -> None:
        """The device shards were written outside a step (a checkpoint load): the masters follow them."""
        self.wait_all()
        for hb in self.hosts.values():
            if hb.h2d is not None:
                hb.h2d.synchronize()
            if not hb.params:  # a hosted parameter shard was written in its master (Executor.local_value)
                hb.master.copy_(hb.b.shard.detach())
            hb.dirty, hb.h2d, hb.state = False, None, HostStep.IDLE
        self.submitted = []

    # -- inspection --------------------------------------------------------------------------------------
    def host_bytes(self) -> int:
        """Bytes of host memory this rank's offload allocated: its slabs' storages (every host tensor is a view
        of one) and the step counts. ``plan.memory().host`` on CPU, ``plan.memory().host_pinned`` on CUDA
        (the slabs are powers of two there); the process's RSS adds Python, torch, CUDA and the model."""
        slabs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for hb in self.hosts.values() for t in (hb.master, hb.grad, hb.exp_avg, hb.exp_avg_sq) if t.numel()}
        steps = sum(t.untyped_storage().nbytes() for hb in self.hosts.values() for t in hb.steps.values())
        return sum(slabs.values()) + steps

    # -- helpers ------------------------------------------------------------------------------------------
    def _pool(self) -> HostWorker:
        if self.worker is None:  # one thread, the unit the next forward needs first, first
            self.worker = HostWorker()
        return self.worker

    def _side(self, stream):
        if not self.cuda:
            return contextlib.nullcontext()
        stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(stream)

    def _event(self, stream):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev


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


def attach(exe) -> None:
    """Give an executor whose plan offloads its host side (``shard()`` calls this)."""
    exe.offload = OffloadState(exe) if exe.plan.offload else None
