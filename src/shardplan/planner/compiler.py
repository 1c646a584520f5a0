"""``shardplan.plan``: rules + a mesh + options -> a :class:`Plan`. Pure: no process group, no GPU.

:func:`plan` checks the options (``options.py``), runs the passes (``passes.py``: rules and leaves, compute axes,
low precision, units, layouts and buffers, compute placement), then builds the schedule and the :class:`Plan`
(:func:`_assemble`: with the offloaded buffers, the accounting's warnings), choosing the offload fraction first
under ``offload_fraction="auto"``, and validates it."""

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
from .kinds import STRATEGIES, LayoutChoice, Offload, Order, Strategy
from .options import Options, check
from .passes import Layout, Placed
from .schedule import build_schedule
from .validate import validate


RulesLike = Union[Rules, Sequence[tuple[str, Any]]]  # a Rules, or its (regex, spec) pairs
DtypeLike = Any  # a torch.dtype or its name ("bfloat16", "bf16"): the planner does not import torch


def plan(model_or_tree: Any, rules: RulesLike, mesh: Mesh, *,
         strategy: Union[Strategy, str] = Strategy.OPTIM_GRADS_PARAMS, units: Optional[Sequence] = None,
         compute_dtype: Optional[DtypeLike] = None, reduce_dtype: Optional[DtypeLike] = None, prefetch: int = 1,
         reshard_after_forward: Union[bool, Mapping[str, bool]] = True, trace: Optional[Any] = None,
         optimizer_states: int = 2, world_size: Optional[int] = None,
         min_unit_bytes: Optional[int] = None, order: Union[Order, str] = Order.STATIC,
         compute_axes: Sequence[str] = (), styles: Optional[Sequence[tuple[str, str]]] = None,
         layout: Union[LayoutChoice, str] = LayoutChoice.AUTO, offload: Optional[Union[Offload, str]] = None,
         offload_fraction: Union[float, str] = 1.0, device_memory: Optional[float] = None,
         expert_axes: Optional[Sequence[str]] = None,
         gather_dtype: Union[None, str, Sequence[tuple[str, Optional[str]]]] = None,
         fp8: Union[None, str, Sequence[tuple[str, str]]] = None, fp8_gather: bool = True) -> Plan:
    """Compile rules, a mesh and options into a :class:`Plan`. Pure: no process group, no GPU.

    >>> plan = shardplan.plan(model, rules, Mesh(dp=8), units=[r"layers\\.\\d+"], compute_dtype=torch.bfloat16)
    >>> plan = shardplan.plan(model, rules, Mesh(dp=8), units=[LlamaDecoderLayer])   # units by class

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
    opts = check(mesh, world_size=world_size, strategy=strategy, offload=offload, offload_fraction=offload_fraction,
                 device_memory=device_memory, prefetch=prefetch, order=order, layout=layout,
                 min_unit_bytes=min_unit_bytes, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                 compute_axes=compute_axes, expert_axes=expert_axes, gather_dtype=gather_dtype, fp8=fp8,
                 fp8_gather=fp8_gather, styles=styles, reshard_after_forward=reshard_after_forward,
                 optimizer_states=optimizer_states)
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
    fraction = opts.offload_fraction
    if fraction == OFF.AUTO:  # [Note: the automatic fraction] in planner/offload.py
        fraction, note = _auto_fraction(opts, mesh, lay, placed, un, notes, choices)
        choices += (note,)
    result = _assemble(opts, mesh, lay, placed, un, notes, choices, fraction)
    validate(result)  # the builder's own schedules obey the rules edited ones must
    return result


def _emit(warned) -> None:
    """The passes' warnings, pointed at ``shardplan.plan``'s caller."""
    for message, category in warned:
        warnings.warn(message, category, stacklevel=3)


def _assemble(opts: Options, mesh: Mesh, lay: Layout, placed: Placed, un, notes: tuple, choices: tuple,
              fraction) -> Plan:
    """The schedule and the :class:`Plan`, with ``fraction`` of the buffers offloaded (under ``offload=``)."""
    buffers, units = lay.buffers, lay.units
    if opts.offload is not None:
        hosted = OFF.choose_offloaded(list(buffers), list(units), level=opts.level, offload=opts.offload,
                                      fraction=fraction)
        buffers = tuple(dataclasses.replace(b, offload=hosted.get(b.index, "")) for b in buffers)
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


def _auto_fraction(opts: Options, mesh: Mesh, lay: Layout, placed: Placed, un, notes: tuple,
                   choices: tuple) -> tuple[float, str]:
    """``offload_fraction="auto"``: the smallest fraction whose device peak fits ``device_memory`` (on up to 64
    ranks spread over the mesh), and the note that says so."""
    ranks = range(mesh.size) if mesh.size <= 64 else sorted({r * (mesh.size - 1) // 63 for r in range(64)})

    def peak(f: float) -> tuple[int, int]:
        p = _assemble(opts, mesh, lay, placed, un, notes, choices, f)
        return max((p.memory(r).peak, r) for r in ranks)

    fraction = OFF.smallest_fitting(OFF.prefix_fractions(list(lay.buffers), list(lay.units)), peak, opts.device_memory)
    return fraction, (f"offload_fraction={fraction:.6g}: the smallest share of the trainable shard bytes "
                      f"whose device peak fits device_memory={int(opts.device_memory):,d} B (offload_fraction='auto')")
