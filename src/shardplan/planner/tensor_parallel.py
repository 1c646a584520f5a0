"""Compute axes in the plan: which dimension of a parameter a compute (tensor-parallel) axis keeps
sharded while computing, and which style each module runs. Pure functions; the runtime executes the
styles with DTensor (:mod:`shardplan.runtime.tensor_parallel`).

A spec names storage axes and compute axes alike: with ``compute_axes=("tp",)``, ``P(("tp", "dp"))`` on
an ``nn.Linear`` weight (PyTorch layout ``(out, in)``) means *column-parallel over tp, FSDP over dp*:
every tp rank computes with its own ``out/tp`` rows, which are themselves stored sharded over dp and
gathered (over dp only) for compute. The compute axis must be the major axis of its dimension's entry,
so that a tp rank's rows are one contiguous block of the tensor (what DTensor's ``Shard(dim)`` holds).

Styles (``module`` kinds: ``linear`` computes ``x @ weight.T + bias``, ``embedding`` looks up rows):

=================  ==============  =====================  ================================================
style              weight dim      bias                   activations
=================  ==============  =====================  ================================================
``colwise``        linear 0,       sharded like dim 0     input replicated, output stays sharded (last dim)
                   embedding 1
``colwise_gather`` as colwise      sharded like dim 0     input replicated, output all-gathered
``rowwise``        linear 1,       replicated             input sharded (last dim; linear), output all-reduced
                   embedding 0
``rowwise_split``  linear 1        replicated             input replicated and split locally, output all-reduced
=================  ==============  =====================  ================================================

Inferred from the specs: a ``Linear`` sharded on dim 0 is ``colwise`` when a sibling ``Linear`` (same
parent module) is row-parallel, else ``colwise_gather`` (an LM head); sharded on dim 1 it is ``rowwise``
when a sibling is column-parallel, else ``rowwise_split``; an ``Embedding`` sharded on dim 0 is
vocabulary-parallel (``rowwise``), on dim 1 ``colwise_gather``. ``styles=[(module regex, style)]``
overrides the inference, and gives a style to modules of other classes (treated as ``linear``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from ..errors import PlanError, SpecError, did_you_mean
from ..mesh import Mesh
from ..spec import P
from ..units import ROOT
from .heads import _head_dim, check_whole_heads
from .kinds import (ACTIVATIONS, ALL_GATHER, ALL_REDUCE, BEGIN_BACKWARD, BEFORE_FORWARD, MODULE_BACKWARD, MODULE_FORWARD,
                    POST_BACKWARD, POST_FORWARD, PRE_BACKWARD, PRE_FORWARD, RECOMPUTE, RECOMPUTE_WHOLE)
from .schedule import program, skeleton
from .values import Compute, Op, storage_spec  # noqa: F401  (re-exported: tp.Compute, tp.storage_spec)
from ..units import run_traced

LINEAR, EMBEDDING = "linear", "embedding"
STYLES = ("colwise", "colwise_gather", "rowwise", "rowwise_split")
WEIGHT_DIM = {LINEAR: {"colwise": 0, "colwise_gather": 0, "rowwise": 1, "rowwise_split": 1},
              EMBEDDING: {"colwise": 1, "colwise_gather": 1, "rowwise": 0}}
BIAS_SHARDED = {"colwise": True, "colwise_gather": True, "rowwise": False, "rowwise_split": False}


@dataclass(frozen=True)
class TPModule:
    """One module run tensor-parallel: its path, kind (``linear``/``embedding``), style and compute axis;
    where its collectives sit in the schedule: ``unit`` (the unit whose forward calls it), ``after`` (the
    forward step it runs after) and ``back_after`` (the backward step its input's gradient forms after);
    ``shares_with``: the column-parallel sibling whose input it reads too (one gradient all-reduce for
    both, issued by that sibling), or ``""``; ``input_grad``: its input takes a gradient (a traced plan
    knows; otherwise assumed); ``recomputed``: its forward collective runs again when torch's checkpoint,
    with its default early stop, recomputes the unit (``False``: the recompute ends before it, and only a
    whole recompute repeats it; see :func:`place`)."""

    path: str
    kind: str
    style: str
    axis: str
    unit: str = ""
    after: str = ""
    back_after: str = ""
    shares_with: str = ""
    input_grad: bool = True
    recomputed: bool = True

    @property
    def input_sharded(self) -> bool:
        """Whether the module's input arrives sharded on its last dim (the output of a colwise module)."""
        return self.kind == LINEAR and self.style == "rowwise"

    @property
    def output_sharded(self) -> bool:
        return self.style == "colwise"


def as_compute_axes(compute_axes, mesh: Mesh) -> tuple[str, ...]:
    axes = (compute_axes,) if isinstance(compute_axes, str) else tuple(compute_axes or ())
    for a in axes:
        if a not in mesh.axis_names:
            raise PlanError(f"compute axis {a!r} is not an axis of {mesh!r}{did_you_mean(a, mesh.axis_names)}; name one of {mesh.axis_names} or add it "
                            f"to the mesh, e.g. Mesh(dp=2, {a}=2)")
    if len(set(axes)) != len(axes):
        raise PlanError(f"compute_axes {axes} names an axis twice")
    return axes


def compute_of(spec: P, shape: tuple[int, ...], compute_axes: Sequence[str], mesh: Mesh, *, name: str,
               rule: str) -> Optional[Compute]:
    """The compute sharding ``spec`` asks for (``None``: replicated over every compute axis)."""
    found = [(d, a) for d in range(len(spec)) for a in spec.dim_axes(d) if a in compute_axes]
    if not found:
        return None
    where = f"parameter {name!r} (shape {tuple(shape)}, spec {spec!r}, rule {rule})"
    if len(found) > 1:
        raise SpecError(f"{where} is sharded over several compute axes {[a for _, a in found]}; a parameter is "
                        f"tensor-parallel over one compute axis: keep one in its spec")
    d, axis = found[0]
    if spec.dim_axes(d)[0] != axis:
        fixed = list(spec)
        fixed[d] = (axis,) + tuple(a for a in spec.dim_axes(d) if a != axis)
        raise SpecError(f"{where}: compute axis {axis!r} must come first in its dimension's entry, so that each "
                        f"{axis} rank computes with one contiguous block; write {P(*fixed)!r}")
    size = mesh.axis_size(axis)
    if shape[d] % size:
        raise SpecError(f"{where}: dimension {d} ({shape[d]}) is not divisible by compute axis {axis!r} of size "
                        f"{size}, which tensor parallelism needs; shard another dimension over {axis!r}, change the "
                        f"mesh, or keep {axis!r} out of the spec (replicated compute)")
    return Compute(d, axis, size)


def with_compute(spec: P, dim: int, axis: str) -> P:
    """``spec`` with ``axis`` put first in ``dim``'s entry (a bias following its weight)."""
    entries = [spec.entry(d) for d in range(max(len(spec), dim + 1))]
    entries[dim] = (axis,) + tuple(a for a in spec.dim_axes(dim) if a != axis)
    return P(*entries)


def local_shape(shape: tuple[int, ...], c: Optional[Compute]) -> tuple[int, ...]:
    if c is None:
        return tuple(shape)
    return tuple(s // c.size if d == c.dim else s for d, s in enumerate(shape))


def _kind(mod) -> Optional[str]:
    import torch.nn as nn
    if isinstance(mod, nn.Embedding):
        return EMBEDDING
    if isinstance(mod, nn.Linear):
        return LINEAR
    return None


def _as_style_rules(styles) -> list[tuple[Any, str]]:
    if styles is None:
        return []
    pairs = list(styles.items()) if isinstance(styles, Mapping) else list(styles)
    out = []
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise PlanError(f"styles entry {pair!r} must be (module path regex, style name); styles: {STYLES}")
        pattern, style = pair
        if style not in STYLES:
            raise PlanError(f"styles entry {pair!r}: unknown style {style!r}; use one of {STYLES}")
        try:
            out.append((re.compile(pattern), style))
        except re.error as exc:
            raise PlanError(f"styles entry {pair!r}: bad regex: {exc}") from None
    return out


def resolve(module, names_specs: list[tuple[Any, P, str]], compute_axes: tuple[str, ...], mesh: Mesh,
            styles=None) -> tuple[dict[str, Optional[Compute]], dict[str, P], tuple[TPModule, ...]]:
    """Per parameter its compute sharding and effective spec (biases follow their weights), and the
    modules run tensor-parallel. ``names_specs``: (LeafInfo, spec, rule description) per parameter."""
    compute: dict[str, Optional[Compute]] = {}
    specs: dict[str, P] = {}
    if not compute_axes:
        return {i.name: None for i, _, _ in names_specs}, {i.name: s for i, s, _ in names_specs}, ()
    if module is None:
        raise PlanError("compute_axes= needs an nn.Module: tensor-parallel styles belong to modules, and a plain "
                        "pytree has none; plan the module, or leave compute_axes out")
    info_of = {}
    for info, spec, rule in names_specs:
        compute[info.name] = compute_of(spec, info.shape, compute_axes, mesh, name=info.name, rule=rule)
        specs[info.name] = spec
        info_of[info.name] = (info, rule)
    mods = dict(module.named_modules())
    # every module that owns a compute-sharded parameter (tied ones: every owner)
    owners: dict[str, list[tuple[str, str]]] = {}  # module path -> [(attribute, canonical name)]
    for info, _, _ in names_specs:
        for full in (info.name,) + tuple(info.aliases):
            path, _, attr = full.rpartition(".")
            owners.setdefault(path, []).append((attr, info.name))
    sharded = {path for path, ps in owners.items() if any(compute[n] is not None for _, n in ps)}
    explicit = _as_style_rules(styles)
    chosen: dict[str, tuple[str, str, str]] = {}  # path -> (kind, style, axis)
    for path in sorted(sharded, key=list(mods).index):
        mod = mods[path]
        params = dict(owners[path])
        style = next((s for rx, s in explicit if rx.fullmatch(path)), None)
        kind = _kind(mod) or (LINEAR if style else None)
        first = next(n for _, n in owners[path] if compute[n] is not None)
        c, (info, rule) = compute[first], info_of[first]
        shown = path or "<root>"
        if kind is None:
            raise PlanError(
                f"parameter {first!r} (rule {rule}) is sharded over compute axis {c.axis!r}, but its module {shown!r} "
                f"({type(mod).__name__}) has no tensor-parallel style: shardplan runs nn.Linear and nn.Embedding "
                f"tensor-parallel, and other modules given a style in styles=[(module regex, style)]. Fix: keep "
                f"{c.axis!r} out of its spec (replicated compute, e.g. P() or the data axes only)")
        extra = sorted(set(params) - {"weight", "bias"})
        if extra or "weight" not in params:
            raise PlanError(f"module {shown!r} ({type(mod).__name__}) owns compute-sharded parameter {first!r} but "
                            f"parameters {extra or list(params)} that no tensor-parallel style covers (styles shard "
                            f"'weight' and 'bias'); keep {c.axis!r} out of their specs")
        wname = params["weight"]
        wc = compute[wname]
        winfo, wrule = info_of[wname]
        if wc is None:
            raise PlanError(f"parameter {first!r} (rule {rule}) is sharded over {c.axis!r} but the weight of its module "
                            f"{shown!r} is not: a bias follows its weight. Shard {wname!r} over {c.axis!r} (column- or "
                            f"row-parallel) or keep {c.axis!r} out of the bias's spec")
        if len(winfo.shape) != 2:
            raise PlanError(f"parameter {wname!r} (rule {wrule}) has shape {winfo.shape}; tensor-parallel styles need a "
                            f"2-D weight. Keep {wc.axis!r} out of its spec")
        if style is None:
            style = _infer(kind, wc.dim, path, mods, owners, compute)
        elif WEIGHT_DIM[kind].get(style) != wc.dim:
            raise PlanError(f"styles gives module {shown!r} style {style!r}, which shards a {kind} weight on dim "
                            f"{WEIGHT_DIM[kind].get(style)}, but {wname!r}'s spec {specs[wname]!r} (rule {wrule}) shards "
                            f"dim {wc.dim} over {wc.axis!r}; change the style or the spec")
        if style not in WEIGHT_DIM[kind]:
            raise PlanError(f"style {style!r} does not apply to {kind} module {shown!r}; use one of {tuple(WEIGHT_DIM[kind])}")
        if kind == LINEAR and style == "colwise":  # its output stays sharded: the model splits it into heads
            check_whole_heads(module, mods[path.rpartition(".")[0]], path, wname, wrule, winfo.shape[0], wc.axis, wc.size)
        if "bias" in params:
            bname = params["bias"]
            bc = compute[bname]
            binfo, brule = info_of[bname]
            if BIAS_SHARDED[style]:
                want = Compute(0, wc.axis, wc.size)
                if bc is None:
                    compute[bname] = compute_of(with_compute(specs[bname], 0, wc.axis), binfo.shape, compute_axes, mesh,
                                                name=bname, rule=brule)
                    specs[bname] = with_compute(specs[bname], 0, wc.axis)
                elif bc != want:
                    raise PlanError(f"bias {bname!r} (rule {brule}) of {style} module {shown!r} must be sharded on dim 0 "
                                    f"over {wc.axis!r}, like its weight's output dimension; its spec is {specs[bname]!r}")
            elif bc is not None:
                raise PlanError(f"bias {bname!r} (rule {brule}) of row-parallel module {shown!r} is added after the "
                                f"all-reduce and must be replicated over {bc.axis!r}: keep {bc.axis!r} out of its spec")
        prev = chosen.get(path)
        if prev is not None and prev != (kind, style, wc.axis):
            raise PlanError(f"module {shown!r} would run as {prev} and {(kind, style, wc.axis)}")
        chosen[path] = (kind, style, wc.axis)
    modules = tuple(TPModule(p, *chosen[p]) for p in chosen)
    return compute, specs, modules


def _infer(kind: str, dim: int, path: str, mods: dict, owners: dict, compute: dict) -> str:
    if kind == EMBEDDING:
        return "rowwise" if dim == 0 else "colwise_gather"
    parent = path.rpartition(".")[0] if "." in path else ""
    sibling_dims = set()
    for other, ps in owners.items():
        if other == path or _kind(mods[other]) != LINEAR:
            continue
        if (other.rpartition(".")[0] if "." in other else "") != parent or other == "":
            continue
        w = dict(ps).get("weight")
        if w is not None and compute.get(w) is not None:
            sibling_dims.add(compute[w].dim)
    if dim == 0:
        return "colwise" if 1 in sibling_dims else "colwise_gather"
    return "rowwise" if 0 in sibling_dims else "rowwise_split"


# -- where the styles' collectives run: plan data -------------------------------------------------------
# [Note: activation ops. A tensor-parallel module's collectives run inside its call (its output in
# forward, its input's gradient in backward), between the steps of the units around it. The planner
# places each one after a step of the unit skeleton by module order (``named_modules``): in forward after
# the last unit boundary before the module, in backward after the mirror of the first boundary after it
# (``pre_forward(u)`` mirrors ``post_backward(u)``, ``post_forward(u)`` mirrors ``pre_backward(u)``).
# Column-parallel siblings that read one input share its gradient all-reduce (autograd sums their partial
# gradients first): the first of them issues it. Without ``trace=`` siblings of one parent module are
# assumed to read the same input (true of attention projections and gated MLPs); a traced plan knows.]

FORWARD_OP = {(LINEAR, "colwise_gather"): ALL_GATHER, (LINEAR, "rowwise"): ALL_REDUCE,
              (LINEAR, "rowwise_split"): ALL_REDUCE, (EMBEDDING, "colwise_gather"): ALL_GATHER,
              (EMBEDDING, "rowwise"): ALL_REDUCE}   # an output that leaves sharded (colwise) moves nothing
BACKWARD_OP = {(LINEAR, "colwise"): ALL_REDUCE, (LINEAR, "colwise_gather"): ALL_REDUCE,
               (LINEAR, "rowwise_split"): ALL_GATHER}  # rowwise: the gradient stays sharded; embeddings: indices


def reads_shared_input(m: TPModule) -> bool:
    return m.kind == LINEAR and m.style in ("colwise", "colwise_gather")


@dataclass(frozen=True)
class Anchor:
    """Where ops that run inside a module's call sit in the schedule: ``unit`` (the unit whose forward
    calls the module), ``after`` (the forward step they run after) and ``back_after`` (the backward step
    the module's backward runs after)."""

    unit: str
    after: str
    back_after: str


def anchors(module, paths: Sequence[str], units) -> dict[str, Anchor]:
    """The :class:`Anchor` of each module path (paths that are no module of ``module`` are left out)."""
    order: dict[str, int] = {}
    end: dict[str, int] = {}
    for i, (path, _) in enumerate(module.named_modules()):
        order[path] = i
    ordered = sorted(order, key=order.get)
    for path in ordered:  # preorder: a module's subtree is the run of paths under it
        end[path] = order[path]
        p = path
        while p:
            p = p.rpartition(".")[0]
            if p in end:
                end[p] = max(end[p], order[path])
    span = {}
    for u in units[1:]:
        ps = [p for p in u.module_paths if p in order]
        if ps:
            span[u.name] = (min(order[p] for p in ps), max(end[p] for p in ps))
    fwd, _, _ = skeleton(units)

    def key(event, at) -> float:
        if at == ROOT or event == BEFORE_FORWARD:
            return float("-inf") if event in (BEFORE_FORWARD, PRE_FORWARD) else float("inf")
        lo, hi = span.get(at, (0, 0))
        return lo - 0.5 if event == PRE_FORWARD else hi + 0.5

    def trigger(event, at) -> str:
        return f"{event}({at})" if at else f"{event}"

    def mirror(event, at) -> str:
        if at == ROOT:
            return trigger(BEGIN_BACKWARD, "")
        return trigger(POST_BACKWARD if event == PRE_FORWARD else PRE_BACKWARD, at)

    def unit_of(path: str) -> str:
        best, depth = ROOT, -1
        for u in units[1:]:
            for p in u.module_paths:
                if (path == p or path.startswith(p + ".") or p == "") and len(p) > depth:
                    best, depth = u.name, len(p)
        return best

    out = {}
    for path in paths:
        if path not in order:
            continue
        pos = order[path]
        before = [(key(e, a), i) for i, (e, a) in enumerate(fwd) if key(e, a) < pos]
        after = [(key(e, a), i) for i, (e, a) in enumerate(fwd) if key(e, a) > pos]
        e0, a0 = fwd[max(before)[1]]
        e1, a1 = fwd[min(after)[1]]
        out[path] = Anchor(unit_of(path), trigger(e0, a0), mirror(e1, a1))
    return out


def place(module, modules: Sequence[TPModule], units,
          activations: Optional[Sequence["Activation"]] = None) -> tuple[TPModule, ...]:
    """``modules`` with their unit, their forward and backward anchors, the sibling whose input each
    shares and whether that input takes a gradient (from the traced ``activations``; else siblings of one
    parent are assumed to share, and every input to take a gradient), and whether torch's checkpoint
    recomputes its forward collective (untraced: not the last one of each unit; :func:`with_recomputed`
    sets what a traced step saw).

    [Note: checkpoint early stop. torch's non-reentrant checkpoint (its default) ends a unit's recompute as
    soon as it has recomputed every tensor the forward saved for backward. In a pre-norm block the last
    module's output (the MLP's row-parallel all-reduce) only feeds the residual add, which saves nothing:
    the recompute stops inside that module, before its all-reduce. Untraced, each unit's last forward
    collective is assumed to be such a one; a traced plan knows from its checkpointed meta step
    (:func:`shardplan.activations.profile`).]"""
    shares = None if activations is None else {a.path: a.shares_with for a in activations}
    grads = {} if activations is None else {a.path: a.input_grad for a in activations}
    if not modules:
        return ()
    where = anchors(module, [m.path for m in modules], units)
    first_reader: dict[tuple[str, str], str] = {}
    out = []
    for m in modules:
        a = where.get(m.path) or anchors(module, [""], units)[""]
        if shares is not None:
            sw = shares.get(m.path, "")
        elif reads_shared_input(m):
            sw = first_reader.setdefault((m.path.rpartition(".")[0], m.axis), m.path)
            sw = "" if sw == m.path else sw
        else:
            sw = ""
        out.append(dataclasses.replace(m, unit=a.unit, after=a.after, back_after=a.back_after,
                                       shares_with=sw, input_grad=grads.get(m.path, True)))
    last = {m.unit: m.path for m in out if FORWARD_OP.get((m.kind, m.style)) and m.unit != ROOT}
    return tuple(dataclasses.replace(m, recomputed=last.get(m.unit) != m.path) for m in out)


def with_recomputed(modules: Sequence[TPModule], finished: Optional[Mapping[str, bool]]) -> tuple[TPModule, ...]:
    """``modules`` with ``recomputed`` as a traced checkpointed step saw it (``finished``: module path ->
    whether its forward ran to its end in the recompute); unchanged where ``finished`` is ``None``."""
    if finished is None:
        return tuple(modules)
    return tuple(dataclasses.replace(m, recomputed=bool(finished.get(m.path, False))) if m.unit != ROOT else m
                 for m in modules)


def activation_ops(m: TPModule, activations: Optional[Sequence["Activation"]]) -> tuple[Optional[Op], Optional[Op]]:
    """(forward op, backward op) of one placed module (``None`` where its style moves nothing)."""
    calls = [a for a in activations or () if a.path == m.path]
    out_b = sum(a.output_numel * a.itemsize for a in calls)
    in_b = sum(a.input_numel * a.itemsize for a in calls)
    fk = FORWARD_OP.get((m.kind, m.style))
    bk = None if m.shares_with or not m.input_grad else BACKWARD_OP.get((m.kind, m.style))
    fop = Op(kind=fk, unit=m.unit, what=ACTIVATIONS, event=MODULE_FORWARD, at=m.path, axes=(m.axis,),
             bytes=out_b) if fk else None
    bop = Op(kind=bk, unit=m.unit, what=ACTIVATIONS, event=MODULE_BACKWARD, at=m.path, axes=(m.axis,),
             bytes=in_b) if bk else None
    return fop, bop


@dataclass(frozen=True)
class ModuleOps:
    """Ops other kinds of parallelism run inside one module call (context-parallel attention, expert
    all-to-alls), at ``anchor``: ``forward`` in the order the call issues them, ``backward`` in the order
    its backward does."""

    anchor: Anchor
    forward: tuple[Op, ...] = ()
    backward: tuple[Op, ...] = ()


def with_activation_ops(schedule: Sequence[Op], units, modules: Sequence[TPModule], activations=None,
                        mesh: Optional[Mesh] = None, extra: Sequence[ModuleOps] = ()) -> tuple[Op, ...]:
    """``schedule`` (the units' ops) with every tensor-parallel collective inserted where it runs: forward
    ops after their ``after`` step, and in backward, after a unit's ``pre_backward`` step, the forward
    ops of its modules again (``when="recompute"``: activation checkpointing recomputes them;
    ``"recompute_whole"`` for those torch's early stop leaves out), then the
    input-gradient ops after their ``back_after`` step. Modules over a compute axis of one rank move
    nothing. ``extra``: the ops of other in-module collectives (context and expert parallelism), placed
    the same way after the tensor-parallel ones of the same step.

    [Note: within one step the ops are grouped by kind of parallelism (tensor-parallel first in forward,
    last in backward), not interleaved in call order: the schedule says which step runs them and the
    runtime issues them inside the calls; nothing waits on their relative order.]"""
    placed = [m for m in modules if m.after and (mesh is None or mesh.axis_size(m.axis) > 1)]
    if not placed and not extra:
        return tuple(schedule)
    fwd: dict[str, list[Op]] = {}
    bwd: dict[str, list[Op]] = {}
    again: dict[str, list[Op]] = {}
    for m in placed:
        fop, bop = activation_ops(m, activations)
        if fop is not None:
            fwd.setdefault(m.after, []).append(fop)
            if m.unit != ROOT:  # see [Note: checkpoint early stop] at place()
                again.setdefault(f"{PRE_BACKWARD}({m.unit})", []).append(
                    dataclasses.replace(fop, when=RECOMPUTE if m.recomputed else RECOMPUTE_WHOLE))
        if bop is not None:
            bwd.setdefault(m.back_after, []).append(bop)
    for ops in bwd.values():
        ops.reverse()  # backward meets the modules in reverse order
    extra_bwd: dict[str, list[Op]] = {}
    for x in extra:
        fwd.setdefault(x.anchor.after, []).extend(x.forward)
        if x.anchor.unit != ROOT:
            again.setdefault(f"{PRE_BACKWARD}({x.anchor.unit})", []).extend(
                dataclasses.replace(o, when=RECOMPUTE) for o in x.forward)
        extra_bwd.setdefault(x.anchor.back_after, []).insert(0, x.backward)
    for step, groups in extra_bwd.items():  # later calls' backward first, each call's own ops in order
        bwd[step] = [o for g in groups for o in g] + bwd.get(step, [])
    base = [o for o in schedule if not o.in_module]
    out: list[Op] = []
    prog = program(units, base)
    for step in prog.forward:
        out += [base[i] for i in step.ops] + fwd.get(step.name, [])
    for step in prog.backward:
        out += [base[i] for i in step.ops] + again.get(step.name, []) + bwd.get(step.name, [])
    out += [base[i] for i in prog.end.ops]
    return tuple(out)


# -- activation traffic ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Activation:
    """One traced call of a tensor-parallel module: elements of its input and output, bytes per element."""

    path: str
    input_numel: int
    output_numel: int
    itemsize: int
    shares_input: bool = False  # a column-parallel sibling read the same input first: one gradient all-reduce
    shares_with: str = ""        # that sibling's path
    input_grad: bool = True      # the input requires a gradient (else backward moves nothing for it)


def trace_activations(model, modules: Sequence[TPModule], trace, itemsize: Optional[int]) -> tuple[Activation, ...]:
    """Run the traced forward once and record each tensor-parallel module's activation sizes."""
    import torch
    seen: list[Activation] = []

    def first_tensor(x):
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, (tuple, list)):
            return next((t for t in map(first_tensor, x) if t is not None), None)
        return None

    read: list = []  # the inputs column-parallel modules read, with their axes (kept alive: ids stay unique)

    def record(m):
        shares = m.kind != EMBEDDING and m.style in ("colwise", "colwise_gather")

        def hook(_m, inputs, output):
            i, o = first_tensor(inputs), first_tensor(output)
            size = itemsize or (o.element_size() if o is not None else 4)
            first = next((p for t, a, p in read if t is i and a == m.axis), "") if shares and i is not None else ""
            if shares and i is not None and not first:
                read.append((i, m.axis, m.path))
            seen.append(Activation(m.path, i.numel() if i is not None else 0, o.numel() if o is not None else 0, size,
                                   bool(first), first, bool(i is not None and i.requires_grad)))
        return hook

    run_traced(model, trace, {m.path: ("post", record(m)) for m in modules}, grad=True)
    return tuple(seen)


def activation_bytes(modules: Sequence[TPModule], activations: Sequence[Activation], mesh: Mesh) -> int:
    """Bytes one rank sends per training step (forward + backward) for the activations the styles move
    (ring algorithms: an all-reduce sends 2(n-1)/n of the tensor, an all-gather (n-1)/n)."""
    by_path = {m.path: m for m in modules}
    total = 0
    for a in activations:
        m = by_path[a.path]
        n = mesh.axis_size(m.axis)
        out_b, in_b = a.output_numel * a.itemsize, a.input_numel * a.itemsize
        ar = lambda b: 2 * b * (n - 1) // n  # noqa: E731
        ag = lambda b: b * (n - 1) // n      # noqa: E731
        if m.kind == EMBEDDING:
            total += ag(out_b) if m.style == "colwise_gather" else ar(out_b) if m.style == "rowwise" else 0
        elif m.style == "colwise":             # backward: the input's gradient is a partial sum, reduced
            total += 0 if a.shares_input or not a.input_grad else ar(in_b)   # once for all its readers
        elif m.style == "colwise_gather":
            total += ag(out_b) + (0 if a.shares_input or not a.input_grad else ar(in_b))
        elif m.style == "rowwise":
            total += ar(out_b)                 # forward: the output is a partial sum
        else:  # rowwise_split
            total += ar(out_b) + (ag(in_b) if a.input_grad else 0)  # backward: the input's gradient, gathered
    return total


def modules_note(modules: Sequence[TPModule]) -> str:
    counts: dict[str, int] = {}
    for m in modules:
        key = f"{m.kind} {m.style} over {m.axis}"
        counts[key] = counts.get(key, 0) + 1
    return "tensor-parallel styles (inferred from the specs unless styles= named them): " + \
        ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


# -- replicated parameters inside a tensor-parallel region -----------------------------------------------
# [Note: partial gradients. Between a column-parallel module and its row-parallel sibling each rank holds
# the activations of its own heads (features). A replicated parameter read there (Qwen3's and Gemma3's
# per-head ``q_norm`` / ``k_norm``, applied to the viewed heads of ``q_proj``'s output) computes correctly,
# but its gradient on each rank sums over that rank's heads only: a partial sum over the compute axis.
# Such parameters get buffers of their own (``BufferPlan.partial_axes``) whose gradients are all-reduced
# (summed) over the compute axis before the unit's reduction: one ``all_reduce partial_grads`` op per unit,
# in the schedule. A traced plan follows the activations (which tensors derive from a column-parallel
# output, which parameters meet them); an untraced one judges the modules inside a tensor-parallel block
# by their parameters' size (a head_dim-sized one is per head, a hidden-sized one reads the block's
# replicated input) and warns about the rest. A parameter read on both kinds of activations is refused:
# part of its gradient is partial and part is whole, which no single reduction fixes.]

def _tp_blocks(modules: Sequence[TPModule]) -> dict[str, str]:
    """Parent module path -> compute axis, for parents holding a column-parallel module and a row-parallel
    one: the blocks whose activations are sharded in between."""
    kinds: dict[str, dict[str, str]] = {}
    for m in modules:
        if m.kind != LINEAR or m.style not in ("colwise", "rowwise"):
            continue
        parent = m.path.rpartition(".")[0]
        kinds.setdefault(parent, {})[m.style] = m.axis
    return {p: k["colwise"] for p, k in kinds.items() if "colwise" in k and "rowwise" in k}


def _replicated_owners(module, modules: Sequence[TPModule], tracked: Mapping[str, str]):
    """(module path, module, [(attribute, plan name)]) of the non-tensor-parallel modules holding tracked
    (replicated, trainable) parameters directly."""
    tp_paths = {m.path for m in modules}
    for path, mod in module.named_modules():
        if path in tp_paths:
            continue
        own = [(attr, tracked[f"{path}.{attr}" if path else attr]) for attr, _ in mod.named_parameters(recurse=False)
               if (f"{path}.{attr}" if path else attr) in tracked]
        if own:
            yield path, mod, own


def assumed_partial_grads(module, modules: Sequence[TPModule], tracked: Mapping[str, str]
                          ) -> tuple[dict[str, str], list[str]]:
    """Without a trace: ({plan name: compute axis} of the replicated parameters taken to read sharded
    activations, [descriptions of the ones inside a tensor-parallel block that cannot be judged]).
    ``tracked``: every name (aliases too) of the replicated trainable parameters -> plan name."""
    blocks = _tp_blocks(modules)
    if not blocks:
        return {}, []
    mods = dict(module.named_modules())
    partial: dict[str, str] = {}
    unsure: list[str] = []
    for path, mod, own in _replicated_owners(module, modules, tracked):
        block = next((b for b in sorted(blocks, key=len, reverse=True) if path.startswith(b + ".") or
                      (b == "" and path)), None)
        if block is None:
            continue
        parent = mods[block]
        head_dim, _ = _head_dim(parent, getattr(parent, "config", None) or getattr(module, "config", None))
        widths = {mods[m.path].weight.shape[1] for m in modules
                  if m.path.rpartition(".")[0] == block and m.style == "colwise" and hasattr(mods[m.path], "weight")}
        shapes = [tuple(getattr(mod, attr).shape) for attr, _ in own]
        if all(len(s) == 1 and head_dim and s[0] == head_dim and s[0] not in widths for s in shapes):
            partial.update((name, blocks[block]) for _, name in own)   # per head: reads the heads this rank holds
        elif not all(len(s) == 1 and s[0] in widths for s in shapes):  # (hidden-sized: the block's replicated input)
            unsure.append(f"module {path!r} in block {block!r} ({', '.join(f'{n} {s}' for (_, n), s in zip(own, shapes))})")
    return partial, unsure


def trace_partial_grads(model, modules: Sequence[TPModule], trace, tracked: Mapping[int, str]) -> dict[str, str]:
    """{plan name: compute axis} of the replicated parameters that the traced forward combines with
    activations computed from a column-parallel output (before its row-parallel sibling reduces them).
    ``tracked``: ``id(parameter)`` -> plan name of the replicated trainable parameters. A parameter read on
    both sharded and replicated activations raises :class:`PlanError`."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary

    sharded = WeakIdKeyDictionary()   # tensor -> compute axis: a colwise output, or computed from one
    derived = WeakIdKeyDictionary()   # tensor -> plan names of the parameters it was computed from alone
    partial: dict[str, tuple[str, str]] = {}  # name -> (axis, where)
    whole: dict[str, str] = {}                # name -> where it met replicated activations
    mixed: list = []                          # (axis, where, module): a replicated activation with a gradient met
    inside = [0]                              # depth of tensor-parallel module calls (DTensor handles theirs)
    stack: list[str] = []                     # the module calls the forward is in

    def fname(func) -> str:
        return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if inside[0]:
                return out
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            axes = sorted({sharded[t] for t in ins if t in sharded})
            params: set = set()
            other = False
            for t in ins:
                n = tracked.get(id(t))
                if n is not None:
                    params.add(n)
                elif t in derived:
                    params |= derived[t]
                elif t not in sharded:
                    other = True
                    if axes and t.requires_grad and not isinstance(t, torch.nn.Parameter) and not mixed:
                        mixed.append((axes[0], fname(func), stack[-1] if stack else ""))
            if not axes and not params:
                return out
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if axes:
                for n in params:
                    partial.setdefault(n, (axes[0], fname(func)))
                for t in outs:
                    sharded[t] = axes[0]
            elif other:
                for n in params:
                    whole.setdefault(n, fname(func))
            else:
                for t in outs:
                    derived[t] = frozenset(params) | derived.get(t, frozenset())
            return out

    def enter(_m, _a):
        inside[0] += 1

    def leave(m):
        def hook(_m, _a, out):
            inside[0] -= 1
            if m.style == "colwise":
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        sharded[t] = m.axis
        return hook

    def push(path):
        def hook(_m, _a):
            stack.append(path)
        return hook

    def pop(_m, _a, _out):
        if stack:
            stack.pop()

    mods = dict(model.named_modules())
    handles = []
    try:
        for path, mod in mods.items():
            handles.append(mod.register_forward_pre_hook(push(path or "<root>")))
            handles.append(mod.register_forward_hook(pop))
        for m in modules:
            handles.append(mods[m.path].register_forward_pre_hook(enter))
            handles.append(mods[m.path].register_forward_hook(leave(m)))
        with Reads():
            run_traced(model, trace, {}, grad=True)  # (with autograd: which activations take a gradient)
    finally:
        for h in handles:
            h.remove()
    if mixed:
        axis, where, path = mixed[0]
        raise PlanError(
            f"the traced forward of module {path!r} combines (at {where}) activations sharded over compute axis "
            f"{axis!r} (computed from a column-parallel module's output) with a replicated activation that takes a "
            f"gradient (e.g. keys or values whose projection keeps {axis!r} out of its spec, read by sharded queries): "
            f"on each rank that activation's gradient would sum over this rank's heads only, a partial sum no "
            f"collective adds up, so the parameters and inputs behind it would train on a wrong gradient. Fix: shard "
            f"that projection over {axis!r} too (column-parallel, whole heads per rank), or keep {axis!r} out of the "
            f"specs of the column-parallel projection(s) it meets")
    both = sorted(set(partial) & set(whole))
    if both:
        n = both[0]
        raise PlanError(
            f"parameter {n!r} is replicated over compute axis {partial[n][0]!r} but the traced forward reads it both "
            f"on activations sharded over {partial[n][0]!r} (a column-parallel module's output, at {partial[n][1]}) "
            f"and on replicated ones (at {whole[n]}): its gradient would be partly a per-rank partial sum and partly "
            f"whole, which no single reduction makes right. Fix: give the two uses separate parameters (modules), or "
            f"keep {partial[n][0]!r} out of the specs of the column-parallel projection feeding it")
    return {n: a for n, (a, _) in partial.items()}


def partial_note(partial: Mapping[str, str], traced: bool, unsure: Sequence[str] = ()) -> str:
    """The plan's note on replicated parameters read on sharded activations."""
    names = sorted(partial)
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    how = "the traced forward reads them on" if traced else "by their size (head_dim) they read"
    return (f"{len(names)} replicated parameter(s) ({shown}): {how} activations sharded over "
            f"{sorted(set(partial.values()))} (between a column-parallel module and its row-parallel sibling), so "
            f"each rank's gradient is a partial sum: their buffers' gradients are all-reduced (summed) over it "
            f"before the reduction (all_reduce partial_grads)")


def unsure_warning(unsure: Sequence[str]) -> str:
    return (f"{len(unsure)} replicated parameter(s) sit inside tensor-parallel blocks (between a column-parallel "
            f"module and its row-parallel sibling): {'; '.join(unsure[:4])}{' ...' if len(unsure) > 4 else ''}. "
            f"Without trace= the planner assumes they read the block's replicated activations; one that reads the "
            f"column-parallel output (per-head features) would get a per-rank partial gradient. Plan with "
            f"trace=example inputs: the planner then follows the activations and sums such gradients over the "
            f"compute axis")
