"""The schedule's plain frozen values: :class:`Op` (one op, its trigger and condition), :class:`Step` (one event and
the ops it runs), :class:`Program` (the steps in execution order). ``plan.schedule`` is a tuple of ops, ``plan.program``
a program (``schedule.py`` builds both).

>>> [str(o) for o in plan.ops()[:2]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .kinds import (ACTIVATIONS, ALWAYS, BACKWARD, BACKWARD_EVENTS, BEFORE_FORWARD, COLLECTIVES, FORWARD, MODULE_FORWARD,
                    NO_GRAD, POST_FORWARD, PRE_FORWARD, RECOMPUTE, RECOMPUTE_WHOLE, STALE, STEP, SYNC, Condition, Event,
                    OpKind, Phase, Subject)


@dataclass(frozen=True, kw_only=True)
class Op:
    """One op of the schedule.

    >>> Op(kind=FREE, unit="layers.0", what=PARAMS, event=POST_FORWARD, at="layers.0", buffers=(2,))

    ``kind`` (:class:`~shardplan.planner.kinds.OpKind`): all_gather | reduce_scatter | all_reduce | wait | free |
    prepare | copy_d2h | copy_h2d | optim_step (CPU offload) | all_to_all (expert parallelism); ``what``
    (:class:`~shardplan.planner.kinds.Subject`): params | grads | used | scales (FP8 compute's absmaxes) |
    partial_grads (replicated parameters read on tp-sharded activations: their gradients summed over tp) |
    activations (a tensor-parallel module's output in forward, its input's gradient in backward, attention's
    keys and values, an expert module's tokens: ``at`` names the module; these run inside the module's call,
    not at a unit's step).
    ``unit``: the unit whose buffers it touches; ``event``/``at``: what triggers it; ``when``: its
    condition. ``bytes`` is the payload of a collective (the full, gathered or unreduced size on one
    rank). A ``wait`` completes the unit's pending op of the same ``what``: for params it also binds the
    full parameters into the modules, for grads it hands the local shards their gradients. A ``free``
    of params binds the local shards again and releases the gathered storage (kept for persistent
    buffers); a ``free`` of grads releases the unsharded gradient.
    """

    kind: OpKind
    unit: str
    what: Subject
    event: Event
    at: str = ""
    buffers: tuple[int, ...] = ()
    axes: tuple[str, ...] = ()
    bytes: int = 0
    prefetch: bool = False
    when: Condition = ALWAYS

    @property
    def phase(self) -> Phase:
        if self.event == BEFORE_FORWARD:
            return STEP
        if self.when in (RECOMPUTE, RECOMPUTE_WHOLE):
            return BACKWARD
        return FORWARD if self.event in (PRE_FORWARD, POST_FORWARD, MODULE_FORWARD) else BACKWARD

    @property
    def trigger(self) -> str:
        return f"{self.event}({self.at})" if self.at else f"{self.event}"

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.kind, self.unit, self.phase)

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES

    @property
    def in_module(self) -> bool:
        """Whether the op runs inside a module's call (tensor-parallel activations), not at a unit's step."""
        return self.what == ACTIVATIONS

    def applies(self, *, stale: bool = True, grad: bool = True, sync: bool = True,
                recompute: Union[bool, str] = False) -> bool:
        """Whether the op runs in a step with these facts (see :mod:`shardplan.planner.schedule`); ``recompute``:
        ``True`` (activation checkpointing with torch's default early stop), ``"whole"`` (the whole unit
        recomputed: ``set_checkpoint_early_stop(False)``) or ``False``."""
        if not grad and self.event in BACKWARD_EVENTS:
            return False
        w = self.when
        return (w == ALWAYS or (w == STALE and stale) or (w == SYNC and sync) or (w == NO_GRAD and not grad)
                or (w == RECOMPUTE and bool(recompute) and grad)
                or (w == RECOMPUTE_WHOLE and recompute == "whole" and grad))

    def __str__(self) -> str:
        flags = (" prefetch" if self.prefetch else "") + (f" [{self.when}]" if self.when else "")
        ax = ",".join(self.axes) or "-"
        size = f"{self.bytes:>13,d} B" if self.is_collective else " " * 15
        return f"{self.trigger:<34} {self.kind:<14} {self.what:<6} {self.unit:<22} axes={ax:<12} {size}{flags}" \
            if not self.in_module else \
            f"{self.trigger:<34} {self.kind:<14} {'acts':<6} {self.unit:<22} axes={ax:<12} {size}{flags}"


@dataclass(frozen=True)
class Step:
    """One event of a step and the indices (into ``plan.schedule``) of the ops it runs, in order."""

    event: Event
    at: str
    ops: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.event}({self.at})" if self.at else f"{self.event}"


@dataclass(frozen=True)
class Program:
    """The schedule arranged for execution: the forward steps, the backward steps (``pre_backward`` and
    ``post_backward`` interleaved in the order they come when units run in plan order), ``end_backward``."""

    forward: tuple[Step, ...]
    backward: tuple[Step, ...]
    end: Step

    def canonical(self) -> list[Step]:
        """Every step in plan order (the printed order)."""
        return list(self.forward) + list(self.backward) + [self.end]
