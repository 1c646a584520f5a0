"""The planner's passes 4 and 5 (``passes.py`` has the others, and the order ``compiler.plan`` runs them in):

4. :func:`group_units`: each unit's members, small units merged, their parents, the FP8 modules' final units;
5. :func:`lay_out`: each unit's buffers (layouts, dtypes, axes) and each parameter's place in them.

Each a pure function over the checked options and the earlier passes' frozen results (``passes.Leaves``,
``passes.Axes``, ``passes.Precision``); what it notes and warns is returned, never warned here."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from .. import layout as L
from ..auto import choose_min_unit_bytes, merge_note, root_unit_warning
from ..dtypes import is_floating
from ..errors import PlanError, PlanWarning
from ..mesh import Mesh
from ..spec import P
from . import float8 as F8
from . import geometry
from . import tensor_parallel as tp
from .options import Options
from .schedule import ROOT
from .values import BufferPlan, ParamPlan, UnitPlan, buffer_facts

if TYPE_CHECKING:  # annotations only: the earlier passes' results
    from .passes import Axes, Leaves, Precision, Warned

# ---- 4. units: members, merging, parents ------------------------------------------------------------

def _parents(order: Sequence[str], paths: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """The deepest unit whose module encloses each unit's first module (ROOT if none)."""
    owner = {mp: u for u in order for mp in paths[u]}
    out = {}
    for u in order:
        parts = paths[u][0].split(".")
        out[u] = next((owner[p] for p in (".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1))
                       if p in owner and owner[p] != u), ROOT)
    return out


def _unit_bytes(members) -> int:
    return sum(math.prod(i.shape) * i.dtype.itemsize for i, _ in members)


def _merge_small_units(order: list[str], members: dict, min_bytes: int, parent: dict[str, str]):
    """Merge consecutive sibling units smaller than ``min_bytes`` (the last of a run may stay smaller).
    Units nested in one another are never merged: a merged unit is freed when its last module ends."""
    if min_bytes <= 0 or len(order) < 2:
        return order, members, {}
    size = {u: _unit_bytes(members[u]) for u in order}
    groups, current, acc = [], [], 0
    for u in order:
        if current and (parent[u] != parent[current[0]] or any(parent[u] == c for c in current)):
            groups.append(current)
            current, acc = [], 0
        current.append(u)
        acc += size[u]
        if acc >= min_bytes:
            groups.append(current)
            current, acc = [], 0
    if current:
        groups.append(current)
    new_order, new_members, covers = [], {ROOT: members[ROOT]}, {}
    for g in groups:
        name = g[0] if len(g) == 1 else f"{g[0]}..{g[-1]}"
        new_order.append(name)
        new_members[name] = [m for u in g for m in members[u]]
        if len(g) > 1:
            covers[name] = tuple(g)
    return new_order, new_members, covers


def _large_root_warning(members: dict, level: int, suggest: list) -> str:
    """A warning when the root unit (gathered all step) holds much of a large model (ZeRO-3 only: lower
    strategies keep every parameter whole anyway)."""
    if level < 3:
        return ""
    size = {u: sum(math.prod(i.shape) * i.dtype.itemsize for i, _ in m) for u, m in members.items()}
    return root_unit_warning(size[ROOT], sum(size.values()), suggest)


@dataclass(frozen=True)
class Units:
    """The final units (after merging) in forward order, the members of each (``(local info, storage spec)``:
    what one tensor-parallel rank stores), the modules a merged unit covers, each unit's parent."""
    order: tuple
    members: Mapping[str, list]
    covers: Mapping[str, tuple]
    parent: Mapping[str, str]
    min_unit_bytes: int
    fp8_modules: tuple    # with the units they ended in
    notes: tuple
    choices: tuple
    warned: Warned


def group_units(lv: Leaves, ax: Axes, pr: Precision, opts: Options, trace: Any) -> Units:
    unit_order = list(lv.unit_order)
    members: dict[str, list] = {u: [] for u in [ROOT] + unit_order}
    for info in lv.infos:  # the layout sees what one tensor-parallel rank stores: its local shape, storage axes
        c = ax.tp_of[info.name]
        local = dataclasses.replace(info, shape=tp.local_shape(info.shape, c))
        own = opts.compute_axes + ((c.axis,) if info.name in ax.ep_of else ())
        members[lv.owner[info.name]].append((local, tp.storage_spec(ax.spec_of[info.name], own)))
    parent = _parents(unit_order, {u: (u,) for u in unit_order})
    notes, choices, warned = [], [], []
    large_root = _large_root_warning(members, opts.level, lv.suggest)
    if large_root:
        warned.append((large_root, PlanWarning))
        notes.append(large_root)
    sizes = [_unit_bytes(members[u]) for u in unit_order]
    min_unit_bytes, automatic, why = opts.min_unit_bytes, opts.min_unit_bytes is None, ""
    if automatic:
        min_unit_bytes, why = choose_min_unit_bytes(sizes)
    before = len(unit_order)
    unit_order, members, covers = _merge_small_units(unit_order, members, min_unit_bytes, parent)
    if automatic or len(unit_order) != before:
        merged = [(len(covers.get(u, (u,))), _unit_bytes(members[u])) for u in unit_order]
        choices.append(merge_note(min_unit_bytes, sizes, merged, why, automatic))
    parent = _parents(unit_order, {u: covers.get(u, (u,)) for u in unit_order})
    fp8_modules = pr.fp8_modules
    if fp8_modules:  # the units they ended in (after merging)
        final = {i.name: u for u, m in members.items() for i, _ in m}
        fp8_modules = tuple(dataclasses.replace(m, unit=final[m.weight]) for m in fp8_modules)
        choices.append(F8.note(fp8_modules, pr.fp8_skipped, pr.fp8_tw, pr.fp8_why))
        notes += F8.warnings(fp8_modules, F8.tokens_of(trace) if trace is not None else None)
    return Units(order=tuple(unit_order), members=members, covers=covers, parent=parent,
                 min_unit_bytes=min_unit_bytes, fp8_modules=fp8_modules, notes=tuple(notes), choices=tuple(choices),
                 warned=tuple(warned))


# ---- 5. layouts and buffers ---------------------------------------------------------------------------

def _reshard_flags(reshard_after_forward, unit_order: Sequence[str]) -> Optional[dict]:
    """``reshard_after_forward``: one flag for every unit (None here), or {unit: flag} (the rest: True), as
    Plan.with_reshard_after_forward takes it and Plan.declarative() writes it for a plan with mixed flags."""
    if not isinstance(reshard_after_forward, Mapping):
        return None
    raf_of = dict(reshard_after_forward)
    raf_of.pop(ROOT, None)  # the root is never freed after its forward (as with_reshard_after_forward)
    bad = sorted(k for k, v in raf_of.items() if not isinstance(v, bool))
    if bad:
        raise PlanError(f"reshard_after_forward: the flags of {bad} are not True/False")
    unknown = sorted(set(raf_of) - set(unit_order))
    if unknown:
        raise PlanError(f"reshard_after_forward names unit(s) {unknown} that the plan does not have; its units: "
                        f"{list(unit_order[:8])}{' ...' if len(unit_order) > 8 else ''}")
    return raf_of


def _laid_unit(unit_members: list, ax: Axes, pr: Precision, opts: Options, mesh: Mesh) -> list:
    """One unit's buffers as the geometry lays them out: ``(key, (placement, members), axes not reduced over,
    partial axes)`` each."""
    # [Note: expert weights get buffers of their own: their gradients are not reduced over the expert axis
    # (every ep rank's tokens already reached them through the all-to-all), dense ones' are]
    # [Note: partial gradients] (planner/tp_partial.py) replicated parameters read on sharded activations
    # get buffers of their own too: their gradients are summed over the compute axis first
    level, compute, layout, compute_axes = opts.level, opts.compute, opts.layout, opts.compute_axes
    dense = [m for m in unit_members if m[0].name not in ax.ep_of and m[0].name not in ax.partial_of]
    experts = [m for m in unit_members if m[0].name in ax.ep_of]
    laid = [(k, v, compute_axes, ()) for k, v in geometry.layout_unit(dense, mesh, level, compute, layout,
                                                                      pr.gather_of).items()]
    for axis in sorted(set(ax.partial_of.values())):
        part = [m for m in unit_members if ax.partial_of.get(m[0].name) == axis]
        laid += [(k, v, compute_axes, (axis,))
                 for k, v in (geometry.layout_unit(part, mesh, level, compute, layout, pr.gather_of).items()
                              if part else ())]
    laid += [(k, v, compute_axes + opts.expert_axes, ())
             for k, v in (geometry.layout_unit(experts, mesh, level, compute, layout).items() if experts else ())]
    return laid


def _buffer(index: int, uname: str, key, placement, mem, not_reduced, partial_axes, opts: Options,
            mesh: Mesh) -> BufferPlan:
    (dtype, rg, axes, _, fmt) = key
    compute, reduce, reduce_quant = opts.compute, opts.reduce, opts.reduce_quant
    cdt = compute if compute and is_floating(dtype) else dtype
    rq = reduce_quant if reduce_quant and rg and is_floating(dtype) and placement.layout != L.REPLICATED else ""
    rdt = "float32" if reduce_quant and is_floating(dtype) else reduce if reduce and is_floating(dtype) else cdt
    group = mesh.axis_size(axes) if axes else 1
    b = BufferPlan(index=index, unit=uname, dtype=dtype, compute_dtype=cdt, reduce_dtype=rdt,
                   layout=placement.layout, axes=axes,
                   replica_axes=tuple(a for a in mesh.axis_names if a not in axes and a not in not_reduced),
                   group_size=group, shard_numel=placement.shard_numel,
                   numel=sum(math.prod(i.shape) for i, _ in mem), params=tuple(i.name for i, _ in mem),
                   requires_grad=rg, gather_dtype=fmt, reduce_quant=rq, partial_axes=partial_axes if rg else (),
                   **buffer_facts(placement.layout, opts.level, group, dtype, cdt, rdt))
    if rq and b.replica_axes and mesh.axis_size(b.replica_axes) > 1:
        raise PlanError(f"reduce_dtype='int8' with replica axes {b.replica_axes} (HSDP) is not supported yet: "
                        f"shard the parameters over every data axis, or use reduce_dtype='float32'")
    return b


@dataclass(frozen=True)
class Layout:
    """The parameters (in the model's order), the buffers (in unit order) and the units."""
    params: tuple
    buffers: tuple
    units: tuple
    mixed_reshard: bool   # reshard_after_forward was given per unit


def lay_out(lv: Leaves, ax: Axes, pr: Precision, un: Units, opts: Options, mesh: Mesh) -> Layout:
    raf_of = _reshard_flags(opts.reshard_after_forward, un.order)
    params: dict[str, ParamPlan] = {}
    buffers: list[BufferPlan] = []
    unit_plans: list[UnitPlan] = []
    for uname in [ROOT] + list(un.order):
        idxs = []
        for key, (placement, mem), not_reduced, partial_axes in _laid_unit(un.members[uname], ax, pr, opts, mesh):
            b = _buffer(len(buffers), uname, key, placement, mem, not_reduced, partial_axes, opts, mesh)
            buffers.append(b)
            idxs.append(b.index)
            for (info, _), off in zip(mem, placement.offsets):
                c = ax.tp_of[info.name]
                spec = ax.spec_of[info.name] if opts.level else (tp.with_compute(P(), c.dim, c.axis) if c else P())
                params[info.name] = ParamPlan(name=info.name, shape=info.shape, dtype=b.dtype, spec=spec,
                                              rule=lv.rule_of[info.name], unit=uname, buffer=b.index, offset=off,
                                              requires_grad=info.requires_grad, aliases=info.aliases, compute=c)
        # [Note: every unit but the root is freed after its forward, the last one too (FSDP2's default), and
        # gathered again at its pre_backward, after the root's backward (the head and its loss), where the
        # step's peak usually is: holding it there, or prefetching it as backward begins, adds its full size
        # to the peak (+98 MiB on the 1B GPT, measured). torchtitan keeps the last block gathered instead,
        # which saves that all-gather: ``plan.with_reshard_after_forward({last: False})``]
        raf = (raf_of.get(uname, True) if raf_of is not None else bool(opts.reshard_after_forward)) and uname != ROOT
        unit_plans.append(UnitPlan(name=uname, buffers=tuple(idxs), reshard_after_forward=raf,
                                   modules=un.covers.get(uname, ()), parent=un.parent.get(uname, ROOT)))
    return Layout(params=tuple(params[i.name] for i in lv.infos), buffers=tuple(buffers), units=tuple(unit_plans),
                  mixed_reshard=raf_of is not None)
