"""Expert parallelism in the plan: which stacked expert weights an ``ep`` axis splits by expert, and the
token traffic (all-to-all) that implies. Pure functions; the runtime moves the tokens
(:mod:`shardplan.runtime.expert_parallel`).

An *expert module* stacks its experts' weights on dim 0 (``[num_experts, ...]`` matrices) and says how many
it has in an integer attribute ``num_experts`` (torchtitan's ``GroupedExperts``, Hugging Face's
``MixtralExperts`` / Qwen-MoE / DeepSeek-V3 experts, examples/moe.py); a router, with ``num_experts`` and an
``[num_experts, hidden]`` weight, is not one (:func:`expert_count`). A rule whose spec puts the expert axis
first in dim 0 of such a weight,

>>> rules = [(r".*experts\\.w\\d", P(("ep", "dp"), None, None)), (r".*", P(("dp", "ep")))]

gives each ``ep`` rank ``num_experts / ep`` whole experts, never gathered over ``ep`` (the expert axis is a
compute axis for them, as ``tp`` is for a column-parallel weight) and stored sharded over the axes after
it (here ``dp``: ZeRO). For every other parameter ``ep`` is a data axis like ``dp``: it splits the batch,
may shard storage (``P(("dp", "ep"))``) and reduces gradients. Expert gradients are reduced over the data
axes that are not ``ep`` only: the tokens of every ``ep`` rank already reached them through the all-to-all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from ..errors import PlanError, SpecError, did_you_mean
from ..mesh import Mesh
from ..spec import P
from ..units import expert_count  # noqa: F401 - (its home: below the planner, auto_rules reads it too)
from ..units import run_traced
from .axis import Anchor, ComputeAxis, ModuleOps, Placing, Resolved, Resolving, anchors
from .kinds import ACTIVATIONS, ALL_TO_ALL, MODULE_BACKWARD, MODULE_FORWARD
from .ops import Op
from .values import Compute

EXPERT_AXIS = "ep"


@dataclass(frozen=True)
class ExpertModule:
    """A module whose stacked experts are split over ``axis`` (``size`` ranks, ``num_experts`` in all);
    ``unit``, ``after``, ``back_after``: where its all-to-alls sit in the schedule (:func:`place`)."""

    path: str
    axis: str
    size: int
    num_experts: int
    unit: str = ""
    after: str = ""
    back_after: str = ""

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.size


@dataclass(frozen=True)
class ExpertCall:
    """One traced call of an expert module: elements of its token input, experts per token (top-k),
    bytes per element."""

    path: str
    tokens_numel: int
    top_k: int
    itemsize: int


def as_expert_axes(expert_axes, mesh: Mesh, compute_axes: Sequence[str]) -> tuple[str, ...]:
    """The expert axes: as given, or the mesh's ``ep`` axis when it has one (``None``, the default)."""
    if expert_axes is None:
        return (EXPERT_AXIS,) if EXPERT_AXIS in mesh.axis_names else ()
    axes = (expert_axes,) if isinstance(expert_axes, str) else tuple(expert_axes)
    for a in axes:
        if a not in mesh.axis_names:
            raise PlanError(f"expert axis {a!r} is not an axis of {mesh!r}{did_you_mean(a, mesh.axis_names)}; name one of {mesh.axis_names} or add it "
                            f"to the mesh, e.g. Mesh(dp=2, {a}=2)")
        if a in compute_axes:
            raise PlanError(f"axis {a!r} is named both a compute (tensor-parallel) axis and an expert axis; "
                            f"give each job its own axis, e.g. Mesh(dp=2, ep=2, tp=2)")
    if len(axes) > 1:
        raise PlanError(f"expert_axes {axes}: one expert axis is supported; fold them into one mesh axis")
    return axes


