"""The :class:`Plan`: the compiled plan's fields, and its methods, each job in a mixin of its own module
that reads the fields through the function modules (geometry, schedule, accounting, render, serialize,
validate). Everything below this layer is a plain value or a pure function; this is the one place they meet.

=====================  ==========================================================================================
``plan_axes.py``       the compute axes by kind and old name (``plan.axis("tp")``, ``plan.tp_modules``), data axes
``plan_lookups.py``    names to places: ``name in plan``, ``index``, ``param``, ``unit``
``plan_geometry.py``   per-rank pieces: ``pieces``, ``piece``, ``local_slices``, ``owner_axes``, ``replicas``, ...
``plan_schedule.py``   the schedule as it runs: ``program``, ``ops(...)``, ``capture_blockers``
``plan_transforms.py`` new plans: ``with_prefetch``, ``with_reshard_after_forward``, ``with_order``, ``with_schedule``
``plan_accounting.py`` costs: ``memory``, ``comm_bytes``, ``host_step_s``, ``forecast`` (``register_forecast``)
``plan_io.py``         JSON and back, ``fingerprint``, ``equivalent``, ``summary``, ``to_chrome_trace``
``plan_rebuild.py``    what rebuilds it: ``policies``, ``declarative()``, ``to_source()``
=====================  ==========================================================================================

This module keeps the dataclass: its fields, how it unpickles (old pickles too) and how it prints. ``Plan``
lives here (``shardplan.planner.facade.Plan``, its ``__module__``), so pickles keep loading.

>>> plan = shardplan.plan(model, rules, Mesh(dp=8), units=[r"layers\\.\\d+"], compute_dtype=torch.bfloat16)
>>> print(plan); plan.memory(); plan.local_slices("layers.0.attention.wq.weight", rank=3)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..mesh import Mesh
from . import context_parallel as CPX
from . import expert_parallel as EP
from . import float8 as F8
from . import render
from . import tensor_parallel as tp
from .kinds import LayoutChoice, Offload, Order, Strategy
from .plan_accounting import PlanAccounting, register_forecast  # noqa: F401 (re-exported: its old home)
from .plan_axes import PlanAxes
from .plan_geometry import PIECE_CACHE_RANKS, PlanGeometry  # noqa: F401 (PIECE_CACHE_RANKS: its old home)
from .plan_io import PlanIO
from .plan_lookups import PlanLookups
from .plan_rebuild import PlanRebuild
from .plan_schedule import PlanSchedule
from .plan_transforms import PlanTransforms
from .values import Activations, BufferPlan, Op, ParamPlan, UnitPlan


@dataclass(frozen=True)
class Plan(PlanAxes, PlanLookups, PlanGeometry, PlanSchedule, PlanTransforms, PlanAccounting, PlanIO,
           PlanRebuild):
    """A compiled plan: who holds what, and the ops one training step runs. Frozen; build with
    :func:`shardplan.plan`, change with :meth:`with_prefetch`, :meth:`with_reshard_after_forward`,
    :meth:`with_order` and :meth:`with_schedule`, which return new plans.

    ``strategy``, ``order`` and ``layout`` are enums whose members are their strings (``plan.order == "static"``).

    >>> plan = shardplan.plan(model, rules, Mesh(dp=8), units=[r"layers\\.\\d+"])
    >>> print(plan); plan.memory(rank=0).peak; plan.local_slices("layers.0.wq.weight", rank=3)
    >>> plan2 = plan.with_prefetch(2)            # a new plan; this one is unchanged
    """

    mesh: Mesh
    strategy: Strategy
    compute_dtype: Optional[str]
    reduce_dtype: Optional[str]
    prefetch: int
    reshard_after_forward: bool
    optimizer_states: int
    params: tuple[ParamPlan, ...]
    buffers: tuple[BufferPlan, ...]
    units: tuple[UnitPlan, ...]
    schedule: tuple[Op, ...]
    warnings: tuple[str, ...] = field(default=())
    order: Order = Order.STATIC
    notes: tuple[str, ...] = field(default=())  # choices the planner made and why (unit sizing)
    min_unit_bytes: int = 0                     # the merging threshold used (chosen or given)
    axes: tuple = ()                            # one value per compute axis on in this plan (planner/axes.py)
    layout: LayoutChoice = LayoutChoice.AUTO    # "chunked": torch.chunk pieces everywhere (DTensor-describable)
    offload: Optional[Offload] = None           # CPU offload: "optimizer" or "params" (which buffers: BufferPlan.offload)
    offload_fraction: float = 1.0               # the share of the trainable shard bytes offloaded
    activations: Optional[Activations] = None  # traced step's activation profile (None: not traced); memory() adds it
    fp8_modules: tuple[F8.FP8Module, ...] = ()  # nn.Linears run in float8 by torchao (fp8="torchao"; sp.shard swaps them)

    # -- pickles: a plan pickled before ``plan.axes`` ----------------------------------------------------------
    def __setstate__(self, state: dict) -> None:
        """[Note: a plan pickled before ``plan.axes`` kept its axes in seven fields of their own (``compute_axes``,
        ``tp_modules``, ...); unpickled, they become its axes, so ``plan.tp_modules`` still reads them]"""
        if "axes" not in state:
            state = dict(state)
            old = {k: state.pop(k, None) for k in ("compute_axes", "tp_modules", "tp_activations", "expert_axes",
                                                   "expert_modules", "expert_calls", "context_calls")}
            state["axes"] = tuple(v for v in (
                tp.TensorAxisPlan(tuple(old["compute_axes"]), tuple(old["tp_modules"] or ()), old["tp_activations"])
                if old["compute_axes"] else None,
                EP.ExpertAxisPlan(tuple(old["expert_axes"] or ()), tuple(old["expert_modules"]), old["expert_calls"])
                if old["expert_modules"] else None,
                CPX.ContextAxisPlan(tuple(old["context_calls"])) if old["context_calls"] is not None else None)
                if v is not None)
        self.__dict__.update(state)

    # -- how it prints (a method of the class itself: the dataclass would write its own __repr__) -------------
    def __str__(self) -> str:
        return render.render(self)

    def __repr__(self) -> str:
        return (f"Plan({self.mesh!r}, strategy={self.strategy!r}, params={len(self.params)}, units={len(self.units)}, "
                f"buffers={len(self.buffers)}, ops={len(self.schedule)}, fingerprint={self.fingerprint()!r})")

