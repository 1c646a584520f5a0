"""The planner. Modules, bottom up (each imports only those above it in this list):

* ``kinds``: the vocabularies as string enums (op kinds, events, conditions, strategies, orders, layouts);
* ``values``: the plain frozen values (``ParamPlan``, ``BufferPlan``, ``UnitPlan``, ``Op``, ``Program``, ``Piece``...);
* ``heads``, ``tensor_parallel``: compute axes and styles; ``geometry``: layout policy and per-rank pieces; ``offload``:
  which buffers live in host memory (CPU offload);
  ``schedule``: the ops of a step (checked by ``validate``); ``accounting``: memory, bytes, warnings;
  ``serialize``: JSON; ``render``: printed views; ``transforms``: new plans from a plan; ``rebuild``: the options
  and rules file that rebuild a plan;
* ``facade``: :class:`Plan`, the compiled plan: a frozen dataclass, its fields and the methods a user calls, each
  a call into the modules above;
* ``options``: the keywords of :func:`plan` checked against the mesh; ``passes``: the passes ``plan`` runs over them;
* ``compiler``: :func:`plan`, rules + a mesh + options -> a ``Plan``.

Everything here is pure: no process group, no GPU.
"""

from .compiler import plan
from .facade import Plan
from .kinds import (Condition, Event, LayoutChoice, OpKind, Order, Phase, Strategy, Subject,  # noqa: F401
                    strategy_level)
from .serialize import FORMAT_VERSION
from .ops import Op, Program, Step
from .values import BufferPlan, Compute, Memory, ParamPlan, Piece, UnitPlan

__all__ = ["plan", "Plan", "ParamPlan", "BufferPlan", "UnitPlan", "Memory", "Op", "Program", "Step", "Piece",
           "Compute", "OpKind", "Subject", "Event", "Condition", "Phase", "Strategy", "Order", "LayoutChoice",
           "strategy_level", "FORMAT_VERSION"]
