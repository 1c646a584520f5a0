"""``shardplan.plan``: rules + a mesh + options -> a :class:`Plan`. Pure: no process group, no GPU.

:func:`plan` checks the options (``options.py``), runs the passes (``passes.py``: rules and leaves, compute axes,
low precision; ``grouping.py``: units, layouts and buffers; ``passes.py``: compute placement), then builds the
schedule and the :class:`Plan` (:func:`_assemble`: with the offloaded buffers, the accounting's warnings), lowers the offload fraction under
``offload_fraction="auto"`` (:func:`_fit_device`), and validates it."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

from ..mesh import Mesh
from ..rules import Rules
from . import axes as AX
from . import offload as OFF
from . import grouping, passes, transforms
from .accounting import plan_warnings
from .facade import Plan
from .kinds import STRATEGIES, LayoutChoice, Order, Strategy
from .kinds import Offload as OffloadMode
from .options import DtypeLike, Options, check
from .passes import Placed
from .schedule import build_schedule
from .validate import validate


RulesLike = Union[Rules, Sequence[tuple[str, Any]]]  # a Rules, or its (regex, spec) pairs


def plan(model_or_tree: Any, rules: RulesLike, mesh: Mesh, *,
         strategy: Union[Strategy, str] = Strategy.OPTIM_GRADS_PARAMS, units: Optional[Sequence] = None,
         compute_dtype: Optional[DtypeLike] = None, reduce_dtype: Optional[DtypeLike] = None, prefetch: int = 1,
         reshard_after_forward: Union[bool, Mapping[str, bool]] = True, trace: Optional[Any] = None,
         optimizer_states: int = 2, world_size: Optional[int] = None,
         min_unit_bytes: Optional[int] = None, order: Union[Order, str] = Order.STATIC,
         layout: Union[LayoutChoice, str] = LayoutChoice.AUTO,
         compute_axes: Sequence[str] = (), styles: Optional[Sequence[tuple[str, str]]] = None,
         offload: Union[None, OffloadMode, str] = None,
         offload_fraction: Union[float, str] = 1.0, device_memory: Optional[float] = None,
         expert_axes: Optional[Sequence[str]] = None,
         gather_dtype: Union[None, str, Sequence[tuple[str, Optional[str]]]] = None,
         fp8: Union[None, str, Sequence[tuple[str, str]]] = None, fp8_gather: bool = True) -> Plan:
    """Compile rules, a mesh and options into a :class:`Plan`. Pure: no process group, no GPU.

    >>> plan = shardplan.plan(model, rules, Mesh(dp=8), units=[r"layers\\.\\d+"], compute_dtype=torch.bfloat16)
    >>> plan = shardplan.plan(model, rules, Mesh(dp=8), units=[LlamaDecoderLayer])   # units by class

    ``units``: regexes over module paths, module classes, or classes' import paths (or bare names); ``None``:
    the model's repeated blocks (:func:`shardplan.auto.find_units`), said in ``plan.notes``; ``()``: one root unit.
    ``min_unit_bytes`` merges neighbouring units until each holds that many parameter bytes (``None``: chosen,
    said in ``plan.notes``; ``0``: one unit per module). ``order="dynamic"`` keeps units gathered until the
    forward ends, for units that run in a data-dependent order or more than once. ``prefetch``: units gathered
    ahead; ``reshard_after_forward``: free each unit's parameters after its forward (``True``), keep them for
    backward (``False``), or ``{unit: bool}``. ``compute_dtype`` / ``reduce_dtype``: the gathers' and the
    gradient reduction's dtypes (``reduce_dtype="int8"``: a block-quantized reduction).

    ``compute_axes`` names mesh axes that shard *compute* (tensor parallelism, styles inferred from the specs or
    named in ``styles=[(module regex, style)]``: :mod:`shardplan.planner.tensor_parallel`); ``expert_axes``
    (default: the mesh's ``ep`` axis) splits stacked expert weights by expert (expert parallelism).
    ``layout="chunked"`` gives every rank the ``torch.chunk`` piece of each sharded dimension (FSDP2's and
    DTensor's layout) instead of the planner's choice (``"auto"``).

    ``offload="optimizer"`` keeps the master shards and the optimizer state in host memory and steps them there;
    ``offload="params"`` (ZeRO-3) the parameter shards too; ``offload_fraction=f`` offloads that share, ``"auto"``
    with ``device_memory=`` (bytes per device) the smallest share whose device peak fits (docs/offload.md).

    >>> plan = shardplan.plan(model, rules, Mesh(dp=8), offload="optimizer", offload_fraction="auto",
    ...                       device_memory=80 * 2**30)

    ``gather_dtype="int8"`` or ``"float8_e4m3fn"`` (ZeRO-3) all-gathers block-quantized shards, or per rule
    ``[(regex, dtype or None), ...]``; ``fp8="torchao"`` runs the units' ``nn.Linear``\\ s in float8 (``plan.fp8_modules``),
    their weights gathered as float8 codes unless ``fp8_gather=False`` (docs/low_precision.md).
    """
    opts = check(mesh, world_size=world_size, strategy=strategy, compute_axes=compute_axes, expert_axes=expert_axes,
                 styles=styles, optimizer_states=optimizer_states, compute_dtype=compute_dtype,
                 reduce_dtype=reduce_dtype, gather_dtype=gather_dtype, fp8=fp8, fp8_gather=fp8_gather, offload=offload,
                 offload_fraction=offload_fraction, device_memory=device_memory, prefetch=prefetch, order=order,
                 reshard_after_forward=reshard_after_forward, layout=layout, min_unit_bytes=min_unit_bytes)
    result = _compile(model_or_tree, rules, mesh, units, trace, opts)
    if opts.offload_fraction == OFF.AUTO:  # [Note: the automatic fraction] in planner/offload.py
        result = _fit_device(result, opts.device_memory)
    validate(result)  # the builder's own schedules obey the rules edited ones must
    return result


def _compile(model_or_tree: Any, rules: RulesLike, mesh: Mesh, units, trace, opts: Options) -> Plan:
    """The passes in order (their warnings emitted at the caller of ``shardplan.plan``), then :func:`_assemble`."""
    lv = passes.match_rules(model_or_tree, rules, mesh, units, trace)
    _emit(lv.warned)
    ax = passes.compute_axes(lv, opts, mesh, trace)
    _emit(ax.warned)
    pr = passes.low_precision(lv, ax, opts)
    un = grouping.group_units(lv, ax, pr, opts, trace)
    _emit(un.warned)
    lay = grouping.lay_out(lv, ax, pr, un, opts, mesh)
    placed = passes.place_compute(lv, ax, lay, opts, mesh, trace)
    notes = lv.notes + ax.notes + un.notes
    choices = lv.choices + ax.choices + un.choices + placed.choices
    return _assemble(opts, mesh, lay, placed, un, notes, choices)


def _emit(warned) -> None:
    """The passes' warnings, pointed at ``shardplan.plan``'s caller."""
    for message, category in warned:
        warnings.warn(message, category, stacklevel=4)


def _assemble(opts: Options, mesh: Mesh, lay: grouping.Layout, placed: Placed, un, notes: tuple, choices: tuple) -> Plan:
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
    candidate re-marks which buffers are offloaded and rebuilds the schedule only (:func:`~shardplan.planner.transforms.with_offload_fraction`)."""
    mesh = plan.mesh
    ranks = range(mesh.size) if mesh.size <= 64 else sorted({r * (mesh.size - 1) // 63 for r in range(64)})

    def peak(f: float) -> tuple[int, int]:
        candidate = transforms.with_offload_fraction(plan, f)
        return max((candidate.memory(r).peak, r) for r in ranks)

    fraction = OFF.smallest_fitting(OFF.prefix_fractions(plan.buffers, plan.units), peak, device_memory)
    note = (f"offload_fraction={fraction:.6g}: the smallest share of the trainable shard bytes whose device peak "
            f"fits device_memory={int(device_memory):,d} B (offload_fraction='auto')")
    return dataclasses.replace(transforms.with_offload_fraction(plan, fraction), notes=plan.notes + (note,))
