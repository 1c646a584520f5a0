"""New plans from a plan: the schedule the options build (:func:`built_schedule`), whether a plan's schedule is
another (:func:`schedule_edited`), a plan with changed options and the schedule rebuilt (:func:`rebuilt`: what
``plan.with_prefetch``, ``with_reshard_after_forward`` and ``with_order`` call), the units' resharding flags
(:func:`reshard_units`) and another offload fraction (:func:`with_offload_fraction`, for
``offload_fraction="auto"``). Pure functions over a :class:`~shardplan.planner.facade.Plan`.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Union

from ..errors import PlanError
from ..units import ROOT
from . import axes as AX
from . import schedule as S
from .kinds import strategy_level
from .offload import offloaded
from .validate import validate
from .ops import Op


def built_schedule(plan) -> tuple[Op, ...]:
    """The schedule the planner builds from ``plan``'s options (units, buffers, prefetch, order, axes)."""
    return AX.with_ops(S.build_schedule(plan.units, plan.buffers, plan.mesh, strategy_level(plan.strategy),
                                        plan.prefetch, plan.order, len(plan.params)), plan.units, plan.axes, plan.mesh)


def schedule_edited(plan) -> bool:
    """Whether ``plan``'s schedule is not the one its options build (``plan.with_schedule``, or JSON of another
    planner).

    >>> schedule_edited(plan.with_schedule(ops))
    True
    """
    return plan.schedule != built_schedule(plan)


def rebuilt(plan, how: str, **changes):
    """``plan`` with ``changes`` to its fields and the schedule rebuilt from them, validated; ``plan`` itself for
    no change. [Note: a schedule edited with with_schedule cannot be rebuilt (the edit is a list of ops, not a
    rule), so an edited plan is refused rather than its edit silently dropped]"""
    if all(getattr(plan, k) == v for k, v in changes.items()):
        return plan
    if schedule_edited(plan):
        raise PlanError(f"{how}: this plan's schedule was edited (with_schedule, or read from JSON of another "
                        f"planner), and rebuilding it from the options would drop the edit; call {how} on the "
                        f"plan before editing its schedule, then edit the new plan's schedule")
    base = dataclasses.replace(plan, **changes)
    out = dataclasses.replace(base, schedule=built_schedule(base))
    validate(out)
    return out


def reshard_units(plan, which: Union[bool, Mapping[str, bool]]) -> dict:
    """The fields ``plan.with_reshard_after_forward(which)`` changes: the units' flags and the plan's."""
    if isinstance(which, bool):
        flags = {u.name: which for u in plan.units}
    else:
        flags = dict(which)
        for name in flags:
            plan.unit(name)
    units = tuple(dataclasses.replace(u, reshard_after_forward=bool(flags.get(u.name, u.reshard_after_forward)))
                  if u.name != ROOT else u for u in plan.units)
    raf = all(u.reshard_after_forward for u in units[1:]) if len(units) > 1 else plan.reshard_after_forward
    return dict(units=units, reshard_after_forward=raf)


def with_offload_fraction(plan, fraction: float):
    """``plan`` offloading ``fraction`` of the trainable shard bytes (``plan(offload=...)``'s rule,
    planner/offload.py), its schedule rebuilt; not validated (``offload_fraction="auto"``'s candidates)."""
    buffers = offloaded(plan.buffers, plan.units, level=strategy_level(plan.strategy), offload=plan.offload,
                        fraction=fraction)
    base = dataclasses.replace(plan, buffers=buffers, offload_fraction=fraction)
    return dataclasses.replace(base, schedule=built_schedule(base))
