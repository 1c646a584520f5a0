"""CPU offload as planned data: which buffers live (partly) in host memory, and what that costs.

``plan(offload="optimizer")``: each offloaded buffer keeps, in host memory, a master copy of this rank's
shard, a copy of its reduced gradient shard and the optimizer state; the optimizer step of those buffers
runs on the host. ``offload="params"`` (ZeRO-3 only) also keeps the parameter shard itself on the host:
the device holds it only from the ``copy_h2d`` before each of the unit's all-gathers to the gather's wait.

[Note: the fraction rule] ``offload_fraction=f`` offloads a prefix of the trainable buffers in gradient
order (the order their reduce-scatters complete in backward: the last unit of the forward first, the root
last), taken while the offloaded shard bytes stay within ``f`` of the total (at least one buffer). The
buffers whose gradients are ready first are offloaded first: their host copies have the most backward
left to overlap with. A prefix of one fixed order, so a larger fraction offloads a superset.

>>> choose_offloaded(buffers, units, level=3, offload="optimizer", fraction=0.5)   # {buffer index: "optimizer"}
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from ..errors import PlanError
from .kinds import Offload, choose
from .values import BufferPlan, UnitPlan


def check(offload, fraction, level: int) -> tuple[Optional[Offload], float]:
    """``(offload, fraction)`` validated; a :class:`PlanError` naming the fix otherwise.

    >>> check("optimizer", 1.0, 3)
    ('optimizer', 1.0)
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (0 < fraction <= 1) \
            or math.isnan(fraction):
        raise PlanError(f"offload_fraction must be a number with 0 < f <= 1 (the share of the optimizer state "
                        f"moved to host memory); got {fraction!r}")
    if offload is None or offload == "" or offload is False:
        if fraction != 1:
            raise PlanError(f"offload_fraction={fraction!r} needs offload='optimizer' or offload='params'")
        return None, 1.0
    mode = choose(Offload, offload, "offload")
    if mode == Offload.PARAMS and level != 3:
        raise PlanError("offload='params' keeps parameter shards in host memory and copies them in before each "
                        "all-gather, so it needs strategy='optim_grads_params' (ZeRO-3); use offload='optimizer' "
                        "with this strategy")
    return mode, float(fraction)


def shard_bytes(b: BufferPlan) -> int:
    return b.shard_numel * b.itemsize


def gradient_order(units: Sequence[UnitPlan]) -> list[str]:
    """Units in the order their gradients are reduced in backward: reverse forward order, the root last."""
    return [u.name for u in reversed(units[1:])] + [units[0].name]


def choose_offloaded(buffers: Sequence[BufferPlan], units: Sequence[UnitPlan], *, level: int, offload: Offload,
                     fraction: float) -> dict[int, str]:
    """``{buffer index: "optimizer" | "params"}`` for the buffers to offload (see the fraction rule above).

    Candidates are the trainable buffers (frozen ones have no optimizer state). Under ``"params"`` a
    candidate whose full parameters are made from its shard by a gather (sharded, not aliased) keeps its
    shard on the host; one used in place (replicated, no cast) offloads its optimizer only.
    """
    by_unit = {u.name: u for u in units}
    cands = [buffers[i] for name in gradient_order(units) for i in by_unit[name].buffers if buffers[i].requires_grad]
    total = sum(shard_bytes(b) for b in cands)
    out: dict[int, str] = {}
    taken = 0
    for b in cands:
        size = shard_bytes(b)
        if out and taken + size > fraction * total * (1 + 1e-12):
            break
        taken += size
        params = offload == Offload.PARAMS and level == 3 and b.sharded and not b.alias
        out[b.index] = Offload.PARAMS.value if params else Offload.OPTIMIZER.value
    return out


def host_bytes(b: BufferPlan, optimizer_states: int) -> int:
    """Host bytes of one offloaded buffer: the master shard, the gradient shard and ``optimizer_states``
    state tensors, each a flat shard in the parameters' dtype (``0`` for a buffer not offloaded)."""
    if not b.offload:
        return 0
    per = shard_bytes(b)
    return per * (1 + (1 + optimizer_states if b.requires_grad else 0))
