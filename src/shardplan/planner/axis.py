"""One compute axis, as the planner sees it: the protocol every kind of in-module parallelism implements
(tensor parallelism ``tp``, context parallelism ``cp``, expert parallelism ``ep``; :mod:`.axes` lists them),
and where the collectives an axis runs *inside* a module's call sit in the schedule.

An axis, in the order the planner asks:

1. :meth:`ComputeAxis.resolve`: from the specs, which parameters it keeps sharded while computing (their
   :class:`~.values.Compute`) and its plan value before placement (the modules it runs), or ``None``;
2. :meth:`ComputeAxis.place`: its calls traced (with ``trace=``) and anchored in the units (:func:`anchors`);
   the value that goes into ``plan.axes``;
3. :meth:`ComputeAxis.module_ops`: its activation ops, per module call (:class:`ModuleOps`), which
   :func:`with_activation_ops` inserts into the schedule;
4. :meth:`ComputeAxis.comm_bytes`, :meth:`ComputeAxis.note`, :meth:`ComputeAxis.check_op`: the bytes a rank sends
   for them, the plan's note, the validation of an (edited) schedule's ops;
5. :meth:`ComputeAxis.to_dict` / :meth:`ComputeAxis.from_dict`: its part of the plan's JSON.

At run time the axis installs itself through :mod:`shardplan.runtime.axes` (the same kind names).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from ..units import ROOT
from .kinds import BEFORE_FORWARD, BEGIN_BACKWARD, POST_BACKWARD, PRE_BACKWARD, PRE_FORWARD, RECOMPUTE
from .schedule import program, skeleton
from .ops import Op

@dataclass(frozen=True)
class Resolving:
    """What :meth:`ComputeAxis.resolve` reads: the module (``None`` for a pytree), each parameter's (LeafInfo,
    spec as the axes before this one left it, rule description), the checked options, the mesh, the trace."""

    module: Any
    names_specs: Sequence[tuple]
    opts: Any
    mesh: Any
    trace: Any = None


@dataclass(frozen=True)
class Resolved:
    """An axis's resolution: ``value`` (its plan value before placement; ``None``: the axis is off in this
    plan), ``compute`` (parameter name -> the :class:`~.values.Compute` it keeps sharded while computing),
    ``specs`` (parameter name -> a changed storage spec: a bias following its weight)."""

    value: Any = None
    compute: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    specs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Placing:
    """What :meth:`ComputeAxis.place` reads: the module, the units (root first), the mesh, the trace, the
    bytes per element of the compute dtype (``None``: the traced tensors'), and the values the axes before
    this one placed (by kind)."""

    module: Any
    units: Sequence[Any]
    mesh: Any
    trace: Any
    itemsize: Optional[int]
    placed: Mapping[str, Any]


class ComputeAxis:
    """One kind of in-module parallelism. Subclasses set ``kind`` (the key of its value in ``plan.axes``) and
    override what they need; the defaults do nothing. ``op_order``: where its in-module ops come among the
    axes' within one step (see [Note: the axes' order within a step] in :func:`with_activation_ops`);
    ``fallback``: the axis that checks activation ops no other axis claims (tensor parallelism);
    ``phrase``: how an error names a parameter computed sharded over it; ``separate_buffers``: its parameters
    get buffers of their own, whose gradients are not reduced over it (expert parallelism)."""

    kind: str = ""
    op_order: int = 100
    fallback: bool = False
    phrase: str = "computed sharded over axis"
    separate_buffers: bool = False

    def resolve(self, ctx: Resolving) -> Optional[Resolved]:
        return None

    def place(self, ctx: Placing, value: Any) -> Any:
        """``value`` (``None`` unless :meth:`resolve` gave one) traced and placed: the plan's value, or ``None``."""
        return value

    def module_ops(self, value: Any, mesh) -> tuple["ModuleOps", ...]:
        return ()

    def comm_bytes(self, plan, value: Any) -> dict:
        """``{key: bytes one rank sends per step}`` for ``plan.comm_bytes()`` (``None``: not estimated)."""
        return {}

    def note(self, value: Any, mesh) -> Optional[str]:
        return None

    def claims(self, op: Op) -> bool:
        """Whether activation op ``op`` is one of this axis's (:meth:`check_op` then checks it)."""
        return False

    def check_op(self, plan, value: Any, op: Op) -> Optional[str]:
        """Why activation op ``op`` is not one this axis runs in ``plan`` (``None``: it is)."""
        return None

    def to_dict(self, value: Any) -> dict:
        return {}

    def from_dict(self, d: Mapping[str, Any]) -> Any:
        return None


