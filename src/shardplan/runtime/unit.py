"""A unit's runtime state: one object, explicit states, named records of collectives in flight."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..planner import Op
from .buffers import BufferState


class Params(enum.Enum):
    """Where a unit's parameters are (FSDP2's ``ShardedState`` idea)."""

    SHARDED = "sharded"      # the modules hold the local shards; gathered storage released (or kept, persistent)
    GATHERING = "gathering"  # an all-gather is in flight
    UNSHARDED = "unsharded"  # the full parameters are valid and bound to the modules


class Grads(enum.Enum):
    """Where a unit is in one backward pass."""

    IDLE = "idle"            # no gradient of this backward yet
    RUNNING = "running"      # its backward started (or a gradient arrived)
    COMPLETE = "complete"    # every gradient it will get is in; waiting for its turn in the gradient stream
    REDUCING = "reducing"    # its reduction is issued
    DONE = "done"            # the gradient stream passed it (reduced and waited, or no reduction this pass)


@dataclass
class PendingGather:
    """An all-gather in flight: its op, work handles, the event the compute stream waits on, and the
    tensors the collective reads, kept alive until then; ``extra``: the unit's gathers over other
    process groups issued at the same step (one op per group), completed together."""

    op: Op
    works: list
    event: Any
    keep: list
    extra: tuple = ()


@dataclass
class PendingReduce:
    """A unit's reductions in flight: per buffer, its input and the tensor holding its result."""

    op: Op
    works: dict          # buffer index -> work handles
    inputs: dict         # buffer index -> tensor the reduction read
    results: dict        # buffer index -> tensor holding the reduced gradient
    event: Any = None
    unpack: dict = field(default_factory=dict)  # quantized reductions: buffer index -> what the all-to-all received


@dataclass
class PendingUsed:
    """The exchange of which parameters got a gradient on any rank, in flight: its op, work and flags."""

    op: Op
    work: Any
    flags: torch.Tensor


@dataclass
class UnitRuntime:
    name: str
    buffers: list[BufferState]
    params: Params = Params.SHARDED
    grads: Grads = Grads.IDLE
    expected: int = 0     # parameters that take gradients
    got: int = 0          # of those, how many got one in this backward
    awaiting: int = 0     # input gradients of its tensor-parallel modules still to be reduced (module_backward ops)
    params_done: bool = False  # every parameter's gradient of this backward arrived
    entered: int = 0      # forward calls in this step
    gather: Optional[PendingGather] = None
    reduce: Optional[PendingReduce] = None

    @property
    def with_grads(self) -> list[BufferState]:
        return [b for b in self.buffers if b.requires_grad]

    def start_pass(self) -> None:
        self.grads = Grads.IDLE
        self.got = 0
        self.params_done = False

    def start_forward(self) -> None:
        self.entered = 0
        self.awaiting = 0

    def tensors(self) -> list[Optional[torch.Tensor]]:
        out = [t for b in self.buffers for t in b.tensors()]
        if self.gather is not None:
            out += self.gather.keep
        if self.reduce is not None:
            out += list(self.reduce.inputs.values()) + list(self.reduce.results.values()) + list(self.reduce.unpack.values())
        return out
