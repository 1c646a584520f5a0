"""New plans from a :class:`~shardplan.planner.facade.Plan`: the ``with_*`` transformations, which change an
option and rebuild the schedule from the options (``with_prefetch``, ``with_reshard_after_forward``,
``with_order``), or take an edited schedule after checking it (``with_schedule``); and whether the schedule is
the one the options build (``schedule_edited``). A mixin of ``Plan``, over its fields.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import TYPE_CHECKING, Mapping, Sequence, Union

from ..errors import PlanError
from ..units import ROOT
from . import axes as AX
from . import schedule as S
from .kinds import Order, choose
from .offload import offloaded
from .validate import normalised, validate
from .values import Op

if TYPE_CHECKING:  # annotations only
    from .facade import Plan


class PlanTransforms:
    """``Plan``'s transformations, each returning a new plan: ``with_prefetch``, ``with_reshard_after_forward``,
    ``with_order``, ``with_schedule``."""

    # [Note: with_prefetch / with_reshard_after_forward / with_order rebuild the schedule from the options. A
    # schedule edited with with_schedule cannot be rebuilt (the edit is a list of ops, not a rule), so they
    # refuse an edited plan rather than silently drop the edit; a no-op change returns the plan itself.]
    @cached_property
    def _built_schedule(self) -> tuple[Op, ...]:
        return AX.with_ops(S.build_schedule(self.units, self.buffers, self.mesh, self.level, self.prefetch, self.order,
                                            len(self.params)), self.units, self.axes, self.mesh)

    @property
    def schedule_edited(self) -> bool:
        """Whether the schedule is not the one the planner builds from the plan's options (:meth:`with_schedule`)."""
        return self.schedule != self._built_schedule

    def with_prefetch(self, prefetch: int) -> "Plan":
        """The same plan gathering ``prefetch`` units ahead (forward and backward).

        >>> plan.with_prefetch(2).prefetch
        2
        """
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise PlanError(f"prefetch must be a non-negative integer (units gathered ahead); got {prefetch!r}")
        return self._rebuilt("with_prefetch", prefetch=prefetch)

    def with_reshard_after_forward(self, which: Union[bool, Mapping[str, bool]]) -> "Plan":
        """The same plan with units kept gathered from forward to backward (``False``) or freed after
        their forward (``True``): one bool for every unit, or ``{unit: bool}``.

        >>> plan.with_reshard_after_forward({"layers.0": False})
        """
        if isinstance(which, bool):
            flags = {u.name: which for u in self.units}
        else:
            flags = dict(which)
            for name in flags:
                self.unit(name)
        units = tuple(dataclasses.replace(u, reshard_after_forward=bool(flags.get(u.name, u.reshard_after_forward)))
                      if u.name != ROOT else u for u in self.units)
        raf = all(u.reshard_after_forward for u in units[1:]) if len(units) > 1 else self.reshard_after_forward
        return self._rebuilt("with_reshard_after_forward", units=units, reshard_after_forward=raf)

    def with_order(self, order: Union[Order, str]) -> "Plan":
        """The same plan for units that run in plan order (``"static"``) or in any order (``"dynamic"``)."""
        return self._rebuilt("with_order", order=choose(Order, order, "order"))

    def with_schedule(self, ops: Sequence[Op]) -> "Plan":
        """The same plan running ``ops`` instead of its schedule, after checking them.

        >>> ops = [o for o in plan.schedule if not (o.kind == "free" and o.event == "post_forward")]
        >>> plan.with_schedule(ops)          # keeps every unit gathered from forward to backward

        Raises :class:`PlanError` naming the op for a schedule that reads a buffer before its gather,
        frees one still in use, leaves a gradient unreduced, or names unknown buffers or triggers. An
        edited plan keeps its options: apply ``with_prefetch`` and the others before ``with_schedule``.
        """
        candidate = dataclasses.replace(self, schedule=normalised(ops))
        validate(candidate)
        return candidate

    def _with_offload_fraction(self, fraction: float) -> "Plan":
        """The same plan offloading ``fraction`` of the trainable shard bytes (``plan(offload=...)``'s rule,
        planner/offload.py), its schedule rebuilt; not validated (``offload_fraction="auto"``'s candidates)."""
        buffers = offloaded(self.buffers, self.units, level=self.level, offload=self.offload, fraction=fraction)
        base = dataclasses.replace(self, buffers=buffers, offload_fraction=fraction)
        return dataclasses.replace(base, schedule=base._built_schedule)

    def _rebuilt(self, how: str, **changes) -> "Plan":
        if all(getattr(self, k) == v for k, v in changes.items()):
            return self
        if self.schedule_edited:
            raise PlanError(f"{how}: this plan's schedule was edited (with_schedule, or read from JSON of another "
                            f"planner), and rebuilding it from the options would drop the edit; call {how} on the "
                            f"plan before editing its schedule, then edit the new plan's schedule")
        base = dataclasses.replace(self, **changes)
        out = dataclasses.replace(base, schedule=base._built_schedule)
        validate(out)
        return out
