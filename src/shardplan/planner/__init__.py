"""The planner. Modules, bottom up (each imports only those above it in this list):

* ``kinds``: the vocabularies as string enums (op kinds, events, conditions, strategies, orders, layouts);
* ``values``: the plain frozen values (``ParamPlan``, ``BufferPlan``, ``UnitPlan``, ``Op``, ``Program``, ``Piece``...);
* ``heads``, ``tensor_parallel``: compute axes and styles; ``geometry``: layout policy and per-rank pieces; ``offload``:
  which buffers live in host memory (CPU offload);
  ``schedule``: the ops of a step (checked by ``validate``); ``accounting``: memory, bytes, warnings;
  ``serialize``: JSON; ``render``: printed views;
* ``plan_axes``, ``plan_lookups``, ``plan_geometry``, ``plan_schedule``, ``plan_transforms``, ``plan_accounting``,
  ``plan_io``, ``plan_rebuild``: the methods of :class:`Plan`, one job per mixin, reading the values through the
  modules above;
* ``facade``: :class:`Plan`, the compiled plan: its fields, over those mixins;
* ``policies``: the options grouped by feature (``Precision``, ``Offload``, ``Schedule``, ``Layout``), checked
  when made; ``options``: them and the flat keywords merged and checked against the mesh; ``passes``: the passes
  ``plan`` runs over them;
* ``compiler``: :func:`plan`, rules + a mesh + options -> a ``Plan``.

Everything here is pure: no process group, no GPU.
"""

from .compiler import plan
from .facade import Plan
from .kinds import (Condition, Event, LayoutChoice, OpKind, Order, Phase, Strategy, Subject,  # noqa: F401
                    strategy_level)
from .policies import Layout, Offload, Policies, Precision, Schedule
from .serialize import FORMAT_VERSION
from .values import BufferPlan, Compute, Memory, Op, ParamPlan, Piece, Program, Step, UnitPlan

__all__ = ["plan", "Plan", "ParamPlan", "BufferPlan", "UnitPlan", "Memory", "Op", "Program", "Step", "Piece",
           "Compute", "OpKind", "Subject", "Event", "Condition", "Phase", "Strategy", "Order", "LayoutChoice",
           "strategy_level", "FORMAT_VERSION", "Precision", "Offload", "Schedule", "Layout", "Policies"]
