"""The :class:`Plan`: the compiled plan's fields, and the methods that read them through the function
modules (geometry, schedule, accounting, render, serialize, validate). Everything below this module is a
plain value or a pure function; this is the one place they meet.

>>> plan = shardplan.plan(model, rules, Mesh(dp=8), units=[r"layers\\.\\d+"], compute_dtype=torch.bfloat16)
>>> print(plan); plan.memory(); plan.local_slices("layers.0.attention.wq.weight", rank=3)
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

from ..auto import rules_from_specs
from ..errors import PlanError
from ..mesh import Mesh
from ..rules import regex_list_source
from ..units import ROOT
from . import accounting, capture, geometry, render, serialize
from . import schedule as S
from . import axes as AX
from . import context_parallel as CPX
from . import expert_parallel as EP
from . import float8 as F8
from . import tensor_parallel as tp
from .policies import Layout as LayoutPolicy, Offload as OffloadPolicy, Policies, Precision, Schedule
from .offload import HOST_GBPS, balanced_fraction, host_step_bytes, offloaded
from .kinds import LayoutChoice, Offload, Order, Strategy, choose, strategy_level
from .validate import normalised, validate
from .values import Activations, BufferPlan, Memory, Op, ParamPlan, Piece, Program, UnitPlan

if TYPE_CHECKING:  # annotations only
    from ..forecast import ComputeModel, Forecast, Network

# [Note: the forecast sits above the planner: it reads plans, and nothing in planner/ imports it. ``Plan.forecast``
# calls the function :mod:`shardplan.forecast` registers here (:func:`register_forecast`) when it is imported;
# ``import shardplan`` imports it (torch-free), so the method always works]
_FORECAST: Optional[Callable[..., "Forecast"]] = None


def register_forecast(forecast: Callable[..., "Forecast"]) -> None:
    """Make ``plan.forecast(...)`` call ``forecast(plan, ...)`` (:func:`shardplan.forecast.forecast`)."""
    global _FORECAST
    _FORECAST = forecast


PIECE_CACHE_RANKS = 64  # ranks whose pieces a plan keeps (a 70B plan at dp=1024 holds ~700 pieces per rank)


@dataclass(frozen=True)
class Plan:
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

    # -- the compute axes (``axes``: one frozen value per axis, planner/axes.py), and their old names ----------
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

    def axis(self, kind: str) -> Any:
        """The value of compute axis ``kind`` (``"tp"``, ``"ep"``, ``"cp"``, ...) in this plan, or ``None``.

        >>> plan.axis("tp").modules == plan.tp_modules
        True
        """
        return AX.value(self.axes, kind)

    @property
    def compute_axes(self) -> tuple[str, ...]:
        """Mesh axes that shard compute (tensor parallelism)."""
        v = self.axis("tp")
        return v.axes if v is not None else ()

    @property
    def tp_modules(self) -> tuple[tp.TPModule, ...]:
        """Modules run tensor-parallel, with their styles."""
        v = self.axis("tp")
        return v.modules if v is not None else ()

    @property
    def tp_activations(self) -> Optional[tuple[tp.Activation, ...]]:
        """Traced activation sizes of the tensor-parallel modules (``None``: not traced)."""
        v = self.axis("tp")
        return v.activations if v is not None else None

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """Mesh axes that split stacked experts (expert parallelism)."""
        v = self.axis("ep")
        return v.axes if v is not None else ()

    @property
    def expert_modules(self) -> tuple[EP.ExpertModule, ...]:
        """Modules whose experts the expert axes split."""
        v = self.axis("ep")
        return v.modules if v is not None else ()

    @property
    def expert_calls(self) -> Optional[tuple[EP.ExpertCall, ...]]:
        """Traced token inputs of the expert modules (``None``: not traced)."""
        v = self.axis("ep")
        return v.calls if v is not None else None

    @property
    def context_calls(self) -> Optional[tuple[CPX.AttentionCall, ...]]:
        """Traced attention calls (``None``: not traced, or no ``cp`` axis)."""
        v = self.axis("cp")
        return v.calls if v is not None else None

    # -- lookups -----------------------------------------------------------------------------------
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

    # -- per-rank geometry: pieces -------------------------------------------------------------------
    @cached_property
    def full_offsets(self) -> tuple[int, ...]:
        """Per parameter (``plan.params`` order) where it starts in its buffer's full parameters (parameter
        layout: packed back to back for copy-out buffers, in place otherwise)."""
        return geometry.full_offsets(self.params, self.buffers)

    @cached_property
    def _piece_cache(self) -> dict[int, tuple[Piece, ...]]:
        return {}

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """Every parameter's piece on ``rank``, in ``plan.params`` order; computed on first use and cached
        (for the last :data:`PIECE_CACHE_RANKS` ranks asked).

        >>> [p.box for p in plan.pieces(rank=1)]
        """
        rank = self._check_rank(rank)
        cache = self._piece_cache
        out = cache.get(rank)
        if out is None:
            out = cache[rank] = geometry.pieces(self.mesh, self.params, self.buffers, self.full_offsets, rank)
            if len(cache) > PIECE_CACHE_RANKS:  # [Note: dicts keep insertion order: the oldest rank goes first]
                cache.pop(next(iter(cache)), None)
        return out

    def piece(self, name: str, rank: int) -> Piece:
        """``rank``'s piece of parameter ``name``: its global box, its box in the tensor-parallel-local tensor,
        its offset in the rank's shard and in the gathered parameters, its shape.

        >>> plan.piece("layers.0.w", rank=1).box      # e.g. (slice(64, 128), slice(0, 256))
        """
        i = self.index(name)
        rank = self._check_rank(rank)
        cached = self._piece_cache.get(rank)
        if cached is not None:
            return cached[i]
        # [Note: one piece is O(dims); computing the rank's whole tuple for it would make per-name loops
        # over many ranks (checkpoints, copy plans) cost O(params x ranks) in memory]
        p = self.params[i]
        return geometry.piece(self.mesh, p, index=i, b=self.buffers[p.buffer], rank=rank, full_offset=self.full_offsets[i])

    def buffer_pieces(self, buffer: int, rank: int) -> tuple[Piece, ...]:
        """``rank``'s pieces of the parameters of ``plan.buffers[buffer]``, in the buffer's order (``bp.params``)."""
        return tuple(self.piece(n, rank) for n in self.buffers[buffer].params)

    def _check_rank(self, rank: int) -> int:
        try:
            r = operator.index(rank)
        except TypeError:
            r = -1
        if not 0 <= r < self.mesh.size:
            raise PlanError(f"rank {rank!r} is not a rank of {self.mesh!r} (0..{self.mesh.size - 1})")
        return r

    def segment(self, buffer: BufferPlan, rank: int) -> int:
        """Index of ``rank``'s segment in ``buffer``'s gathered layout (its rank in the shard group)."""
        return geometry.segment(self.mesh, buffer, rank)

    def local_slices(self, name: str, rank: int) -> Optional[tuple[slice, ...]]:
        """Global index box of parameter ``name`` that ``rank`` owns (``None`` if it owns nothing).

        >>> plan.local_slices("layers.0.w", rank=1)     # e.g. (slice(64, 128), slice(0, 256))

        Under ``optim``/``optim_grads`` this is the shard whose optimizer state the rank owns; under
        ``no_shard`` every rank owns the whole tensor.
        """
        return self.piece(name, rank).box

    def local_shape(self, name: str, rank: int) -> tuple[int, ...]:
        return self.piece(name, rank).shape

    def storage_slices(self, name: str, rank: int) -> Optional[tuple[slice, ...]]:
        """The box of ``rank``'s shard inside the tensor-parallel-local tensor it computes with (equal
        to :meth:`local_slices` where no compute axis shards ``name``)."""
        return self.piece(name, rank).storage_box

    def local_offset(self, name: str, rank: int) -> int:
        """Offset of ``rank``'s piece of ``name`` inside its own shard of the buffer (elements)."""
        return self.piece(name, rank).shard_offset

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
        """The mesh axes that split the batch: every axis but the compute axes and the context axis ``cp``
        (its ranks share their samples and split each sequence: ``shardplan.context_parallel.shard_batch``)."""
        return tuple(a for a in self.mesh.axis_names if a not in self.compute_axes and a != "cp")

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

    def expert_module(self, path: str) -> Optional[EP.ExpertModule]:
        """The expert module at ``path`` (its experts split over ``plan.expert_axes``), or ``None``.

        >>> plan.expert_module("layers.0.moe.experts").local_experts   # experts one ep rank holds
        """
        return next((m for m in self.expert_modules if m.path == path), None)

    # -- the schedule as a program -----------------------------------------------------------------------
    @cached_property
    def program(self) -> Program:
        """The schedule arranged per event, as the runtime executes it (see :mod:`shardplan.planner.schedule`)."""
        return S.program(self.units, self.schedule)

    def ops(self, *, stale: bool = True, grad: bool = True, sync: bool = True,
            recompute: Union[bool, str] = False) -> tuple[Op, ...]:
        """The ops a step with these facts runs, in order: ``stale`` (the shards changed since the last
        gather), ``grad`` (a backward follows the forward), ``sync`` (gradients are reduced), ``recompute``
        (each unit's forward is recomputed in backward: activation checkpointing per unit, which repeats
        the forward's tensor-parallel collectives). ``recompute=True`` is torch's checkpoint as it runs by
        default (non-reentrant, early stop: a recompute ends once backward has every tensor it saves, before
        a block's last row-parallel all-reduce); ``recompute="whole"`` is a whole recompute
        (``set_checkpoint_early_stop(False)``, or ``use_reentrant=True``). Which collectives early stop
        leaves out a traced plan knows (its checkpointed meta step); untraced, each unit's last forward
        collective is assumed left out (a pre-norm block: its last output only feeds the residual).

        >>> plan.ops()                       # a training step
        >>> plan.ops(grad=False)             # an eval / no_grad forward
        """
        return S.select(self.schedule, stale=stale, grad=grad, sync=sync, recompute=recompute)

    # -- transformations ---------------------------------------------------------------------------------
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

    @cached_property
    def capture_blockers(self) -> tuple:
        """What keeps this plan's training step from being captured and replayed (``shardplan.capture``), each a
        :class:`~shardplan.planner.capture.Blocker` (``code``, ``reason``, ``fix``); empty when it can be.

        >>> [b.code for b in plan.with_order("dynamic").capture_blockers]
        ['dynamic_order']
        """
        return capture.blockers(self)

    @property
    def capturable(self) -> bool:
        """Whether ``shardplan.capture`` can replay this plan's step (no :attr:`capture_blockers`)."""
        return not self.capture_blockers

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

    # -- accounting ----------------------------------------------------------------------------------
    def memory(self, rank: int = 0, *, recompute: bool = False) -> Memory:
        """Planned bytes on ``rank``: params, grads and optimizer state, and the peak over the schedule.
        A plan traced with example inputs (``trace=``) adds the traced step's activations to the peak
        (``memory.activations``: their share of it); ``recompute=True``: with every unit checkpointed.
        ``host``/``host_peak``: host memory of CPU offload (0 without it).

        >>> m = plan.memory(0); m.peak, m.states_peak, m.activations   # activations None: not traced
        """
        return Memory(**accounting.memory(self, rank, recompute))

    def host_step_s(self, gbps: float = HOST_GBPS) -> float:
        """Estimated seconds of the host optimizer step per training step at ``gbps`` GB/s of host memory
        bandwidth (``benchmarks/host_adamw.py`` measures a host's): the bytes it moves (28 per fp32 element
        for AdamW) over the bandwidth ([Note: the host step's bound], planner/offload.py); 0 without offload.
        A step takes at least ``max(device step, host step)``.

        >>> plan.host_step_s(gbps=91)   # the 1B fully offloaded on a 16-core H200 host: ~0.3 s
        """
        return host_step_bytes(self.buffers, self.optimizer_states) / (gbps * 1e9)

    def balanced_offload_fraction(self, host_s: float, window_s: float, at_least: float = 0.0) -> float:
        """The ``offload_fraction`` whose host step just fits ``window_s`` (the backward it overlaps), given
        this offloading plan's measured host step ``host_s`` per training step (``opt.host_stats()["kernel_s"]``
        per step); not below ``at_least`` (the smallest fraction that fits the device, from
        ``offload_fraction="auto"``). Re-plan with the number returned (docs/offload.md).

        >>> f = plan.balanced_offload_fraction(host_s=0.28, window_s=0.09)   # ~0.32 of the state on the host
        """
        if not self.offload:
            raise PlanError("balanced_offload_fraction: this plan offloads nothing; call it on the plan the host step "
                            "was measured with (plan(..., offload='optimizer'))")
        return balanced_fraction(self.buffers, self.units, host_s, window_s, at_least)

    def comm_bytes(self, rank: int = 0) -> dict[str, Optional[int]]:
        """Bytes each rank sends per training step, by op kind (ring algorithms: (n-1)/n of the payload).
        With compute axes, ``tensor_parallel`` adds the activations the styles move: estimated when the plan
        was traced with example inputs (``trace=``), ``None`` ("not estimated") otherwise. With CPU offload,
        ``copy_d2h`` / ``copy_h2d`` are the host<->device copy bytes per step (not in ``total``, the network's).
        With expert modules split over an expert axis, ``expert_parallel`` adds the token all-to-alls
        (estimated from a traced plan's expert inputs under balanced routing; ``None`` untraced)."""
        return accounting.comm_bytes(self)

    def max_gathered_units(self) -> int:
        """Most units whose parameters are gathered (or being gathered) at once in a training step."""
        return accounting.max_gathered_units(self)

    @property
    def padding(self) -> int:
        """Padded elements summed over buffers (per rank group)."""
        return sum(b.padding for b in self.buffers)

    def forecast(self, network: Union[str, dict, "Network"], compute: Union[None, str, float, dict, "ComputeModel"] = None,
                 *, batch: tuple[int, int], rank: int = 0, scalar_all_reduces: int = 0) -> "Forecast":
        """Predicted step time of ``rank`` on ``network`` (a preset name, a dict, a JSON file or a
        :class:`shardplan.forecast.Network`) with per-rank ``batch = (B, T)``: compute (FLOPs at an achievable
        rate, or measured unit times: ``compute=``), each collective from an α–β model of the link its group
        crosses, and the overlap this schedule allows. Returns a frozen :class:`shardplan.forecast.Forecast`.
        ``scalar_all_reduces``: blocking one-number all-reduces per step (``sp.clip_grad_norm_`` issues one).
        The same as ``shardplan.forecast.forecast(plan, ...)``.

        >>> f = plan.forecast(network="h100-8x-ib400", batch=(1, 4096))
        >>> print(f); f.step_s, f.exposed_s, f.tokens_per_s, f.mfu; f.to_chrome_trace("forecast.json")
        """
        if _FORECAST is None:  # (`import shardplan` registers it: only a broken install gets here)
            raise PlanError("plan.forecast: shardplan.forecast is not imported; call "
                            "shardplan.forecast.forecast(plan, network, ...) instead")
        return _FORECAST(self, network, compute, batch=batch, rank=rank, scalar_all_reduces=scalar_all_reduces)

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
        return cls(**serialize.plan_fields(text))

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

    @property
    def policies(self) -> Policies:
        """The plan's options grouped by feature: the :class:`~shardplan.planner.policies.Precision`,
        :class:`~shardplan.planner.policies.Offload` (``None``: no offload), :class:`~shardplan.planner.policies.Schedule`
        and :class:`~shardplan.planner.policies.Layout` that rebuild it, with the numbers the planner chose
        (``offload_fraction="auto"``'s fraction, ``min_unit_bytes``); read from the plan, so a plan loaded from JSON
        has them too. The flat attributes (``plan.compute_dtype``, ``plan.offload_fraction``, ...) read the same.

        >>> plan.policies.precision.compute_dtype, plan.policies.schedule.prefetch
        ('bfloat16', 1)
        >>> sp.plan(model, rules, mesh, units=units, **plan.policies.keywords())      # the same plan
        """
        gathers = [(re.escape(p.name), self.buffers[p.buffer].gather_dtype) for p in self.params
                   if self.buffers[p.buffer].gather_dtype and not self.buffers[p.buffer].tensorwise]
        # (the float8 Linears' tensorwise gathers follow from fp8= and fp8_gather=)
        fp8 = [(re.escape(m.path), F8.TORCHAO) for m in self.fp8_modules]
        precision = Precision(compute_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype,
                              gather_dtype=tuple(gathers) or None, fp8=tuple(fp8) or None,
                              fp8_gather=any(b.tensorwise for b in self.buffers) if fp8 else True)
        rafs = {u.reshard_after_forward for u in self.units[1:]}
        raf = rafs.pop() if len(rafs) == 1 else self.reshard_after_forward if not rafs \
            else {u.name: False for u in self.units[1:] if not u.reshard_after_forward}
        return Policies(precision=precision,
                        offload=OffloadPolicy(self.offload, self.offload_fraction) if self.offload else None,
                        schedule=Schedule(prefetch=self.prefetch, order=self.order, reshard_after_forward=raf),
                        layout=LayoutPolicy(self.layout, self.min_unit_bytes))

    def declarative(self) -> dict[str, Any]:
        """Keyword arguments of :func:`shardplan.plan` that rebuild this plan from its module: rules (one
        per parameter name, block indices generalised), units (exact module paths), options (the flat keywords
        of :attr:`policies`).

        >>> sp.plan(model, **plan.declarative()).equivalent(plan)      # True (a traced order needs trace=)
        """
        specs = [(p.name, p.spec if self.level else self.param(p.name).spec) for p in self.params]
        paths = [m for u in self.units[1:] for m in u.module_paths]
        tp_opts = dict(compute_axes=self.compute_axes,
                       styles=[(re.escape(m.path), m.style) for m in self.tp_modules]) if self.compute_axes else {}
        pol = self.policies
        pr, off = pol.precision, pol.offload
        return dict(rules=rules_from_specs(specs), mesh=self.mesh, strategy=self.strategy, **tp_opts,
                    units=[re.escape(m) for m in paths], compute_dtype=self.compute_dtype,
                    reduce_dtype=self.reduce_dtype, prefetch=self.prefetch,
                    reshard_after_forward=pol.schedule.reshard_after_forward,
                    optimizer_states=self.optimizer_states, min_unit_bytes=self.min_unit_bytes, order=self.order,
                    **({"layout": self.layout} if self.layout != LayoutChoice.AUTO else {}),
                    **({"offload": self.offload} if off else {}),
                    **({"offload_fraction": off.fraction} if off and off.fraction != 1 else {}),
                    **({"gather_dtype": list(pr.gather_dtype)} if pr.gather_dtype else {}),
                    **({"fp8": list(pr.fp8), "fp8_gather": pr.fp8_gather} if pr.fp8 else {}))

    def to_source(self) -> str:
        """A rules file that rebuilds this plan: ``rules``, ``UNITS`` (the exact modules of its units),
        ``MESH``, ``OPTIONS`` (and ``compute_axes``, ``styles`` with tensor parallelism), which
        ``shardplan plan TARGET --rules FILE`` reads, and ``make_plan(model)`` for Python."""
        d = self.declarative()
        rules, mesh, units = d.pop("rules"), d.pop("mesh"), d.pop("units")
        tp_opts = {k: d.pop(k) for k in ("compute_axes", "styles") if k in d}
        out = [f"# shardplan {self.strategy} on {mesh!r}, plan fingerprint {self.fingerprint()}: rebuild it with",
               "#   shardplan plan TARGET --rules THIS_FILE      (flags given there override the values below)",
               "#   plan = make_plan(model)                       (in Python)",
               "", "import shardplan as sp", rules.to_source().rstrip("\n"), ""]
        out.append("UNITS = " + _wrapped([regex_list_source([u])[1:-1] for u in units]))
        out.append(f"MESH = sp.{mesh!r}")
        if tp_opts:
            out.append(f"compute_axes = {tp_opts['compute_axes']!r}")
            out.append("styles = " + _wrapped([f"({regex_list_source([pat])[1:-1]}, {style!r})"
                                               for pat, style in tp_opts["styles"]]))
        out.append("OPTIONS = " + _wrapped([f"{k}={v!r}" for k, v in d.items()], "dict(", ")"))
        out += ["", "",
                "def make_plan(model):",
                "    return sp.plan(model, rules, MESH, units=UNITS, **OPTIONS"
                + (", compute_axes=compute_axes, styles=styles)" if tp_opts else ")"), ""]
        return "\n".join(out)

    def summary(self) -> dict[str, Any]:
        """The plan's options and sizes, for telling two plans apart (ranks that disagree, say)."""
        return serialize.summary(self)

    def __str__(self) -> str:
        return render.render(self)

    def __repr__(self) -> str:
        return (f"Plan({self.mesh!r}, strategy={self.strategy!r}, params={len(self.params)}, units={len(self.units)}, "
                f"buffers={len(self.buffers)}, ops={len(self.schedule)}, fingerprint={self.fingerprint()!r})")


def _wrapped(items: Sequence[str], open_: str = "[", close: str = "]", width: int = 88) -> str:
    """``[a, b, ...]`` as source: one line when it fits, else several items per indented line."""
    one = open_ + ", ".join(items) + close
    if len(one) <= width:
        return one
    lines, line = [], ""
    for item in items:
        if line and len(line) + len(item) + 2 > width - 4:
            lines.append(line)
            line = ""
        line += (" " if line else "") + item + ","
    lines.append(line)
    return open_ + "\n" + "\n".join("    " + l for l in lines) + "\n" + close
