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
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from ..mesh import Mesh
from ..units import ROOT, run_traced
from .axis import Anchor, ComputeAxis, ModuleOps, Placing, Resolved, Resolving, anchors
from .kinds import (ACTIVATIONS, ALL_GATHER, ALL_REDUCE, MODULE_BACKWARD, MODULE_FORWARD, RECOMPUTE,
                    RECOMPUTE_WHOLE)
# [Note: the styles and the partial gradients live in tp_styles.py and tp_partial.py; their names are re-exported
# here, the tensor-parallel axis's home (tp.resolve, tp.TPModule, tp.trace_partial_grads, ...)]
from .tp_partial import assumed_partial_grads, partial_note, trace_partial_grads, unsure_warning  # noqa: F401
from .tp_styles import (BIAS_SHARDED, EMBEDDING, LINEAR, STYLES, WEIGHT_DIM, TPModule, as_compute_axes,  # noqa: F401
                        compute_of, local_shape, resolve, with_compute)
from .ops import Op
from .values import Compute, storage_spec  # noqa: F401  (re-exported: tp.Compute, tp.storage_spec)

# -- where the styles' collectives run: plan data -------------------------------------------------------
# [Note: activation ops] (axis.py): a tensor-parallel module's collectives run inside its call (its output in
# forward, its input's gradient in backward), placed like every axis's. Column-parallel siblings that read one
# input share its gradient all-reduce (autograd sums their partial gradients first): the first of them issues it. Without ``trace=`` siblings of one parent module are
# assumed to read the same input (true of attention projections and gated MLPs); a traced plan knows.]

FORWARD_OP = {(LINEAR, "colwise_gather"): ALL_GATHER, (LINEAR, "rowwise"): ALL_REDUCE,
              (LINEAR, "rowwise_split"): ALL_REDUCE, (EMBEDDING, "colwise_gather"): ALL_GATHER,
              (EMBEDDING, "rowwise"): ALL_REDUCE}   # an output that leaves sharded (colwise) moves nothing
BACKWARD_OP = {(LINEAR, "colwise"): ALL_REDUCE, (LINEAR, "colwise_gather"): ALL_REDUCE,
               (LINEAR, "rowwise_split"): ALL_GATHER}  # rowwise: the gradient stays sharded; embeddings: indices


def reads_shared_input(m: TPModule) -> bool:
    return m.kind == LINEAR and m.style in ("colwise", "colwise_gather")


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



# -- the axis ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorAxisPlan:
    """Tensor parallelism in a plan (``plan.axis("tp")``; :func:`of`): the compute axes, the modules run
    tensor-parallel (styles, places), the traced activation sizes (``None``: not traced).

    >>> plan.axis("tp").module("layers.0.attention.wq").style
    'colwise'
    """

    axes: tuple[str, ...]
    modules: tuple[TPModule, ...] = ()
    activations: Optional[tuple[Activation, ...]] = None
    kind = "tp"

    def module(self, path: str) -> Optional[TPModule]:
        """The module at ``path`` run tensor-parallel, or ``None``."""
        return next((m for m in self.modules if m.path == path), None)


def of(plan) -> TensorAxisPlan:
    """``plan``'s tensor parallelism: its ``tp`` axis value, or an empty one (no compute axes, no modules)."""
    return next((v for v in plan.axes if v.kind == "tp"), _NONE)


_NONE = TensorAxisPlan(())


class TensorAxis(ComputeAxis):
    """The ``tp`` axes (``compute_axes=``): styles from the specs, their collectives inside the modules' calls."""

    kind, op_order, fallback, phrase = "tp", 0, True, "tensor-parallel over"

    def resolve(self, ctx: Resolving) -> Optional[Resolved]:
        axes = ctx.opts.compute_axes
        compute, specs, modules = resolve(ctx.module, list(ctx.names_specs), axes, ctx.mesh, ctx.opts.styles)
        return Resolved(TensorAxisPlan(axes, modules) if axes else None, compute, specs)

    def place(self, ctx: Placing, value: Optional[TensorAxisPlan]) -> Optional[TensorAxisPlan]:
        if value is None or not value.modules:
            return value
        activations = None
        if ctx.trace is not None:
            activations = trace_activations(ctx.module, value.modules, ctx.trace, ctx.itemsize)
        return dataclasses.replace(value, modules=place(ctx.module, value.modules, ctx.units, activations),
                                   activations=activations)

    def module_ops(self, value: Optional[TensorAxisPlan], mesh: Mesh) -> tuple[ModuleOps, ...]:
        """Per placed module over a compute axis of more than one rank: its forward and backward op (none
        where its style moves nothing); the forward one repeats in a recompute unless torch's early stop
        leaves it out (``recompute_whole``: see [Note: checkpoint early stop] at :func:`place`)."""
        out = []
        for m in (value.modules if value is not None else ()):
            if not m.after or mesh.axis_size(m.axis) <= 1:
                continue
            fop, bop = activation_ops(m, value.activations)
            out.append(ModuleOps(Anchor(m.unit, m.after, m.back_after), (fop,) if fop else (), (bop,) if bop else (),
                                 RECOMPUTE if m.recomputed else RECOMPUTE_WHOLE))
        return tuple(out)

    def comm_bytes(self, plan, value: Optional[TensorAxisPlan]) -> dict:
        if value is None:
            return {}
        acts = value.activations
        return {"tensor_parallel": None if acts is None else activation_bytes(value.modules, acts, plan.mesh)}

    def note(self, value: Optional[TensorAxisPlan], mesh: Mesh) -> Optional[str]:
        return modules_note(value.modules) if value is not None and value.modules else None

    def check_op(self, plan, value: Optional[TensorAxisPlan], op: Op) -> Optional[str]:
        m = next((m for m in (value.modules if value is not None else ()) if m.path == op.at), None)
        if m is None:
            return f"moves activations of {op.at!r}, which is no tensor-parallel module of the plan"
        if op.kind not in (ALL_GATHER, ALL_REDUCE) or op.event not in (MODULE_FORWARD, MODULE_BACKWARD):
            return ("a tensor-parallel module's activations are all-gathered or all-reduced at module_forward or "
                    "module_backward")
        if tuple(op.axes) != (m.axis,) or op.unit != m.unit:
            return (f"runs over axes {tuple(op.axes)} in unit {op.unit!r}; the module computes over ({m.axis!r},) in "
                    f"unit {m.unit!r}")
        return None

    def to_dict(self, value: Optional[TensorAxisPlan]) -> dict:
        if value is None:
            return {}
        return {"compute_axes": list(value.axes), "tp_modules": [dataclasses.asdict(m) for m in value.modules],
                "tp_activations": None if value.activations is None
                else [dataclasses.asdict(a) for a in value.activations]}

    def from_dict(self, d: Mapping[str, Any]) -> Optional[TensorAxisPlan]:
        if not d.get("compute_axes"):
            return None
        acts = d.get("tp_activations")
        return TensorAxisPlan(tuple(d["compute_axes"]), tuple(TPModule(**m) for m in d.get("tp_modules", ())),
                              None if acts is None else tuple(Activation(**a) for a in acts))
