"""``shardplan.plan``: rules + a mesh + options -> a :class:`Plan`. Pure: no process group, no GPU.

:func:`plan` checks the options (``options.py``), runs the passes (``passes.py``: rules and leaves, compute axes,
low precision, units, layouts and buffers, compute placement), then builds the schedule and the :class:`Plan`
(:func:`_assemble`: with the offloaded buffers, the accounting's warnings), lowers the offload fraction under
``offload_fraction="auto"`` (:func:`_fit_device`), and validates it."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

from ..mesh import Mesh
from ..rules import Rules
from . import axes as AX
from . import offload as OFF
from . import passes
from .accounting import plan_warnings
from .facade import Plan
from .kinds import STRATEGIES, LayoutChoice, Order, Strategy
from .kinds import Offload as OffloadMode
from .options import Options, check
from .passes import Placed
from .policies import Layout, Offload, Precision, Schedule
from .policies import DtypeLike
from .schedule import build_schedule
from .validate import validate


RulesLike = Union[Rules, Sequence[tuple[str, Any]]]  # a Rules, or its (regex, spec) pairs


def plan(model_or_tree: Any, rules: RulesLike, mesh: Mesh, *,
         strategy: Union[Strategy, str] = Strategy.OPTIM_GRADS_PARAMS, units: Optional[Sequence] = None,
         precision: Optional[Precision] = None, offload: Union[None, Offload, OffloadMode, str] = None,
         schedule: Optional[Schedule] = None, layout: Union[Layout, LayoutChoice, str] = LayoutChoice.AUTO,
         compute_dtype: Optional[DtypeLike] = None, reduce_dtype: Optional[DtypeLike] = None, prefetch: int = 1,
         reshard_after_forward: Union[bool, Mapping[str, bool]] = True, trace: Optional[Any] = None,
         optimizer_states: int = 2, world_size: Optional[int] = None,
         min_unit_bytes: Optional[int] = None, order: Union[Order, str] = Order.STATIC,
         compute_axes: Sequence[str] = (), styles: Optional[Sequence[tuple[str, str]]] = None,
         offload_fraction: Union[float, str] = 1.0, device_memory: Optional[float] = None,
         expert_axes: Optional[Sequence[str]] = None,
         gather_dtype: Union[None, str, Sequence[tuple[str, Optional[str]]]] = None,
         fp8: Union[None, str, Sequence[tuple[str, str]]] = None, fp8_gather: bool = True) -> Plan:
    """Compile rules, a mesh and options into a :class:`Plan`. Pure: no process group, no GPU.

    >>> plan = shardplan.plan(model, rules, Mesh(dp=8), units=[r"layers\\.\\d+"], compute_dtype=torch.bfloat16)
    >>> plan = shardplan.plan(model, rules, Mesh(dp=8), units=[LlamaDecoderLayer])   # units by class

    The options come grouped by feature (:mod:`shardplan.planner.policies`), or as the flat keywords below, which
    mean the same (``compute_dtype=x`` is ``precision=Precision(compute_dtype=x)``; a field set both ways raises):

    >>> plan = shardplan.plan(model, rules, Mesh(dp=8), units=[r"layers\\.\\d+"],
    ...                       precision=sp.Precision(compute_dtype="bfloat16", reduce_dtype="float32"),
    ...                       offload=sp.Offload("optimizer", fraction=0.5),
    ...                       schedule=sp.Schedule(prefetch=2), layout=sp.Layout("chunked"))
    >>> plan.policies.precision.compute_dtype
    'bfloat16'

    ``units``: regexes over module paths, module classes, or classes' import paths (or bare names).
    Not given (``None``): the model's repeated blocks (:func:`shardplan.auto.find_units`: the elements of
    a ``ModuleList``/``ModuleDict``/``Sequential`` of one block class, e.g. ``model\\.layers\\.\\d+``),
    said in ``plan.notes``. ``units=()`` means one root unit, gathered for the whole step; a large root
    unit (see :data:`shardplan.auto.ROOT_WARN_BYTES`) warns with a ``PlanWarning`` naming the units to pass.
    ``min_unit_bytes`` merges neighbouring units (in forward order) until each holds at least that many
    parameter bytes: one collective per direction for several tiny blocks. ``None`` (the default) lets
    the planner choose from the unit sizes and say why in ``plan.notes``; ``0`` keeps one unit per
    module. ``order="dynamic"`` keeps units gathered until the forward ends, for models whose units run
    in a data-dependent order or more than once (the default, ``"static"``, raises when a freed unit
    runs again).

    ``compute_axes`` names mesh axes that shard *compute* (tensor parallelism): a spec naming one keeps
    that dimension sharded while computing, and the module runs a tensor-parallel style inferred from
    the specs (or named in ``styles=[(module regex, style)]``); see :mod:`shardplan.planner.tensor_parallel`.

    >>> plan = shardplan.plan(model, rules, Mesh(dp=2, tp=2), compute_axes=("tp",))

    ``layout="chunked"`` gives every rank the ``torch.chunk`` piece of each sharded dimension (FSDP2's and
    DTensor's layout: ``model.state_dict()`` then returns DTensors that are views of the shards) instead of
    the planner's choice (``"auto"``: whole rows packed contiguously where that costs little padding, which
    saves the copy-out after each gather).

    ``offload="optimizer"`` keeps the master shards and the optimizer state in host memory and steps them
    there (train with :func:`shardplan.offload_optimizer`); ``offload="params"`` (ZeRO-3) also keeps the
    parameter shards there, copied in ahead of each gather; ``offload_fraction=f`` offloads only that share
    of the buffers (see :mod:`shardplan.planner.offload` and docs/offload.md); ``offload_fraction="auto"``
    with ``device_memory=`` (bytes per device) takes the smallest fraction whose device peak fits.

    >>> plan = shardplan.plan(model, rules, Mesh(dp=8), offload="optimizer")
    >>> plan.memory().host                       # bytes of host memory per rank
    >>> plan = shardplan.plan(model, rules, Mesh(dp=8), offload="optimizer", offload_fraction="auto",
    ...                       device_memory=80 * 2**30)

    ``expert_axes`` (default: the mesh's ``ep`` axis, if any) splits the stacked weights of expert modules
    by expert where a spec puts it first in dim 0 (expert parallelism, :mod:`shardplan.planner.expert_parallel`);
    for every other parameter it is a data axis.

    >>> plan = shardplan.plan(moe, [(r".*experts\\.w\\d", P("ep", None, None)), (r".*", P("dp"))], Mesh(dp=2, ep=2))

    ``gather_dtype="int8"`` or ``"float8_e4m3fn"`` (ZeRO-3) all-gathers a block-quantized copy of the shards of
    floating trainable parameters of two or more dimensions (fp32 absmax scale per 256 elements of the flat
    shard), dequantized to the compute dtype after the gather; the master shards never see quantized values.
    Per rule: ``gather_dtype=[(r".*embed.*", None), (r".*", "int8")]`` (first match wins, unmatched: not
    quantized). See :mod:`shardplan.lowp` and docs/low_precision.md.

    ``fp8="torchao"`` runs the units' ``nn.Linear`` modules in float8 (torchao's ``Float8Linear``, which
    ``sp.shard`` swaps in; ``pip install shardplan[fp8]``): every one whose dims divide by 16, but the output
    head, tied and tensor-parallel weights; per module, ``fp8=[(module regex, "torchao" or None), ...]``.
    ``plan.fp8_modules`` lists them, ``plan.warnings`` says where FP8 compute does not pay (docs/low_precision.md).
    Under ZeRO-3 their weights are all-gathered as float8 codes with one scale per weight (an all-reduce of the
    absmaxes first) and handed to torchao as float8 tensors, never dequantized; ``fp8_gather=False`` gathers
    them in the compute dtype instead (torchao casts after the gather).
    """
    opts = check(mesh, world_size=world_size, strategy=strategy, compute_axes=compute_axes, expert_axes=expert_axes,
                 styles=styles, optimizer_states=optimizer_states, precision=precision, offload=offload,
                 schedule=schedule, layout=layout, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                 gather_dtype=gather_dtype, fp8=fp8, fp8_gather=fp8_gather, offload_fraction=offload_fraction,
                 device_memory=device_memory, prefetch=prefetch, order=order,
                 reshard_after_forward=reshard_after_forward, min_unit_bytes=min_unit_bytes)
    lv = passes.match_rules(model_or_tree, rules, mesh, units, trace)
    _emit(lv.warned)
    ax = passes.compute_axes(lv, opts, mesh, trace)
    _emit(ax.warned)
    pr = passes.low_precision(lv, ax, opts)
    un = passes.group_units(lv, ax, pr, opts, trace)
    _emit(un.warned)
    lay = passes.lay_out(lv, ax, pr, un, opts, mesh)
    placed = passes.place_compute(lv, ax, lay, opts, mesh, trace)
    notes = lv.notes + ax.notes + un.notes
    choices = lv.choices + ax.choices + un.choices + placed.choices
    result = _assemble(opts, mesh, lay, placed, un, notes, choices)
    if opts.offload_fraction == OFF.AUTO:  # [Note: the automatic fraction] in planner/offload.py
        result = _fit_device(result, opts.device_memory)
    validate(result)  # the builder's own schedules obey the rules edited ones must
    return result


def _emit(warned) -> None:
    """The passes' warnings, pointed at ``shardplan.plan``'s caller."""
    for message, category in warned:
        warnings.warn(message, category, stacklevel=3)


def _assemble(opts: Options, mesh: Mesh, lay: passes.Layout, placed: Placed, un, notes: tuple, choices: tuple) -> Plan:
    """The schedule and the :class:`Plan`, with the share of the buffers ``offload_fraction`` says offloaded
    (all of them under ``"auto"``, which :func:`_fit_device` then lowers)."""
    fraction = 1.0 if opts.offload_fraction == OFF.AUTO else opts.offload_fraction
    buffers, units = OFF.offloaded(lay.buffers, lay.units, level=opts.level, offload=opts.offload,
                                   fraction=fraction), lay.units
    schedule = AX.with_ops(
        build_schedule(list(units), list(buffers), mesh, opts.level, opts.prefetch, opts.order, len(lay.params)),
        list(units), placed.axes, mesh)
    return Plan(mesh=mesh, strategy=STRATEGIES[opts.level], compute_dtype=opts.compute, reduce_dtype=opts.reduce,
                prefetch=opts.prefetch,
                reshard_after_forward=all(u.reshard_after_forward for u in units[1:]) if lay.mixed_reshard
                else opts.reshard_after_forward, optimizer_states=opts.optimizer_states, params=lay.params,
                buffers=buffers, units=units, schedule=schedule,
                warnings=tuple(notes) + plan_warnings(mesh, lay.params, buffers, units), order=opts.order,
                notes=tuple(choices), min_unit_bytes=un.min_unit_bytes, axes=placed.axes, layout=opts.layout,
                offload=opts.offload, offload_fraction=fraction, activations=placed.profile,
                fp8_modules=un.fp8_modules)


def _fit_device(plan: Plan, device_memory: float) -> Plan:
    """``offload_fraction="auto"``: ``plan`` (everything offloaded) at the smallest fraction whose device peak fits
    ``device_memory`` (on up to 64 ranks spread over the mesh), noted. A pass over the plan's buffers: each
    candidate re-marks which buffers are offloaded and rebuilds the schedule only (:meth:`Plan._with_offload_fraction`)."""
    mesh = plan.mesh
    ranks = range(mesh.size) if mesh.size <= 64 else sorted({r * (mesh.size - 1) // 63 for r in range(64)})

    def peak(f: float) -> tuple[int, int]:
        candidate = plan._with_offload_fraction(f)
        return max((candidate.memory(r).peak, r) for r in ranks)

    fraction = OFF.smallest_fitting(OFF.prefix_fractions(plan.buffers, plan.units), peak, device_memory)
    note = (f"offload_fraction={fraction:.6g}: the smallest share of the trainable shard bytes whose device peak "
            f"fits device_memory={int(device_memory):,d} B (offload_fraction='auto')")
    return dataclasses.replace(plan._with_offload_fraction(fraction), notes=plan.notes + (note,))
