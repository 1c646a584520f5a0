"""The activation collectives tensor-parallel styles issue, one per traced call, with the unit and pass
each belongs to: the same bytes :func:`shardplan.planner.tensor_parallel.activation_bytes` counts, itemised.

>>> [(a.unit, a.phase, a.kind, a.sent) for a in activation_collectives(plan)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..planner.tensor_parallel import EMBEDDING
from ..planner import tensor_parallel as TPX
from ..units import ROOT

if TYPE_CHECKING:  # pragma: no cover
    from ..planner.facade import Plan


@dataclass(frozen=True)
class ActivationCollective:
    path: str
    unit: str
    phase: str     # forward | backward
    kind: str      # all_reduce | all_gather
    axis: str
    payload: int   # bytes of the tensor (all-reduce) or of the gathered output (all-gather)
    sent: int      # bytes one rank sends (ring)


def _unit_of(plan: "Plan", path: str) -> str:
    best, depth = ROOT, -1
    for u in plan.units[1:]:
        for mp in u.module_paths:
            if (path == mp or path.startswith(mp + ".")) and len(mp) > depth:
                best, depth = u.name, len(mp)
    return best


def activation_collectives(plan: "Plan") -> tuple[ActivationCollective, ...]:
    """Every activation collective of one training step (empty without compute axes or a trace)."""
    if not TPX.of(plan).axes or TPX.of(plan).activations is None:
        return ()
    by_path = {m.path: m for m in TPX.of(plan).modules}
    out = []
    for a in TPX.of(plan).activations:
        m = by_path[a.path]
        n = plan.mesh.axis_size(m.axis)
        unit = _unit_of(plan, a.path)
        out_b, in_b = a.output_numel * a.itemsize, a.input_numel * a.itemsize

        def add(phase: str, kind: str, payload: int) -> None:
            sent = 2 * payload * (n - 1) // n if kind == "all_reduce" else payload * (n - 1) // n
            out.append(ActivationCollective(a.path, unit, phase, kind, m.axis, payload, sent))

        # [Note: mirrors activation_bytes case by case; a test checks the sums agree]
        if m.kind == EMBEDDING:
            if m.style == "colwise_gather":
                add("forward", "all_gather", out_b)
            elif m.style == "rowwise":
                add("forward", "all_reduce", out_b)
        elif m.style == "colwise":
            if not a.shares_input:
                add("backward", "all_reduce", in_b)
        elif m.style == "colwise_gather":
            add("forward", "all_gather", out_b)
            if not a.shares_input:
                add("backward", "all_reduce", in_b)
        elif m.style == "rowwise":
            add("forward", "all_reduce", out_b)
        else:  # rowwise_split
            add("forward", "all_reduce", out_b)
            add("backward", "all_gather", in_b)
    return tuple(out)
