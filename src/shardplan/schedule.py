"""The communication schedule of one training iteration, derived from units and a strategy.

An iteration is forward, backward and (for ZeRO-1/2) the all-gather of the shards the optimizer
updated, which the runtime issues lazily before the next forward and the schedule lists first.
The runtime records the ops it issues; for a model whose units run in plan order the two lists are
equal (tests check it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, FREE = "all_gather", "reduce_scatter", "all_reduce", "free"
FORWARD, BACKWARD, STEP = "forward", "backward", "step"

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class Op:
    """One schedule op. ``bytes`` is the payload: the full (gathered / unreduced) size on one rank."""

    kind: str
    unit: str
    phase: str
    buffers: tuple[int, ...]
    axes: tuple[str, ...]
    bytes: int
    prefetch: bool = False
    what: str = "params"  # params | grads

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.kind, self.unit, self.phase)

    def __str__(self) -> str:
        pf = " (prefetch)" if self.prefetch else ""
        ax = ",".join(self.axes) or "-"
        return f"{self.phase:<8} {self.kind:<14} {self.unit:<24} {self.what:<6} axes={ax:<12} {self.bytes:>14,d} B{pf}"


@dataclass(frozen=True)
class UnitComm:
    """What the scheduler needs to know of one unit (already reduced to byte counts per op)."""

    name: str
    gather: tuple[tuple[int, tuple[str, ...], int], ...]   # (buffer, shard axes, gathered bytes) of sharded params
    reduce: tuple[tuple[int, tuple[str, ...], int], ...]   # (buffer, shard axes, full grad bytes in reduce dtype)
    allreduce: tuple[tuple[int, tuple[str, ...], int], ...]  # (buffer, replica axes, bytes reduced)
    reshard_after_forward: bool
    is_root: bool = False


def _ops(kind, unit: UnitComm, phase, entries, what="params", prefetch=False) -> list[Op]:
    if not entries:
        return []
    axes = tuple(dict.fromkeys(a for _, ax, _ in entries for a in ax))
    return [Op(kind, unit.name, phase, tuple(b for b, _, _ in entries), axes, sum(n for _, _, n in entries), prefetch, what)]


def _reduce_ops(u: UnitComm, strategy: int) -> list[Op]:
    ops = _ops(REDUCE_SCATTER, u, BACKWARD, u.reduce, "grads") + _ops(ALL_REDUCE, u, BACKWARD, u.allreduce, "grads")
    if strategy >= 2 and u.reduce:
        ops += _ops(FREE, u, BACKWARD, [(b, ax, 0) for b, ax, _ in u.reduce], "grads")
    return ops


def _gather_ahead(order, j: int, phase: str, prefetch: int, gathered: set) -> list[Op]:
    """Gather order[j] if it is not, then prefetch the next ``prefetch`` units of ``order``."""
    ops: list[Op] = []
    for k, v in enumerate(order[j: j + 1 + prefetch]):
        if v.name not in gathered and v.gather:
            ops += _ops(ALL_GATHER, v, phase, v.gather, prefetch=k > 0)
        gathered.add(v.name)
    return ops


def build_schedule(units: Sequence[UnitComm], strategy: int, prefetch: int) -> tuple[Op, ...]:
    """``units``: root first, then the other units in forward order."""
    ops: list[Op] = []
    if strategy in (1, 2):
        for u in units:
            ops += _ops(ALL_GATHER, u, STEP, u.gather)
    gathered: set[str] = set()
    forward = list(units)
    if strategy == 3:
        for j, u in enumerate(forward):
            ops += _gather_ahead(forward, j, FORWARD, prefetch, gathered)
            if not u.is_root and u.reshard_after_forward and u.gather:
                ops += _ops(FREE, u, FORWARD, u.gather)
                gathered.discard(u.name)
    backward = [u for u in reversed(units) if not u.is_root]
    for j, u in enumerate(backward):
        if strategy == 3:
            ops += _gather_ahead(backward, j, BACKWARD, prefetch, gathered)
        ops += _reduce_ops(u, strategy)
        if strategy == 3 and u.gather:
            ops += _ops(FREE, u, BACKWARD, u.gather)
            gathered.discard(u.name)
    for u in units:
        if u.is_root:
            ops += _reduce_ops(u, strategy)
            if strategy == 3 and u.gather:
                ops += _ops(FREE, u, BACKWARD, u.gather)
    return tuple(ops)


def last_forward_unit(units: Sequence[UnitComm]) -> str | None:
    rest = [u for u in units if not u.is_root]
    return rest[-1].name if rest else None