# -- where in-module ops run: plan data ------------------------------------------------------------------
# [Note: activation ops. Collectives that run inside a module's call (a tensor-parallel style's, an attention's
# K/V gathers, an expert module's all-to-alls) run between the steps of the units around it. The planner places
# each one after a step of the unit skeleton by module order (``named_modules``): in forward after the last unit
# boundary before the module, in backward after the mirror of the first boundary after it (``pre_forward(u)``
# mirrors ``post_backward(u)``, ``post_forward(u)`` mirrors ``pre_backward(u)``).]

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
    order: dict[str, int] = {path: i for i, (path, _) in enumerate(module.named_modules())}
    end: dict[str, int] = {}
    for path in sorted(order, key=order.get):  # preorder: a module's subtree is the run of paths under it
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

    out = {}
    for path in paths:
        if path not in order:
            continue
        pos = order[path]
        before = [(key(e, a), i) for i, (e, a) in enumerate(fwd) if key(e, a) < pos]
        after = [(key(e, a), i) for i, (e, a) in enumerate(fwd) if key(e, a) > pos]
        e0, a0 = fwd[max(before)[1]]
        e1, a1 = fwd[min(after)[1]]
        out[path] = Anchor(unit_of(path, units), trigger(e0, a0), mirror(e1, a1))
    return out


def unit_of(path: str, units) -> str:
    """The deepest unit whose modules enclose module ``path`` (the root unit if none)."""
    best, depth = ROOT, -1
    for u in units[1:]:
        for p in u.module_paths:
            if (path == p or path.startswith(p + ".") or p == "") and len(p) > depth:
                best, depth = u.name, len(p)
    return best


@dataclass(frozen=True)
class ModuleOps:
    """The ops one module call runs inside it, at ``anchor``: ``forward`` in the order the call issues them,
    ``backward`` in the order its backward does; ``recompute``: the condition of the forward ops' repeat in a
    unit's recompute (``recompute``, or ``recompute_whole`` for those torch's checkpoint early stop leaves out)."""

    anchor: Anchor
    forward: tuple[Op, ...] = ()
    backward: tuple[Op, ...] = ()
    recompute: str = RECOMPUTE


def with_activation_ops(schedule: Sequence[Op], units, calls: Sequence[ModuleOps]) -> tuple[Op, ...]:
    """``schedule`` (the units' ops) with every in-module op of ``calls`` inserted where it runs: forward ops
    after their ``after`` step; in backward, after a unit's ``pre_backward`` step, the forward ops of its
    calls again (``when=`` the call's ``recompute``: activation checkpointing recomputes them), then the
    backward ops after their ``back_after`` step, later calls' first. ``calls``: every axis's, in the axes'
    ``op_order`` (:func:`shardplan.planner.axes.module_ops`); empty: ``schedule`` unchanged.

    [Note: the axes' order within a step. Within one step the ops are grouped by axis (tensor-parallel first in
    forward, last in backward), not interleaved in call order: the schedule says which step runs them and the
    runtime issues them inside the calls; nothing waits on their relative order.]"""
    if not calls:
        return tuple(schedule)
    fwd: dict[str, list[Op]] = {}
    again: dict[str, list[Op]] = {}
    bwd: dict[str, list[tuple[Op, ...]]] = {}
    for x in calls:
        fwd.setdefault(x.anchor.after, []).extend(x.forward)
        if x.anchor.unit != ROOT and x.forward:  # see [Note: checkpoint early stop] (tensor_parallel.py)
            again.setdefault(f"{PRE_BACKWARD}({x.anchor.unit})", []).extend(
                dataclasses.replace(o, when=x.recompute) for o in x.forward)
        if x.backward:
            bwd.setdefault(x.anchor.back_after, []).insert(0, x.backward)  # backward meets the calls in reverse
    base = [o for o in schedule if not o.in_module]
    out: list[Op] = []
    prog = program(units, base)
    for step in prog.forward:
        out += [base[i] for i in step.ops] + fwd.get(step.name, [])
    for step in prog.backward:
        out += [base[i] for i in step.ops] + again.get(step.name, []) + [o for g in bwd.get(step.name, ()) for o in g]
    out += [base[i] for i in prog.end.ops]
    return tuple(out)
