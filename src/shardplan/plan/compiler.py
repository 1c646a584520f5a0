"""``shardplan.plan``: rules + a mesh + options -> a :class:`Plan`. Pure: no process group, no GPU."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

from .. import layout as L
from .. import lowp
from ..activations import profile as profile_activations
from ..dtypes import dtype_name, is_floating, itemsize
from ..errors import MeshError, PlanError, PlanWarning
from ..mesh import Mesh
from ..rules import Rules, as_rules, match_leaves, regex_list_source
from ..spec import P
from ..units import assign_units, check_entries, collect_leaves, module_classes, trace_order
from ..auto import choose_min_unit_bytes, find_units, merge_note, root_unit_warning
from . import geometry
from . import offload as OFF
from . import context_parallel as CPX
from . import expert_parallel as EP
from . import float8 as F8
from . import tensor_parallel as tp
from .accounting import plan_warnings
from .facade import Plan
from .kinds import STRATEGIES, LayoutChoice, Offload, Order, Strategy, choose, strategy_level
from .schedule import ROOT, build_schedule
from .validate import validate
from .values import BufferPlan, ParamPlan, UnitPlan, buffer_facts


def _parents(order: Sequence[str], paths: dict[str, tuple[str, ...]]) -> dict[str, str]:
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
    the specs (or named in ``styles=[(module regex, style)]``); see :mod:`shardplan.plan.tensor_parallel`.

    >>> plan = shardplan.plan(model, rules, Mesh(dp=2, tp=2), compute_axes=("tp",))

    ``layout="chunked"`` gives every rank the ``torch.chunk`` piece of each sharded dimension (FSDP2's and
    DTensor's layout: ``model.state_dict()`` then returns DTensors that are views of the shards) instead of
    the planner's choice (``"auto"``: whole rows packed contiguously where that costs little padding, which
    saves the copy-out after each gather).

    ``offload="optimizer"`` keeps the master shards and the optimizer state in host memory and steps them
    there (train with :func:`shardplan.offload_optimizer`); ``offload="params"`` (ZeRO-3) also keeps the
    parameter shards there, copied in ahead of each gather; ``offload_fraction=f`` offloads only that share
    of the buffers (see :mod:`shardplan.plan.offload` and docs/offload.md); ``offload_fraction="auto"``
    with ``device_memory=`` (bytes per device) takes the smallest fraction whose device peak fits.

    >>> plan = shardplan.plan(model, rules, Mesh(dp=8), offload="optimizer")
    >>> plan.memory().host                       # bytes of host memory per rank
    >>> plan = shardplan.plan(model, rules, Mesh(dp=8), offload="optimizer", offload_fraction="auto",
    ...                       device_memory=80 * 2**30)

    ``expert_axes`` (default: the mesh's ``ep`` axis, if any) splits the stacked weights of expert modules
    by expert where a spec puts it first in dim 0 (expert parallelism, :mod:`shardplan.plan.expert_parallel`);
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
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be a shardplan.Mesh, e.g. Mesh(dp=8); got {type(mesh).__name__}")
    if world_size is not None and world_size != mesh.size:
        raise MeshError(f"mesh {mesh!r} has {mesh.size} ranks but the world size is {world_size}; "
                        f"make the axis sizes multiply to {world_size}")
    level = strategy_level(strategy)
    offload, offload_fraction = OFF.check(offload, offload_fraction, level, device_memory)
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise PlanError(f"prefetch must be a non-negative integer (units gathered ahead); got {prefetch!r}")
    order = choose(Order, order, "order")
    layout = choose(LayoutChoice, layout, "layout")
    if min_unit_bytes is not None and (not isinstance(min_unit_bytes, int) or min_unit_bytes < 0):
        raise PlanError(f"min_unit_bytes must be None (chosen for you) or a non-negative number of bytes; "
                        f"got {min_unit_bytes!r}")
    compute, reduce = dtype_name(compute_dtype), dtype_name(reduce_dtype)
    reduce_quant = lowp.reduce_format(reduce)
    # [Note: quantized reduction] reduce_dtype='int8': the buffers reduce into fp32; the plan keeps the option's name
    for what, name in (("compute_dtype", compute), ("reduce_dtype", reduce)):
        if name is not None and not is_floating(name) and not (what == "reduce_dtype" and reduce_quant):
            # a cast to an integer type would zero the numbers
            hint = (" or 'int8' (a quantized reduction); quantized gathers: gather_dtype='int8'"
                    if what == "reduce_dtype" else "")
            raise PlanError(f"{what}={name!r} is not a floating dtype; use e.g. 'bfloat16' or 'float32'{hint}")
        if name is not None and not (what == "reduce_dtype" and reduce_quant) and itemsize(name) < 2:
            # [Note: sub-16-bit floats] a float8 reduction would sum float8 values on the wire (gloo and NCCL have no
            # float8 sum: the first backward fails on every rank), and float8 compute needs scaled matmuls
            hint = ("a quantized reduction: reduce_dtype='int8' (block-scaled, summed in fp32), or 'bfloat16'"
                    if what == "reduce_dtype" else
                    "FP8 compute: fp8='torchao' (float8 matmuls with scales); float8 gathers: "
                    "gather_dtype='float8_e4m3fn'; or compute_dtype='bfloat16'")
            raise PlanError(f"{what}={name!r} is not supported: shardplan has no {name} "
                            f"{'gradient reduction' if what == 'reduce_dtype' else 'compute'} "
                            f"(docs/low_precision.md, 'Not yet'); use {hint}")
    compute_axes = tp.as_compute_axes(compute_axes, mesh)
    gather_option = lowp.as_option(gather_dtype)
    fp8_option = F8.as_option(fp8)
    expert_axes = EP.as_expert_axes(expert_axes, mesh, compute_axes)
    if reduce_quant:
        lowp.refuse_reduce(level, offload, compute_axes, bool(expert_axes))
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
    for w in caught:
        warnings.warn(w.message, w.category, stacklevel=2)
    notes += [str(w.message) for w in caught]

    rule_of = {info.name: rule.describe() for info, (_, rule) in zip(infos, matched)}
    tp_of, spec_of, tp_modules = tp.resolve(module, [(i, s, rule_of[i.name]) for i, (s, _) in zip(infos, matched)],
                                            compute_axes, mesh, styles)
    ep_of, expert_modules = EP.resolve(module, [(i, spec_of[i.name], rule_of[i.name]) for i in infos], expert_axes, mesh)
    for name, c in ep_of.items():
        if tp_of[name] is not None:
            raise PlanError(f"parameter {name!r} (rule {rule_of[name]}) is split over expert axis {c.axis!r} and "
                            f"tensor-parallel over {tp_of[name].axis!r}; one compute axis per parameter: keep "
                            f"{tp_of[name].axis!r} out of its spec")
        tp_of[name] = c
    if trace is not None and module is not None:  # first: its errors name the op that computes per-rank pieces
        CPX.check_flow(module, trace, mesh, tp_modules)  # what cp or a colwise output would compute per rank
    partial_of: dict[str, str] = {}  # replicated parameters read on tensor-parallel-sharded activations
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
                warnings.warn(text, PlanWarning, stacklevel=2)
                notes.append(text)
        partial_of = {n: a for n, a in partial_of.items() if mesh.axis_size(a) > 1}
        if partial_of:
            choices.append(tp.partial_note(partial_of, trace is not None))
    gather_of = lowp.gather_of(gather_option, [(i.name, len(i.shape), is_floating(dtype_name(i.dtype)), i.requires_grad)
                                               for i in infos])
    lowp.refuse(level, offload, compute_axes, bool(ep_of), next((f for f in gather_of.values() if f), ""))
    fp8_modules, fp8_skipped = F8.select(module, fp8_option, infos, owner, tp_of)
    fp8_tw, fp8_why = F8.float8_gathers(fp8_modules, fp8_gather, level, offload, compute_axes, bool(ep_of))
    if fp8_tw:  # [Note: FP8 compute's gathers] in lowp.py: the float8 Linears' weights, whatever gather_dtype says
        gather_of.update({m.weight: lowp.FLOAT8_TW for m in fp8_modules})
    members: dict[str, list] = {u: [] for u in [ROOT] + unit_order}
    for info in infos:  # the layout sees what one tensor-parallel rank stores: its local shape, storage axes
        c = tp_of[info.name]
        local = dataclasses.replace(info, shape=tp.local_shape(info.shape, c))
        own = compute_axes + ((c.axis,) if info.name in ep_of else ())
        members[owner[info.name]].append((local, tp.storage_spec(spec_of[info.name], own)))
    parent = _parents(unit_order, {u: (u,) for u in unit_order})
    large_root = _large_root_warning(members, level, suggest)
    if large_root:
        warnings.warn(large_root, PlanWarning, stacklevel=2)
        notes.append(large_root)
    sizes = [_unit_bytes(members[u]) for u in unit_order]
    automatic, why = min_unit_bytes is None, ""
    if automatic:
        min_unit_bytes, why = choose_min_unit_bytes(sizes)
    before = len(unit_order)
    unit_order, members, covers = _merge_small_units(unit_order, members, min_unit_bytes, parent)
    if automatic or len(unit_order) != before:
        merged = [(len(covers.get(u, (u,))), _unit_bytes(members[u])) for u in unit_order]
        choices.append(merge_note(min_unit_bytes, sizes, merged, why, automatic))
    paths = {u: covers.get(u, (u,)) for u in unit_order}
    parent = _parents(unit_order, paths)

    if fp8_modules:  # the units they ended in (after merging)
        final = {i.name: u for u, m in members.items() for i, _ in m}
        fp8_modules = tuple(dataclasses.replace(m, unit=final[m.weight]) for m in fp8_modules)
        choices.append(F8.note(fp8_modules, fp8_skipped, fp8_tw, fp8_why))
        notes += F8.warnings(fp8_modules, F8.tokens_of(trace) if trace is not None else None)
    params: dict[str, ParamPlan] = {}
    buffers: list[BufferPlan] = []
    unit_plans: list[UnitPlan] = []
    # reshard_after_forward: one flag for every unit, or {unit: flag} (the rest: True), as
    # Plan.with_reshard_after_forward takes it and Plan.declarative() writes it for a plan with mixed flags
    raf_of = dict(reshard_after_forward) if isinstance(reshard_after_forward, Mapping) else None
    if raf_of is not None:
        raf_of.pop(ROOT, None)  # the root is never freed after its forward (as with_reshard_after_forward)
        bad = sorted(k for k, v in raf_of.items() if not isinstance(v, bool))
        if bad:
            raise PlanError(f"reshard_after_forward: the flags of {bad} are not True/False")
        unknown = sorted(set(raf_of) - set(unit_order))
        if unknown:
            raise PlanError(f"reshard_after_forward names unit(s) {unknown} that the plan does not have; its units: "
                            f"{unit_order[:8]}{' ...' if len(unit_order) > 8 else ''}")
    for uname in [ROOT] + unit_order:
        idxs = []
        # [Note: expert weights get buffers of their own: their gradients are not reduced over the expert axis
        # (every ep rank's tokens already reached them through the all-to-all), dense ones' are]
        # [Note: partial gradients] (plan/tensor_parallel.py) replicated parameters read on sharded activations
        # get buffers of their own too: their gradients are summed over the compute axis first
        dense = [m for m in members[uname] if m[0].name not in ep_of and m[0].name not in partial_of]
        experts = [m for m in members[uname] if m[0].name in ep_of]
        laid = [(k, v, compute_axes, ()) for k, v in geometry.layout_unit(dense, mesh, level, compute, layout,
                                                                          gather_of).items()]
        for axis in sorted(set(partial_of.values())):
            part = [m for m in members[uname] if partial_of.get(m[0].name) == axis]
            laid += [(k, v, compute_axes, (axis,))
                     for k, v in (geometry.layout_unit(part, mesh, level, compute, layout, gather_of).items()
                                  if part else ())]
        laid += [(k, v, compute_axes + expert_axes, ())
                 for k, v in (geometry.layout_unit(experts, mesh, level, compute, layout).items() if experts else ())]
        for (dtype, rg, axes, _, fmt), (placement, mem), not_reduced, partial_axes in laid:
            cdt = compute if compute and is_floating(dtype) else dtype
            rq = reduce_quant if reduce_quant and rg and is_floating(dtype) and placement.layout != L.REPLICATED else ""
            rdt = "float32" if reduce_quant and is_floating(dtype) else reduce if reduce and is_floating(dtype) else cdt
            group = mesh.axis_size(axes) if axes else 1
            b = BufferPlan(index=len(buffers), unit=uname, dtype=dtype, compute_dtype=cdt, reduce_dtype=rdt,
                           layout=placement.layout, axes=axes,
                           replica_axes=tuple(a for a in mesh.axis_names if a not in axes and a not in not_reduced),
                           group_size=group, shard_numel=placement.shard_numel,
                           numel=sum(math.prod(i.shape) for i, _ in mem), params=tuple(i.name for i, _ in mem),
                           requires_grad=rg, gather_dtype=fmt, reduce_quant=rq, partial_axes=partial_axes if rg else (),
                           **buffer_facts(placement.layout, level, group, dtype, cdt, rdt))
            if rq and b.replica_axes and mesh.axis_size(b.replica_axes) > 1:
                raise PlanError(f"reduce_dtype='int8' with replica axes {b.replica_axes} (HSDP) is not supported yet: "
                                f"shard the parameters over every data axis, or use reduce_dtype='float32'")
            buffers.append(b)
            idxs.append(b.index)
            for (info, _), off in zip(mem, placement.offsets):
                c = tp_of[info.name]
                spec = spec_of[info.name] if level else (tp.with_compute(P(), c.dim, c.axis) if c else P())
                params[info.name] = ParamPlan(name=info.name, shape=info.shape, dtype=dtype, spec=spec,
                                              rule=rule_of[info.name], unit=uname, buffer=b.index, offset=off,
                                              requires_grad=info.requires_grad, aliases=info.aliases, compute=c)
        # [Note: every unit but the root is freed after its forward, the last one too (FSDP2's default), and
        # gathered again at its pre_backward, after the root's backward (the head and its loss), where the
        # step's peak usually is: holding it there, or prefetching it as backward begins, adds its full size
        # to the peak (+98 MiB on the 1B GPT, measured). torchtitan keeps the last block gathered instead,
        # which saves that all-gather: ``plan.with_reshard_after_forward({last: False})``]
        raf = (raf_of.get(uname, True) if raf_of is not None else bool(reshard_after_forward)) and uname != ROOT
        unit_plans.append(UnitPlan(name=uname, buffers=tuple(idxs), reshard_after_forward=raf,
                                   modules=covers.get(uname, ()), parent=parent.get(uname, ROOT)))
    activations = None
    if tp_modules:
        choices.append(tp.modules_note(tp_modules))
        if trace is not None:
            activations = tp.trace_activations(module, tp_modules, trace, itemsize(compute) if compute else None)
        tp_modules = tp.place(module, tp_modules, unit_plans, activations)
    expert_calls = None
    if expert_modules:
        choices.append(EP.modules_note(expert_modules))
        if trace is not None:
            expert_calls = EP.trace_calls(module, expert_modules, trace, itemsize(compute) if compute else None)
        expert_modules = EP.place(module, expert_modules, unit_plans)
    context_calls = None
    if trace is not None and CPX.CONTEXT_AXIS in mesh.axis_names:
        traced = CPX.trace_calls(module, trace, itemsize(compute) if compute else None, mesh)
        context_calls = CPX.place(module, CPX.per_rank(traced, tp_modules, mesh), unit_plans)
        choices.append(CPX.calls_note(context_calls, mesh))
    profile = None
    param_plans, units_ = tuple(params[i.name] for i in infos), tuple(unit_plans)
    if trace is not None:
        # [Note: the activation profile] one more traced step, forward and backward on a meta copy, measures
        # what the step keeps alive at each event; the plan stores the numbers (plan.memory adds them).
        # Under tensor parallelism the meta copy computes as one tp rank: tp-local parameter shapes, and the
        # activations each style moves (activations._tensor_parallel)
        # (expert-parallel parameters keep their global shapes: the model routes over every expert)
        local = {p.name: p.shape for p in param_plans if p.compute is not None and p.compute.axis in compute_axes}
        styles = [(m.path, m.kind, m.style, mesh.axis_size(m.axis)) for m in tp_modules] if tp_modules else []
        finished = {m.path: False for m in tp_modules} if tp_modules else None
        profile = profile_activations(module, trace, [(u.name, u.module_paths) for u in unit_plans if u.name != ROOT],
                                      compute, local_shapes=local, styles=styles, recomputed=finished)
        tp_modules = tp.with_recomputed(tp_modules, finished)  # [Note: checkpoint early stop] (tensor_parallel.py)
    planned = buffers

    def build(fraction) -> Plan:
        buffers = planned
        if offload is not None:
            hosted = OFF.choose_offloaded(buffers, unit_plans, level=level, offload=offload, fraction=fraction)
            buffers = [dataclasses.replace(b, offload=hosted.get(b.index, "")) for b in buffers]
        schedule = tp.with_activation_ops(build_schedule(unit_plans, buffers, mesh, level, prefetch, order, len(infos)),
                                          unit_plans, tp_modules, activations, mesh,
                                          CPX.module_ops(context_calls, mesh) + EP.module_ops(expert_modules, expert_calls))
        buffers_ = tuple(buffers)
        return Plan(mesh=mesh, strategy=STRATEGIES[level], compute_dtype=compute, reduce_dtype=reduce, prefetch=prefetch,
                    reshard_after_forward=all(u.reshard_after_forward for u in unit_plans[1:]) if raf_of is not None
                    else reshard_after_forward, optimizer_states=optimizer_states, params=param_plans,
                    buffers=buffers_, units=units_, schedule=schedule,
                    warnings=tuple(notes) + plan_warnings(mesh, param_plans, buffers_, units_), order=order,
                    notes=tuple(choices), min_unit_bytes=min_unit_bytes, compute_axes=compute_axes,
                    tp_modules=tp_modules, tp_activations=activations, layout=layout,
                    offload=offload, offload_fraction=fraction, activations=profile,
                    expert_axes=expert_axes if expert_modules else (), expert_modules=expert_modules,
                    expert_calls=expert_calls, context_calls=context_calls, fp8_modules=fp8_modules)

    if offload_fraction == OFF.AUTO:  # [Note: the automatic fraction] in plan/offload.py
        ranks = range(mesh.size) if mesh.size <= 64 else sorted({r * (mesh.size - 1) // 63 for r in range(64)})

        def peak(f: float) -> tuple[int, int]:
            p = build(f)
            return max((p.memory(r).peak, r) for r in ranks)

        offload_fraction = OFF.smallest_fitting(OFF.prefix_fractions(planned, unit_plans), peak, device_memory)
        choices.append(f"offload_fraction={offload_fraction:.6g}: the smallest share of the trainable shard bytes "
                       f"whose device peak fits device_memory={int(device_memory):,d} B (offload_fraction='auto')")
    result = build(offload_fraction)
    validate(result)  # the builder's own schedules obey the rules edited ones must
    return result
