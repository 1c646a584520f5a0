"""The planner: frozen plan values (``types``), the compiler (``compiler.plan``), per-rank geometry and
layout policy (``geometry``), the schedule (``schedule``, checked by ``validate``), accounting (memory,
bytes, warnings), serialisation and rendering. Everything here is pure: no process group, no GPU."""

from .compiler import plan
from .schedule import Op, Program, Step
from .serialize import FORMAT_VERSION
from .types import BufferPlan, Memory, ParamPlan, Plan, UnitPlan, strategy_level

__all__ = ["plan", "Plan", "ParamPlan", "BufferPlan", "UnitPlan", "Memory", "Op", "Program", "Step",
           "strategy_level", "FORMAT_VERSION"]
