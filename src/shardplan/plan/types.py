"""The plan's frozen values and their lookups: parameters, buffers, units, and the plan itself.

>>> plan = shardplan.plan(model, rules, Mesh(dp=8), units=[r"layers\\.\\d+"], compute_dtype=torch.bfloat16)
>>> print(plan); plan.memory(); plan.local_slices("layers.0.attention.wq.weight", rank=3)
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping, Optional, Sequence, Union

from .. import layout as L
from ..dtypes import itemsize
from ..errors import PlanError
from ..mesh import Mesh
from ..spec import P
from . import accounting, geometry, render, serialize
from . import tensor_parallel as tp
from . import schedule as S
from .schedule import ROOT, STRATEGIES, Op, Program


def strategy_level(strategy) -> int:
    """0..3 from a strategy name or number (ZeRO level)."""
    if isinstance(strategy, int) and not isinstance(strategy, bool) and 0 <= strategy <= 3:
        return strategy
    if strategy in STRATEGIES:
        return STRATEGIES.index(strategy)
    raise PlanError(f"unknown strategy {strategy!r}; use one of {STRATEGIES} or 0..3")


@dataclass(frozen=True)
class ParamPlan:
    name: str
    shape: tuple[int, ...]
    dtype: str
    spec: P
    rule: str
    unit: str
    buffer: int
    offset: int  # contiguous: offset in the gathered buffer; interleaved: offset in every segment; replicated: in buffer
    requires_grad: bool
    aliases: tuple[str, ...] = ()
    tp_dim: int = -1   # the dimension a compute axis keeps sharded while computing (-1: none)
    tp_axis: str = ""  # that compute axis
    tp_size: int = 1   # its size; ``shape`` is the tensor-parallel-local shape (global dim / tp_size)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The whole tensor's shape (``shape`` is what one tensor-parallel rank computes with)."""
        if self.tp_dim < 0:
            return self.shape
        return tuple(s * self.tp_size if d == self.tp_dim else s for d, s in enumerate(self.shape))

    @property
    def storage_spec(self) -> P:
        """The spec over the storage (data) axes: how the tensor-parallel-local tensor is sharded."""
        return tp.storage_spec(self.spec, (self.tp_axis,)) if self.tp_axis else self.spec

    @property
    def row(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1


@dataclass(frozen=True)
class BufferPlan:
    """One flat buffer of a unit: parameters of one dtype sharded over the same axes.

    The facts below the layout are decided once, by the planner, and read by the runtime and by
    :meth:`Plan.memory` alike: ``alias`` (the full buffer and the local shard share storage),
    ``persistent`` (the full buffer is kept between steps), ``grad_alias`` (the local shards' gradients
    are views of the unsharded gradient) and ``keeps_grads`` (the unsharded gradient is kept after its
    reduction, ZeRO-0/1).
    """

    index: int
    unit: str
    dtype: str
    compute_dtype: str
    reduce_dtype: str
    layout: str
    axes: tuple[str, ...]          # shard axes (all-gather / reduce-scatter group), mesh order
    replica_axes: tuple[str, ...]  # gradients all-reduced over these
    group_size: int
    shard_numel: int               # S: elements each rank stores
    numel: int                     # elements of real data
    params: tuple[str, ...]
    requires_grad: bool
    alias: bool = False
    persistent: bool = True
    grad_alias: bool = False
    keeps_grads: bool = True

    @property
    def sharded(self) -> bool:
        return self.layout != L.REPLICATED

    @property
    def gathered_numel(self) -> int:
        return self.shard_numel * self.group_size if self.sharded else self.shard_numel

    @property
    def reduced_numel(self) -> int:
        """Elements of the gradient each rank holds after the reduce-scatter (all of it if replicated)."""
        return self.shard_numel if self.sharded else self.gathered_numel

    @property
    def grad_numel(self) -> int:
        """Elements of the unsharded gradient (parameter layout for copy-out buffers)."""
        return self.numel if self.copy_out else self.gathered_numel

    @property
    def padding(self) -> int:
        return self.gathered_numel - self.numel

    @property
    def copy_out(self) -> bool:
        return self.layout == L.INTERLEAVED

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def compute_itemsize(self) -> int:
        return itemsize(self.compute_dtype)

    @property
    def reduce_itemsize(self) -> int:
        return itemsize(self.reduce_dtype)


def buffer_facts(layout: str, level: int, group_size: int, dtype: str, compute: str, reduce: str) -> dict[str, bool]:
    """The storage facts of a buffer (see :class:`BufferPlan`); the single place they are decided."""
    replicated = layout == L.REPLICATED
    alias = layout != L.INTERLEAVED and compute == dtype and (replicated or level <= 2)
    return dict(alias=alias, persistent=level <= 2 or alias,
                grad_alias=(replicated or (group_size == 1 and level <= 1)) and compute == dtype == reduce,
                keeps_grads=level <= 1)


@dataclass(frozen=True)
class UnitPlan:
    name: str
    buffers: tuple[int, ...]
    reshard_after_forward: bool
    modules: tuple[str, ...] = ()  # module paths it covers, when neighbours were merged (else just `name`)
    parent: str = ROOT             # the unit whose module encloses this one's (nested units)

    @property
    def module_paths(self) -> tuple[str, ...]:
        return self.modules or (("",) if self.name == ROOT else (self.name,))


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank. ``peak`` = the most the schedule holds at once (optimizer state included)."""

    params: int
    grads: int
    optimizer: int
    gathered_peak: int
    peak: int

    @property
    def persistent(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class Plan:
    """A compiled plan: who holds what, and the ops one training step runs. Frozen; build with
    :func:`shardplan.plan`, change with :meth:`with_prefetch`, :meth:`with_reshard_after_forward` and
    :meth:`with_schedule`, which return new plans."""

    mesh: Mesh
    strategy: str
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
    order: str = "static"
    notes: tuple[str, ...] = field(default=())  # choices the planner made and why (unit sizing)
    min_unit_bytes: int = 0                     # the merging threshold used (chosen or given)
    compute_axes: tuple[str, ...] = ()          # mesh axes that shard compute (tensor parallelism)
    tp_modules: tuple[tp.TPModule, ...] = ()    # modules run tensor-parallel, with their styles
    tp_activations: Optional[tuple[tp.Activation, ...]] = None  # traced activation sizes (None: not traced)
    layout: str = "auto"                        # "chunked": torch.chunk pieces everywhere (DTensor-describable)

    # -- lookups -----------------------------------------------------------------------------------
    @cached_property
    def _by_name(self) -> dict[str, ParamPlan]:
        out = {p.name: p for p in self.params}
        for p in self.params:
            for a in p.aliases:
                out[a] = p
        return out

    @cached_property
    def _index(self) -> dict[str, int]:
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

    def param(self, name: str) -> ParamPlan:
        try:
            return self._by_name[name]
        except KeyError:
            close = [p.name for p in self.params if name.split(".")[-1] in p.name][:5] or [p.name for p in self.params[:5]]
            raise PlanError(f"the plan has no parameter {name!r}; it has e.g. {close}") from None

    def unit(self, name: str) -> UnitPlan:
        try:
            return self._units_by_name[name]
        except KeyError:
            raise PlanError(f"the plan has no unit {name!r}; units: {[u.name for u in self.units]}") from None

    # -- per-rank geometry -----------------------------------------------------------------------------
    def segment(self, buffer: BufferPlan, rank: int) -> int:
        """Index of ``rank``'s segment in ``buffer``'s gathered layout (its rank in the shard group)."""
        return geometry.segment(self.mesh, buffer, rank)

    def local_slices(self, name: str, rank: int) -> Optional[tuple[slice, ...]]:
        """Global index box of parameter ``name`` that ``rank`` owns (``None`` if it owns nothing).

        >>> plan.local_slices("layers.0.w", rank=1)     # e.g. (slice(64, 128), slice(0, 256))

        Under ``optim``/``optim_grads`` this is the shard whose optimizer state the rank owns; under
        ``no_shard`` every rank owns the whole tensor.
        """
        return geometry.local_slices(self, name, rank)

    def local_shape(self, name: str, rank: int) -> tuple[int, ...]:
        return geometry.local_shape(self, name, rank)

    def storage_slices(self, name: str, rank: int) -> Optional[tuple[slice, ...]]:
        """The box of ``rank``'s shard inside the tensor-parallel-local tensor it computes with (equal
        to :meth:`local_slices` where no compute axis shards ``name``)."""
        return geometry.storage_slices(self, name, rank)

    def owner_axes(self, name: str) -> tuple[str, ...]:
        """Mesh axes along which ranks hold different pieces of ``name`` (storage and compute), mesh order."""
        p = self.param(name)
        b = self.buffers[p.buffer]
        axes = set(b.axes if b.sharded else ()) | ({p.tp_axis} if p.tp_axis else set())
        return tuple(a for a in self.mesh.axis_names if a in axes)

    def replicas(self, name: str) -> int:
        """How many ranks hold each element of ``name`` (copies over the axes that do not shard it)."""
        return self.mesh.size // self.mesh.axis_size(self.owner_axes(name))

    # -- data parallelism -------------------------------------------------------------------------------
    @property
    def data_axes(self) -> tuple[str, ...]:
        """The mesh axes that split the batch: every axis but the compute axes."""
        return tuple(a for a in self.mesh.axis_names if a not in self.compute_axes)

    @property
    def data_size(self) -> int:
        """Into how many slices the global batch is split (ranks of one tensor-parallel group share one)."""
        return self.mesh.axis_size(self.data_axes) if self.data_axes else 1

    def data_index(self, rank: int) -> int:
        """Which slice of the global batch ``rank`` computes.

        >>> x_local = x.chunk(plan.data_size)[plan.data_index(rank)]
        """
        return self.mesh.axis_index(rank, self.data_axes)

    def tp_module(self, path: str) -> Optional[tp.TPModule]:
        return next((m for m in self.tp_modules if m.path == path), None)

    def local_offset(self, name: str, rank: int) -> int:
        """Offset of ``rank``'s piece of ``name`` inside its own shard of the buffer (elements)."""
        return geometry.local_offset(self, name, rank)

    # -- the schedule as a program -----------------------------------------------------------------------
    @cached_property
    def program(self) -> Program:
        """The schedule arranged per event, as the runtime executes it (see :mod:`shardplan.plan.schedule`)."""
        return S.program(self.units, self.schedule)

    def ops(self, *, stale: bool = True, grad: bool = True, sync: bool = True) -> tuple[Op, ...]:
        """The ops a step with these facts runs, in order: ``stale`` (the shards changed since the last
        gather), ``grad`` (a backward follows the forward), ``sync`` (gradients are reduced).

        >>> plan.ops()                       # a training step
        >>> plan.ops(grad=False)             # an eval / no_grad forward
        """
        return S.select(self.schedule, stale=stale, grad=grad, sync=sync)

    # -- transformations ---------------------------------------------------------------------------------
    def with_prefetch(self, prefetch: int) -> "Plan":
        """The same plan gathering ``prefetch`` units ahead (forward and backward).

        >>> plan.with_prefetch(2).prefetch
        2
        """
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise PlanError(f"prefetch must be a non-negative integer (units gathered ahead); got {prefetch!r}")
        return self._rebuilt(prefetch=prefetch)

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
        raf = all(u.reshard_after_forward for u in units[1:-1]) if len(units) > 2 else self.reshard_after_forward
        return self._rebuilt(units=units, reshard_after_forward=raf)

    def with_order(self, order: str) -> "Plan":
        """The same plan for units that run in plan order (``"static"``) or in any order (``"dynamic"``)."""
        if order not in S.ORDERS:
            raise PlanError(f"order must be one of {S.ORDERS}; got {order!r}")
        return self._rebuilt(order=order)

    def with_schedule(self, ops: Sequence[Op]) -> "Plan":
        """The same plan running ``ops`` instead of its schedule, after checking them.

        >>> ops = [o for o in plan.schedule if not (o.kind == "free" and o.event == "post_forward")]
        >>> plan.with_schedule(ops)          # keeps every unit gathered from forward to backward

        Raises :class:`PlanError` naming the op for a schedule that reads a buffer before its gather,
        frees one still in use, leaves a gradient unreduced, or names unknown buffers or triggers.
        """
        from .validate import validate
        ops = tuple(ops)
        candidate = dataclasses.replace(self, schedule=ops)
        validate(candidate)
        return candidate

    def _rebuilt(self, **changes) -> "Plan":
        from .validate import validate
        base = dataclasses.replace(self, **changes)
        sched = S.build_schedule(base.units, base.buffers, base.mesh, base.level, base.prefetch, base.order,
                                 len(base.params))
        out = dataclasses.replace(base, schedule=sched)
        validate(out)
        return out

    # -- accounting ----------------------------------------------------------------------------------
    def memory(self, rank: int = 0) -> Memory:
        """Planned bytes on ``rank``: params, grads and optimizer state, and the peak over the schedule."""
        return Memory(**accounting.memory(self, rank))

    def comm_bytes(self, rank: int = 0) -> dict[str, Optional[int]]:
        """Bytes each rank sends per training step, by op kind (ring algorithms: (n-1)/n of the payload).
        With compute axes, ``tensor_parallel`` adds the activations the styles move: estimated when the plan
        was traced with example inputs (``trace=``), ``None`` ("not estimated") otherwise."""
        return accounting.comm_bytes(self)

    def max_gathered_units(self) -> int:
        """Most units whose parameters are gathered (or being gathered) at once in a training step."""
        return accounting.max_gathered_units(self)

    @property
    def padding(self) -> int:
        """Padded elements summed over buffers (per rank group)."""
        return sum(b.padding for b in self.buffers)

    def to_chrome_trace(self, path: str, *, gbps: float = 100.0) -> None:
        """Write the planned schedule as a Chrome/Perfetto trace (open in ui.perfetto.dev); a picture of the
        plan's order and sizes at ``gbps`` GB/s, not a measurement."""
        render.chrome_trace(self, path, gbps)

    # -- serialisation -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return serialize.to_dict(self)

    def to_json(self, indent: Optional[int] = None) -> str:
        return serialize.to_json(self, indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return serialize.from_json(text, cls=cls, param=ParamPlan, buffer=BufferPlan, unit=UnitPlan)

    def fingerprint(self) -> str:
        """A short hash of the plan's JSON: equal on every process that built the same plan."""
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def equivalent(self, other: "Plan") -> bool:
        """Whether ``other`` shards and schedules exactly like this plan (only the rules' wording, the
        planner's notes and the warnings may differ): the test for a plan rebuilt from :meth:`declarative`."""
        def core(p):
            d = p.to_dict()
            for q in d["params"]:
                q.pop("rule")
            d.pop("notes"), d.pop("warnings")
            return d
        return core(self) == core(other)

    def declarative(self) -> dict[str, Any]:
        """Keyword arguments of :func:`shardplan.plan` that rebuild this plan from its module: rules (one
        per parameter name, block indices generalised), units (exact module paths), options.

        >>> sp.plan(model, **plan.declarative()).equivalent(plan)      # True (a traced order needs trace=)
        """
        from ..auto import rules_from_specs
        specs = [(p.name, p.spec if self.level else self.param(p.name).spec) for p in self.params]
        paths = [m for u in self.units[1:] for m in u.module_paths]
        rafs = {u.reshard_after_forward for u in self.units[1:-1]}
        tp_opts = dict(compute_axes=self.compute_axes,
                       styles=[(re.escape(m.path), m.style) for m in self.tp_modules]) if self.compute_axes else {}
        return dict(rules=rules_from_specs(specs), mesh=self.mesh, strategy=self.strategy, **tp_opts,
                    units=[re.escape(m) for m in paths], compute_dtype=self.compute_dtype,
                    reduce_dtype=self.reduce_dtype, prefetch=self.prefetch,
                    reshard_after_forward=rafs.pop() if len(rafs) == 1 else self.reshard_after_forward,
                    optimizer_states=self.optimizer_states, min_unit_bytes=self.min_unit_bytes, order=self.order,
                    **({"layout": self.layout} if self.layout != "auto" else {}))

    def to_source(self) -> str:
        """A Python file that rebuilds this plan for ``model``: the rules, the units and the options."""
        d = self.declarative()
        head = d.pop("rules").to_source().replace("from shardplan import P, Rules", "import shardplan as sp\nfrom shardplan import P, Rules")
        mesh = d.pop("mesh")
        opts = ", ".join(f"{k}={v!r}" for k, v in d.items())
        return head + f"\nplan = sp.plan(model, rules, sp.{mesh!r}, {opts})\n"

    def summary(self) -> dict[str, Any]:
        """The plan's options and sizes, for telling two plans apart (ranks that disagree, say)."""
        return serialize.summary(self)

    def __str__(self) -> str:
        return render.render(self)

    def __repr__(self) -> str:
        return (f"Plan({self.mesh!r}, strategy={self.strategy!r}, params={len(self.params)}, units={len(self.units)}, "
                f"buffers={len(self.buffers)}, ops={len(self.schedule)}, fingerprint={self.fingerprint()!r})")
