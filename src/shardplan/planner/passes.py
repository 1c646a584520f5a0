"""The planner's passes, in the order ``compiler.plan`` runs them; each a pure function with one job, reading
the checked :class:`~shardplan.planner.options.Options` and the earlier passes' frozen results:

1. :func:`match_rules`: the model's leaves, the rule each matched, the unit each belongs to (in traced order);
2. :func:`compute_axes`: every compute axis resolved (:mod:`.axes`: tensor-parallel styles, expert modules), the
   traced flow check, partial gradients;
3. :func:`low_precision`: which parameters gather quantized, which ``nn.Linear``\\ s compute in FP8;
4. ``grouping.group_units``: each unit's members, small units merged, their parents, the FP8 modules' final units;
5. ``grouping.lay_out``: each unit's buffers (layouts, dtypes, axes) and each parameter's place in them;
6. :func:`place_compute`: every compute axis traced and placed in the units (``plan.axes``), the traced
   activation profile.

A pass returns what the plan notes (``choices``: ``plan.notes``), what it warns (``notes``: ``plan.warnings``) and
the warnings ``plan()`` emits (``warned``: (message, category) pairs); it never warns itself, so that every
warning points at ``shardplan.plan``'s caller."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from .. import lowp
from ..activations import profile as profile_activations
from ..auto import find_units
from ..dtypes import dtype_name, is_floating, itemsize
from ..errors import PlanError, PlanWarning
from ..mesh import Mesh
from ..rules import as_rules, match_leaves, regex_list_source
from ..spec import P
from ..units import assign_units, check_entries, collect_leaves, module_classes, trace_order
from . import axes as AX
from . import context_parallel as CPX
from . import float8 as F8
from . import tensor_parallel as tp
from .axis import Placing
from .options import Options
from .schedule import ROOT

if TYPE_CHECKING:  # annotations only: pass 5's result
    from .grouping import Layout

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