def resolve(module, names_specs: list[tuple[Any, P, str]], axes: tuple[str, ...], mesh: Mesh
            ) -> tuple[dict[str, Compute], tuple[ExpertModule, ...]]:
    """Per expert-sharded parameter its ``Compute`` (dim 0 over the expert axis), and the expert modules.
    ``names_specs``: (LeafInfo, spec, rule description) per parameter. Raises, naming the parameter, its
    rule and the fix, for an expert axis on a dimension that is not the experts' and for experts that do
    not divide by the axis."""
    if not axes:
        return {}, ()
    axis = axes[0]
    mods = dict(module.named_modules()) if module is not None else {}
    out: dict[str, Compute] = {}
    by_module: dict[str, list[tuple[str, bool]]] = {}
    for info, spec, rule in names_specs:
        dims = [d for d in range(len(spec)) if axis in spec.dim_axes(d)]
        path, _, attr = info.name.rpartition(".")
        n = expert_count(mods[path]) if path in mods else None
        expert = n is not None and len(info.shape) >= 1 and info.shape[0] == n
        where = f"parameter {info.name!r} (shape {tuple(info.shape)}, spec {spec!r}, rule {rule})"
        if expert:
            by_module.setdefault(path, []).append((info.name, bool(dims)))
        if not dims or not expert:
            continue  # for a dense parameter the expert axis is a data axis: storage, gradient reduction
        fixed = P(*([(axis,) + tuple(a for a in spec.dim_axes(0) if a != axis)]
                    + [tuple(a for a in spec.dim_axes(d) if a != axis) or None for d in range(1, len(spec))]))
        if dims != [0]:
            raise SpecError(f"{where} names expert axis {axis!r} on dimension {dims[-1]}, but dimension 0 holds its "
                            f"module's {n} experts (num_experts): expert parallelism splits whole experts. "
                            f"Write {fixed!r}")
        if spec.dim_axes(0)[0] != axis:
            raise SpecError(f"{where}: expert axis {axis!r} must come first in dimension 0's entry, so that each "
                            f"{axis} rank holds whole, contiguous experts; write {fixed!r}")
        size = mesh.axis_size(axis)
        if n % size:
            fits = [s for s in range(1, n + 1) if n % s == 0]
            raise SpecError(f"{where}: its module {path!r} has {n} experts, which do not divide over expert axis "
                            f"{axis!r} of size {size}; use an {axis} size in {fits}, or keep {axis!r} out of the spec "
                            f"(every rank holds every expert)")
        out[info.name] = Compute(0, axis, size)
    experts = []
    for path, members in by_module.items():
        split = {name for name, s in members if s}
        if split and len(split) != len(members):
            rest = sorted(name for name, s in members if not s)
            raise SpecError(f"module {path!r} stacks experts in {sorted(split)} split over {axis!r} and in {rest} not: "
                            f"its experts must be split alike; give {rest} a spec with {axis!r} first in dimension 0")
        if split:
            experts.append(ExpertModule(path, axis, mesh.axis_size(axis), expert_count(mods[path])))
    return out, tuple(experts)


def trace_calls(model, modules: Sequence[ExpertModule], trace, itemsize: Optional[int]) -> tuple[ExpertCall, ...]:
    """Run the traced forward once and record each expert module's token input (the first tensor
    argument) and top-k (the last dimension of the second, the experts each token is routed to)."""
    import torch
    seen: list[ExpertCall] = []

    def record(m):
        def hook(_m, inputs, _output):
            ts = [t for t in inputs if isinstance(t, torch.Tensor)]
            if not ts:
                return
            k = ts[1].shape[-1] if len(ts) > 1 and ts[1].dim() > 0 else 1
            seen.append(ExpertCall(m.path, ts[0].numel(), int(k), itemsize or ts[0].element_size()))
        return hook

    run_traced(model, trace, {m.path: ("post", record(m)) for m in modules}, grad=False)
    return tuple(seen)


def place(module, modules: Sequence[ExpertModule], units) -> tuple[ExpertModule, ...]:
    """``modules`` with the unit that calls each and the schedule steps its all-to-alls follow."""
    where = anchors(module, [m.path for m in modules], units)
    return tuple(dataclasses.replace(m, unit=a.unit, after=a.after, back_after=a.back_after)
                 for m in modules for a in [where[m.path]])


def module_ops(modules: Sequence[ExpertModule], calls: Optional[Sequence[ExpertCall]]) -> tuple[ModuleOps, ...]:
    """The all-to-alls of each placed expert module over a group of more than one rank, per traced call
    (untraced: one call of unknown size, 0 bytes): forward, ``dispatch`` then ``combine``; backward,
    ``combine``'s then ``dispatch``'s. Each op's bytes: the ``tokens * k`` rows the rank sends out (its
    own share included), under balanced routing. [Note: the exchange of per-expert counts that precedes
    a dispatch (``num_experts`` integers) is left out: latency, no volume.]"""
    out = []
    for m in modules:
        if m.size <= 1 or not m.after:
            continue
        sizes = [c.tokens_numel * c.top_k * c.itemsize for c in calls if c.path == m.path] if calls is not None \
            else [0]

        def op(event, b: int) -> Op:
            return Op(kind=ALL_TO_ALL, unit=m.unit, what=ACTIVATIONS, event=event, at=m.path, axes=(m.axis,),
                      bytes=b)
        for b in sizes:
            out.append(ModuleOps(Anchor(m.unit, m.after, m.back_after), forward=(op(MODULE_FORWARD, b),) * 2,
                                 backward=(op(MODULE_BACKWARD, b),) * 2))
    return tuple(out)


