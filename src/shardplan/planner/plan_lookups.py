"""Names to places in a :class:`~shardplan.planner.facade.Plan`: a parameter (or a tied alias) to its position
and its :class:`~shardplan.planner.values.ParamPlan`, a unit's name to its
:class:`~shardplan.planner.values.UnitPlan`, and the errors that name what the plan has instead. A mixin of
``Plan``, over its fields.
"""

from __future__ import annotations

from functools import cached_property

from ..errors import PlanError
from .kinds import strategy_level
from .values import ParamPlan, UnitPlan


class PlanLookups:
    """``Plan``'s lookups by name: ``name in plan``, ``index``, ``param``, ``unit``; ``level``."""

    @cached_property
    def _positions(self) -> dict[str, int]:
        out = {p.name: i for i, p in enumerate(self.params)}
        for i, p in enumerate(self.params):
            for a in p.aliases:
                out[a] = i
        return out

    @cached_property
    def _units_by_name(self) -> dict[str, UnitPlan]:
        return {u.name: u for u in self.units}

    @property
    def level(self) -> int:
        return strategy_level(self.strategy)

    def has_param(self, name: str) -> bool:
        """Whether ``name`` (or a tied alias of it) is a parameter of the plan; also ``name in plan``."""
        return name in self._positions

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._positions

    def index(self, name: str) -> int:
        """Position of parameter ``name`` (or a tied alias) in ``plan.params``.

        >>> plan.params[plan.index("layers.0.w")].name
        'layers.0.w'
        """
        try:
            return self._positions[name]
        except KeyError:
            raise self._no_param(name) from None

    def _no_param(self, name: str) -> PlanError:
        close = [p.name for p in self.params if name.split(".")[-1] in p.name][:5] or [p.name for p in self.params[:5]]
        return PlanError(f"the plan has no parameter {name!r}; it has e.g. {close}")

    def param(self, name: str) -> ParamPlan:
        return self.params[self.index(name)]

    def unit(self, name: str) -> UnitPlan:
        try:
            return self._units_by_name[name]
        except KeyError:
            raise PlanError(f"the plan has no unit {name!r}; units: {[u.name for u in self.units]}") from None
