"""The planner's passes, in the order ``compiler.plan`` runs them; each a pure function with one job, reading
the checked :class:`~shardplan.planner.options.Options` and the earlier passes' frozen results:

1. :func:`match_rules`: the model's leaves, the rule each matched, the unit each belongs to (in traced order);
2. :func:`compute_axes`: every compute axis resolved (:mod:`.axes`: tensor-parallel styles, expert modules), the
   traced flow check, partial gradients;
3. :func:`low_precision`: which parameters gather quantized, which ``nn.Linear``\\ s compute in FP8;
4. :func:`group_units`: each unit's members, small units merged, their parents, the FP8 modules' final units;
5. :func:`lay_out`: each unit's buffers (layouts, dtypes, axes) and each parameter's place in them;
6. :func:`place_compute`: every compute axis traced and placed in the units (``plan.axes``), the traced
   activation profile.

A pass returns what the plan notes (``choices``: ``plan.notes``), what it warns (``notes``: ``plan.warnings``) and
the warnings ``plan()`` emits (``warned``: (message, category) pairs); it never warns itself, so that every
warning points at ``shardplan.plan``'s caller."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from .. import layout as L
from .. import lowp
from ..activations import profile as profile_activations
from ..auto import choose_min_unit_bytes, find_units, merge_note, root_unit_warning
from ..dtypes import dtype_name, is_floating, itemsize
from ..errors import PlanError, PlanWarning
from ..mesh import Mesh
from ..rules import as_rules, match_leaves, regex_list_source
from ..spec import P
from ..units import assign_units, check_entries, collect_leaves, module_classes, trace_order
from . import axes as AX
from . import context_parallel as CPX
from . import float8 as F8
from . import geometry
from . import tensor_parallel as tp
from .axis import Placing
from .options import Options
from .schedule import ROOT
from .values import BufferPlan, ParamPlan, UnitPlan, buffer_facts

Warned = tuple  # ((message, category), ...): the warnings plan() emits, in order


# ---- 1. rules and leaves ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Leaves:
    """The model's leaves (``infos``), the spec and rule each matched, the unit each belongs to."""
    module: Any
    infos: tuple
    candidates: Any
    specs: tuple          # the matched spec of each info
    rule_of: Mapping[str, str]
    owner: Mapping[str, str]
    unit_order: tuple
    suggest: list         # the units a large-root warning proposes
    notes: tuple
    choices: tuple
    warned: Warned


def match_rules(model_or_tree: Any, rules: Any, mesh: Mesh, units: Optional[Sequence], trace: Any) -> Leaves:
    rules = as_rules(rules)
    infos, leaves, candidates, module = collect_leaves(model_or_tree)
    CPX.check_hf_attention(module, mesh)  # (untraced plans too: the attention's name is on the model)
    if not infos:
        raise PlanError("the model has no parameters to plan")
    found = find_units(module) if module is not None else []
    choices: list[str] = []
    suggest = found  # what a large-root warning proposes: the found units, unless they are the units already
    if units is None:
        units, suggest = found, []
        if found:
            choices.append(f"units={regex_list_source(found)} (automatic: the model's repeated blocks); pass units=[...] to choose "
                           f"others, units=() for one root unit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        matched = match_leaves(rules, [i.name for i in infos], leaves, mesh=mesh,
                               aliases={a: i.name for i in infos for a in i.aliases})
        owner, unit_order, notes = assign_units(infos, candidates, tuple(units),
                                                module_classes(module) if module is not None else None)
        if module is not None:
            check_entries(module, unit_order, infos, owner)
        if trace is not None:
            if module is None:
                raise PlanError("trace= needs an nn.Module; a plain pytree has no forward to trace")
            unit_order = trace_order(module, unit_order, trace)
    rule_of = {info.name: rule.describe() for info, (_, rule) in zip(infos, matched)}
    return Leaves(module=module, infos=tuple(infos), candidates=candidates, specs=tuple(s for s, _ in matched),
                  rule_of=rule_of, owner=owner, unit_order=tuple(unit_order), suggest=suggest,
                  notes=tuple(notes) + tuple(str(w.message) for w in caught), choices=tuple(choices),
                  warned=tuple((w.message, w.category) for w in caught))


# ---- 2. the compute axes: tensor, expert and context parallelism --------------------------------------

@dataclass(frozen=True)
class Axes:
    """Each parameter's compute placement (``tp_of``: tensor or expert parallel, or None) and storage spec, the
    parameters whose axis gives them buffers of their own (``ep_of``: expert parallelism), each axis's value
    before placement (``values``: kind -> value, in the axes' order), and the replicated parameters whose
    gradients are partial (``partial_of``: name -> the compute axis they are summed over)."""
    tp_of: Mapping[str, Any]
    spec_of: Mapping[str, P]
    ep_of: Mapping[str, Any]
    values: Mapping[str, Any]
    partial_of: Mapping[str, str]
    notes: tuple
    choices: tuple
    warned: Warned

    @property
    def tp_modules(self) -> tuple:
        v = self.values.get("tp")
        return v.modules if v is not None else ()


