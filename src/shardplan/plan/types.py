"""[Note: compatibility: the plan's values used to live here with :class:`Plan`. They now live in
:mod:`shardplan.plan.values` (and the enums in :mod:`shardplan.plan.kinds`), ``Plan`` in
:mod:`shardplan.plan.facade`; import them from :mod:`shardplan.plan`.]"""

from .facade import Plan
from .kinds import strategy_level
from .values import BufferPlan, Compute, Memory, ParamPlan, Piece, UnitPlan, buffer_facts

__all__ = ["Plan", "ParamPlan", "BufferPlan", "UnitPlan", "Memory", "Compute", "Piece", "buffer_facts", "strategy_level"]