def all_to_all_bytes(modules: Sequence[ExpertModule], calls: Sequence[ExpertCall], mesh: Mesh) -> int:
    """Bytes one rank sends per training step through the expert all-to-alls: each token goes to its top-k
    experts (dispatch) and back (combine), and backward sends the gradients of both the other way: four
    all-to-alls of ``tokens * k`` rows, of which ``(n-1)/n`` leave the rank under balanced routing (each
    rounded down on its own, as the forecast counts them)."""
    by_path = {m.path: m for m in modules}
    total = 0
    for c in calls:
        n = by_path[c.path].size
        total += 4 * (c.tokens_numel * c.top_k * c.itemsize * (n - 1) // n)
    return total


def modules_note(modules: Sequence[ExpertModule]) -> str:
    m = modules[0]
    return (f"expert parallelism: {len(modules)} expert modules split over {m.axis!r} ({m.local_experts} of "
            f"{m.num_experts} experts per rank); tokens reach them by all-to-all; expert gradients are reduced over "
            f"the other data axes only")


# -- the axis ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertAxisPlan:
    """Expert parallelism in a plan (``plan.axis("ep")``; :func:`of`): the expert axes, the expert modules split
    over them (placed), their traced token inputs (``None``: not traced).

    >>> plan.axis("ep").module("layers.0.moe.experts").local_experts   # experts one ep rank holds
    """

    axes: tuple[str, ...]
    modules: tuple[ExpertModule, ...] = ()
    calls: Optional[tuple[ExpertCall, ...]] = None
    kind = "ep"

    def module(self, path: str) -> Optional[ExpertModule]:
        """The expert module at ``path``, or ``None``."""
        return next((m for m in self.modules if m.path == path), None)


def of(plan) -> ExpertAxisPlan:
    """``plan``'s expert parallelism: its ``ep`` axis value, or an empty one (no expert axes, no modules)."""
    return next((v for v in plan.axes if v.kind == "ep"), _NONE)


_NONE = ExpertAxisPlan(())


class ExpertAxis(ComputeAxis):
    """The ``ep`` axis (``expert_axes=``): stacked experts split by expert, tokens moved by all-to-all. Its
    parameters get buffers of their own (``separate_buffers``): their gradients are not reduced over it."""

    kind, op_order, phrase, separate_buffers = "ep", 2, "split over expert axis", True

    def resolve(self, ctx: Resolving) -> Optional[Resolved]:
        compute, modules = resolve(ctx.module, list(ctx.names_specs), ctx.opts.expert_axes, ctx.mesh)
        return Resolved(ExpertAxisPlan(ctx.opts.expert_axes, modules) if modules else None, compute)

    def place(self, ctx: Placing, value: Optional[ExpertAxisPlan]) -> Optional[ExpertAxisPlan]:
        if value is None:
            return None
        calls = trace_calls(ctx.module, value.modules, ctx.trace, ctx.itemsize) if ctx.trace is not None else None
        return dataclasses.replace(value, modules=place(ctx.module, value.modules, ctx.units), calls=calls)

    def module_ops(self, value: Optional[ExpertAxisPlan], mesh: Mesh) -> tuple[ModuleOps, ...]:
        return module_ops(value.modules, value.calls) if value is not None else ()

    def comm_bytes(self, plan, value: Optional[ExpertAxisPlan]) -> dict:
        if value is None:
            return {}
        calls = value.calls
        return {"expert_parallel": None if calls is None else all_to_all_bytes(value.modules, calls, plan.mesh)}

    def note(self, value: Optional[ExpertAxisPlan], mesh: Mesh) -> Optional[str]:
        return modules_note(value.modules) if value is not None else None

    def claims(self, op: Op) -> bool:
        return op.kind == ALL_TO_ALL

    def check_op(self, plan, value: Optional[ExpertAxisPlan], op: Op) -> Optional[str]:
        m = next((m for m in (value.modules if value is not None else ()) if m.path == op.at), None)
        if m is None:
            return f"is an all_to_all of {op.at!r}, which is no expert module of the plan"
        if op.event not in (MODULE_FORWARD, MODULE_BACKWARD) or tuple(op.axes) != (m.axis,) or op.unit != m.unit:
            return (f"an expert module's all-to-alls run at module_forward/module_backward over ({m.axis!r},) in "
                    f"unit {m.unit!r}")
        return None

    def to_dict(self, value: Optional[ExpertAxisPlan]) -> dict:
        if value is None:
            return {}
        return {"expert_axes": list(value.axes), "expert_modules": [dataclasses.asdict(m) for m in value.modules],
                "expert_calls": None if value.calls is None else [dataclasses.asdict(c) for c in value.calls]}

    def from_dict(self, d: Mapping[str, Any]) -> Optional[ExpertAxisPlan]:
        if not d.get("expert_modules"):
            return None
        calls = d.get("expert_calls")
        return ExpertAxisPlan(tuple(d.get("expert_axes", ())), tuple(ExpertModule(**m) for m in d["expert_modules"]),
                              None if calls is None else tuple(ExpertCall(**c) for c in calls))
