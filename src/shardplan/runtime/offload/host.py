"""CPU offload's host side as records: each offloaded buffer's host tensors (cut from pinned slabs), where its
host step stands (:class:`HostStep`) and the step in flight (:class:`InFlightStep`); the hyper-parameters a step
reads and the statistics ``opt.host_stats()`` gives."""

from __future__ import annotations

import enum
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ...planner.kinds import Offload
from ...planner.offload import slab_layout
from ..buffers import BufferState

HYPER = ("lr", "betas", "eps", "weight_decay")  # what the host step reads from the optimizer's param group


def stamp(g: Optional[torch.Tensor]):
    """What a host copy of gradient ``g`` was taken from: the tensor itself (weakly) and its version then."""
    return None if g is None else (weakref.ref(g), g._version)


def holds(s, g: Optional[torch.Tensor]) -> bool:
    """Whether a copy stamped ``s`` holds ``g`` as it is now: the same tensor (not one that reuses a freed
    tensor's id: a gradient set by hand where backward's was) at the same version."""
    return s is not None and g is not None and s[0]() is g and s[1] == g._version


# opt.host_stats(): seconds of host steps (kernel_s of them in the AdamW kernels, the rest waiting for the
# gradient's copy), seconds opt.step() waited for them, buffer steps, of which during backward
STATS = dict(host_step_s=0.0, kernel_s=0.0, exposed_s=0.0, steps=0, overlapped=0, recopied=0)


def _slabs(buffers: list, device: torch.device) -> dict:
    """``{buffer index: [4 zeroed host tensors of its shard's size]}`` (pinned on CUDA: master, gradient, two
    moments), cut from the slabs of :func:`shardplan.planner.offload.slab_layout` ([Note: slabs] there: torch's
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
    copied: dict = field(default_factory=dict)    # member index -> stamp() of the device grad copied
    scales: list = field(default_factory=list)    # clip coefficients applied to the device grads since the copy
    d2h: Any = None                   # event: the gradient copy is done
    h2d: Any = None                   # event: the master's copy to the device is done
    landed: list = field(default_factory=list)  # captured step: the external events a replay records once the
    # gradient copy is done (the host steps this buffer after the last: [Note: the replay's host step overlaps])
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