def compute_axes(lv: Leaves, opts: Options, mesh: Mesh, trace: Any) -> Axes:
    module, infos = lv.module, lv.infos
    tp_of, spec_of, ep_of, values = AX.resolve(module, infos, lv.specs, lv.rule_of, opts, mesh, trace)
    tp_modules = values["tp"].modules if "tp" in values else ()
    if trace is not None and module is not None:  # first: its errors name the op that computes per-rank pieces
        CPX.check_flow(module, trace, mesh, tp_modules)  # what cp or a colwise output would compute per rank
    partial_of: dict[str, str] = {}  # replicated parameters read on tensor-parallel-sharded activations
    notes, choices, warned = [], [], []
    if tp_modules and any(mesh.axis_size(m.axis) > 1 for m in tp_modules):
        replicated = {i.name for i in infos if tp_of[i.name] is None and i.name not in ep_of and i.requires_grad}
        names = {a: i.name for i in infos if i.name in replicated for a in (i.name,) + tuple(i.aliases)}
        if trace is not None:
            tracked = {id(p): names[n] for n, p in module.named_parameters(remove_duplicate=False) if n in names}
            partial_of = tp.trace_partial_grads(module, tp_modules, trace, tracked)
        else:
            partial_of, unsure = tp.assumed_partial_grads(module, tp_modules, names)
            if unsure:
                text = tp.unsure_warning(unsure)
                warned.append((text, PlanWarning))
                notes.append(text)
        partial_of = {n: a for n, a in partial_of.items() if mesh.axis_size(a) > 1}
        if partial_of:
            choices.append(tp.partial_note(partial_of, trace is not None))
    return Axes(tp_of=tp_of, spec_of=spec_of, ep_of=ep_of, values=values, partial_of=partial_of, notes=tuple(notes),
                choices=tuple(choices), warned=tuple(warned))


# ---- 3. low precision: quantized gathers, FP8 compute ------------------------------------------------

@dataclass(frozen=True)
class Precision:
    """The gather format of each parameter (``gather_of``) and the ``nn.Linear``\\ s that compute in FP8."""
    gather_of: Mapping[str, str]
    fp8_modules: tuple
    fp8_skipped: Any
    fp8_tw: bool          # their weights gathered as float8 codes
    fp8_why: str


def low_precision(lv: Leaves, ax: Axes, opts: Options) -> Precision:
    gather_of = lowp.gather_of(opts.gather_option, [(i.name, len(i.shape), is_floating(dtype_name(i.dtype)),
                                                     i.requires_grad) for i in lv.infos])
    lowp.refuse(opts.level, opts.offload, opts.compute_axes, bool(ax.ep_of),
                next((f for f in gather_of.values() if f), ""))
    fp8_modules, fp8_skipped = F8.select(lv.module, opts.fp8_option, lv.infos, lv.owner, ax.tp_of)
    fp8_tw, fp8_why = F8.float8_gathers(fp8_modules, opts.fp8_gather, opts.level, opts.offload, opts.compute_axes,
                                        bool(ax.ep_of))
    if fp8_tw:  # [Note: FP8 compute's gathers] in lowp.py: the float8 Linears' weights, whatever gather_dtype says
        gather_of.update({m.weight: lowp.FLOAT8_TW for m in fp8_modules})
    return Precision(gather_of=gather_of, fp8_modules=tuple(fp8_modules), fp8_skipped=fp8_skipped, fp8_tw=fp8_tw,
                     fp8_why=fp8_why)


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


# ---- 6. the compute axes placed, the activation profile ---------------------------------------------

@dataclass(frozen=True)
class Placed:
    """Each axis's value placed in the units (``axes``: ``plan.axes``, with their traced calls and sizes where
    the plan is traced), and the traced activation profile."""
    axes: tuple
    profile: Any
    choices: tuple


def place_compute(lv: Leaves, ax: Axes, lay: Layout, opts: Options, mesh: Mesh, trace: Any) -> Placed:
    module, unit_plans, compute = lv.module, list(lay.units), opts.compute
    width = itemsize(compute) if compute else None
    placed, choices = AX.place(Placing(module, unit_plans, mesh, trace, width, {}), ax.values)
    profile = None
    if trace is not None:
        # [Note: the activation profile] one more traced step, forward and backward on a meta copy, measures
        # what the step keeps alive at each event; the plan stores the numbers (plan.memory adds them).
        # Under tensor parallelism the meta copy computes as one tp rank: tp-local parameter shapes, and the
        # activations each style moves (activations._tensor_parallel)
        # (expert-parallel parameters keep their global shapes: the model routes over every expert)
        tpv = placed.get("tp")
        tp_modules = tpv.modules if tpv is not None else ()
        local = {p.name: p.shape for p in lay.params if p.compute is not None and p.compute.axis in opts.compute_axes}
        styles = [(m.path, m.kind, m.style, mesh.axis_size(m.axis)) for m in tp_modules] if tp_modules else []
        finished = {m.path: False for m in tp_modules} if tp_modules else None
        profile = profile_activations(module, trace, [(u.name, u.module_paths) for u in unit_plans if u.name != ROOT],
                                      compute, local_shapes=local, styles=styles, recomputed=finished)
        if tpv is not None:  # [Note: checkpoint early stop] (tensor_parallel.py)
            placed["tp"] = dataclasses.replace(tpv, modules=tp.with_recomputed(tp_modules, finished))
    return Placed(axes=tuple(placed.values()), profile=profile, choices=tuple(choices))
