"""The :class:`Plan`: a frozen dataclass, the compiled plan's fields, and the methods a user calls on it (print
it, ``memory``, ``comm_bytes``, ``ops``, the ``with_*`` transforms, JSON, the per-rank pieces the docs show).
Everything else is a function in the module that owns the job, over a plan: ``geometry`` (``owner_axes``,
``replicas``, ``segment``, ``check_rank``), ``accounting`` (``max_gathered_units``), ``transforms``
(``schedule_edited``, ``with_offload_fraction``), ``serialize`` (``to_dict``, ``summary``), ``rebuild``,
``render``, ``capture`` and the compute axes' own modules (``tensor_parallel.of(plan)``, ...).

>>> plan = shardplan.plan(model, rules, Mesh(dp=8), units=[r"layers\\.\\d+"], compute_dtype=torch.bfloat16)
>>> print(plan); plan.memory(); plan.local_slices("layers.0.attention.wq.weight", rank=3)
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from ..errors import PlanError
from ..mesh import Mesh
from . import accounting, axes as AX, capture, geometry, rebuild, render, serialize, transforms
from . import float8 as F8
from . import schedule as S
from .kinds import LayoutChoice, Offload, Order, Strategy, choose
from .offload import HOST_GBPS, balanced_fraction, host_step_bytes
from .validate import normalised, validate
from .ops import Op, Program
from .values import Activations, BufferPlan, Memory, ParamPlan, Piece, UnitPlan

PIECE_CACHE_RANKS = 64  # ranks whose pieces a plan keeps (a 70B plan at dp=1024 holds ~700 pieces per rank)

# [Note: the forecast sits above the planner: it reads plans, and nothing in planner/ imports it. ``Plan.forecast``
# calls the function :mod:`shardplan.forecast` registers here (:func:`register_forecast`) when it is imported;
# ``import shardplan`` imports it (torch-free), so the method always works]
_FORECAST: Optional[Callable[..., Any]] = None


def register_forecast(forecast: Callable[..., Any]) -> None:
    """Make ``plan.forecast(...)`` call ``forecast(plan, ...)`` (:func:`shardplan.forecast.forecast`)."""
    global _FORECAST
    _FORECAST = forecast


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

    # -- how it prints (methods of the class itself: the dataclass would write its own __repr__) ---------------
    def __str__(self) -> str:
        return render.render(self)

    def __repr__(self) -> str:
        return (f"Plan({self.mesh!r}, strategy={self.strategy!r}, params={len(self.params)}, units={len(self.units)}, "
                f"buffers={len(self.buffers)}, ops={len(self.schedule)}, fingerprint={self.fingerprint()!r})")

    # -- names to places -------------------------------------------------------------------------------
    @cached_property
    def _positions(self) -> dict[str, int]:
        out = {p.name: i for i, p in enumerate(self.params)}
        out.update({a: i for i, p in enumerate(self.params) for a in p.aliases})
        return out

    def __contains__(self, name: object) -> bool:
        """``name in plan``: ``name`` (or a tied alias of it) is a parameter of the plan."""
        return isinstance(name, str) and name in self._positions

    def _index(self, name: str) -> int:
        try:
            return self._positions[name]
        except KeyError:
            close = [p.name for p in self.params if name.split(".")[-1] in p.name][:5] or \
                [p.name for p in self.params[:5]]
            raise PlanError(f"the plan has no parameter {name!r}; it has e.g. {close}") from None

    def param(self, name: str) -> ParamPlan:
        """Parameter ``name`` (or a tied alias of it); a :class:`PlanError` naming some the plan has otherwise."""
        return self.params[self._index(name)]

    @cached_property
    def _units_by_name(self) -> dict[str, UnitPlan]:
        return {u.name: u for u in self.units}

    def unit(self, name: str) -> UnitPlan:
        """Unit ``name``; a :class:`PlanError` naming the plan's units otherwise."""
        try:
            return self._units_by_name[name]
        except KeyError:
            raise PlanError(f"the plan has no unit {name!r}; units: {[u.name for u in self.units]}") from None

    def axis(self, kind: str) -> Any:
        """The value of compute axis ``kind`` (``"tp"``, ``"ep"``, ``"cp"``, ...) in this plan, or ``None``.

        >>> plan.axis("tp").module("layers.0.attention.wq").style
        'colwise'
        """
        return AX.value(self.axes, kind)

    # -- the batch ---------------------------------------------------------------------------------------
    @property
    def data_axes(self) -> tuple[str, ...]:
        """The mesh axes that split the batch: every axis but the tensor-parallel ones and the context axis ``cp``
        (its ranks share their samples and split each sequence: ``shardplan.context_parallel.shard_batch``)."""
        tp = self.axis("tp")
        return tuple(a for a in self.mesh.axis_names if a not in (tp.axes if tp else ()) and a != "cp")

    @property
    def data_size(self) -> int:
        """Into how many slices the global batch is split (ranks of one tensor-parallel group share one)."""
        return self.mesh.axis_size(self.data_axes) if self.data_axes else 1

    def data_index(self, rank: int) -> int:
        """Which slice of the global batch ``rank`` computes.

        >>> x_local = x.chunk(plan.data_size)[plan.data_index(rank)]
        """
        return self.mesh.axis_index(rank, self.data_axes)

    # -- per-rank pieces ---------------------------------------------------------------------------------
    @cached_property
    def _full_offsets(self) -> tuple[int, ...]:
        return geometry.full_offsets(self.params, self.buffers)

    @cached_property
    def _piece_cache(self) -> dict[int, tuple[Piece, ...]]:
        return {}

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """Every parameter's piece on ``rank``, in ``plan.params`` order; computed on first use and cached (for
        the last :data:`PIECE_CACHE_RANKS` ranks asked).

        >>> [p.box for p in plan.pieces(rank=1)]
        """
        rank = geometry.check_rank(self.mesh, rank)
        cache = self._piece_cache
        out = cache.get(rank)
        if out is None:
            out = cache[rank] = geometry.pieces(self.mesh, self.params, self.buffers, self._full_offsets, rank)
            if len(cache) > PIECE_CACHE_RANKS:  # [Note: dicts keep insertion order: the oldest rank goes first]
                cache.pop(next(iter(cache)), None)
        return out

    def piece(self, name: str, rank: int) -> Piece:
        """``rank``'s piece of parameter ``name``: its global box, its box in the tensor-parallel-local tensor
        (``storage_box``), its offset in the rank's shard (``shard_offset``) and in the gathered parameters, its
        shape.

        >>> plan.piece("layers.0.w", rank=1).box      # e.g. (slice(64, 128), slice(0, 256))
        """
        i = self._index(name)
        rank = geometry.check_rank(self.mesh, rank)
        cached = self._piece_cache.get(rank)
        if cached is not None:
            return cached[i]
        # [Note: one piece is O(dims); computing the rank's whole tuple for it would make per-name loops
        # over many ranks (checkpoints, copy plans) cost O(params x ranks) in memory]
        p = self.params[i]
        return geometry.piece(self.mesh, p, index=i, b=self.buffers[p.buffer], rank=rank,
                              full_offset=self._full_offsets[i])

    def buffer_pieces(self, buffer: int, rank: int) -> tuple[Piece, ...]:
        """``rank``'s pieces of the parameters of ``plan.buffers[buffer]``, in the buffer's order (``bp.params``)."""
        return tuple(self.piece(n, rank) for n in self.buffers[buffer].params)

    def local_slices(self, name: str, rank: int) -> Optional[tuple[slice, ...]]:
        """Global index box of parameter ``name`` that ``rank`` owns (``None`` if it owns nothing).

        >>> plan.local_slices("layers.0.w", rank=1)     # e.g. (slice(64, 128), slice(0, 256))

        Under ``optim``/``optim_grads`` this is the shard whose optimizer state the rank owns; under
        ``no_shard`` every rank owns the whole tensor.
        """
        return self.piece(name, rank).box

    def local_shape(self, name: str, rank: int) -> tuple[int, ...]:
        """The shape of ``rank``'s piece of ``name``."""
        return self.piece(name, rank).shape

    # -- the schedule as it runs -------------------------------------------------------------------------
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

    # -- new plans ---------------------------------------------------------------------------------------
    def with_prefetch(self, prefetch: int) -> "Plan":
        """The same plan gathering ``prefetch`` units ahead (forward and backward).

        >>> plan.with_prefetch(2).prefetch
        2
        """
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise PlanError(f"prefetch must be a non-negative integer (units gathered ahead); got {prefetch!r}")
        return transforms.rebuilt(self, "with_prefetch", prefetch=prefetch)

    def with_reshard_after_forward(self, which: Union[bool, Mapping[str, bool]]) -> "Plan":
        """The same plan with units kept gathered from forward to backward (``False``) or freed after
        their forward (``True``): one bool for every unit, or ``{unit: bool}``.

        >>> plan.with_reshard_after_forward({"layers.0": False})
        """
        return transforms.rebuilt(self, "with_reshard_after_forward", **transforms.reshard_units(self, which))

    def with_order(self, order: Union[Order, str]) -> "Plan":
        """The same plan for units that run in plan order (``"static"``) or in any order (``"dynamic"``)."""
        return transforms.rebuilt(self, "with_order", order=choose(Order, order, "order"))

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

    # -- costs -------------------------------------------------------------------------------------------
    def memory(self, rank: int = 0, *, recompute: bool = False) -> Memory:
        """Planned bytes on ``rank``: params, grads and optimizer state, and the peak over the schedule.
        A plan traced with example inputs (``trace=``) adds the traced step's activations to the peak
        (``memory.activations``: their share of it); ``recompute=True``: with every unit checkpointed.
        ``host``/``host_peak``: host memory of CPU offload (0 without it).

        >>> m = plan.memory(0); m.peak, m.states_peak, m.activations   # activations None: not traced
        """
        return Memory(**accounting.memory(self, rank, recompute))

    def comm_bytes(self, rank: int = 0) -> dict[str, Optional[int]]:
        """Bytes each rank sends per training step, by op kind (ring algorithms: (n-1)/n of the payload).
        With compute axes, ``tensor_parallel`` adds the activations the styles move: estimated when the plan
        was traced with example inputs (``trace=``), ``None`` ("not estimated") otherwise. With CPU offload,
        ``copy_d2h`` / ``copy_h2d`` are the host<->device copy bytes per step (not in ``total``, the network's).
        With expert modules split over an expert axis, ``expert_parallel`` adds the token all-to-alls
        (estimated from a traced plan's expert inputs under balanced routing; ``None`` untraced)."""
        return accounting.comm_bytes(self)

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

    def forecast(self, network: Any, compute: Any = None, *, batch: tuple[int, int], rank: int = 0,
                 scalar_all_reduces: int = 0) -> Any:
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

    # -- written out and read back ------------------------------------------------------------------------
    def to_json(self, indent: Optional[int] = None) -> str:
        return serialize.to_json(self, indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The plan ``text`` (``plan.to_json()``) holds; JSON of an older format is refused, naming it."""
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
        return serialize.core(self) == serialize.core(other)

    def declarative(self) -> dict[str, Any]:
        """Keyword arguments of :func:`shardplan.plan` that rebuild this plan from its module (rules, units,
        options: :func:`shardplan.planner.rebuild.declarative`).

        >>> sp.plan(model, **plan.declarative()).equivalent(plan)      # True (a traced order needs trace=)
        """
        return rebuild.declarative(self)

    def to_source(self) -> str:
        """A rules file that rebuilds this plan (``shardplan plan TARGET --rules FILE`` reads it; ``make_plan(model)``
        for Python)."""
        return rebuild.to_source(self)

    def to_chrome_trace(self, path: str, *, gbps: float = 100.0) -> None:
        """Write the planned schedule as a Chrome/Perfetto trace (open in ui.perfetto.dev); a picture of the
        plan's order and sizes at ``gbps`` GB/s, not a measurement."""
        render.chrome_trace(self, path, gbps)
