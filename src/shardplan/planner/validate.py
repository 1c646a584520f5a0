"""Checks a schedule before anything runs: each op touches its own unit's buffers over the right groups,
ops are listed in the order of their triggers, and simulating a step never reads a buffer before its
gather, frees one still in use, or leaves a gradient unreduced. Errors name the op."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable

from ..errors import PlanError
from ..units import ROOT, natural_sorted
from . import axes as AX
from . import kinds as K
from .kinds import (ACTIVATIONS, ALL_GATHER, ALL_REDUCE, BEGIN_BACKWARD, COPY_D2H, COPY_H2D, END_BACKWARD, FREE, GRADS,
                    OPTIM_STEP, SYNC,
                    Offload, PARAMS, POST_BACKWARD, POST_FORWARD, PRE_BACKWARD, PRE_FORWARD, PREPARE,
                    PARTIAL_GRADS, REDUCE_SCATTER, SCALES, USED, WAIT)
from .schedule import needs_gather
from .ops import Op, Program

if TYPE_CHECKING:  # pragma: no cover
    from .facade import Plan


def _fail(i: int, op: Op, why: str) -> PlanError:
    return PlanError(f"schedule op #{i} ({op.kind} {op.what} of {op.unit or 'all'} at {op.trigger}"
                     f"{' [' + op.when + ']' if op.when else ''}): {why}")


_FIELDS = (("kind", K.OpKind), ("what", K.Subject), ("event", K.Event), ("when", K.Condition))


def normalised(ops: Iterable[Op]) -> tuple[Op, ...]:
    """``ops`` with kinds, subjects, events and conditions as enum members (their strings are accepted):
    the public boundary of an edited schedule. A :class:`PlanError` names the first op with an unknown one.

    >>> normalised([Op(kind="wait", unit="layers.0", what="params", event="pre_forward", at="layers.0")])[0].kind
    'wait'
    """
    out = []
    for i, op in enumerate(ops):
        if not isinstance(op, Op):
            raise PlanError(f"schedule entry #{i} is a {type(op).__name__}, not a shardplan.planner.Op")
        fixed = {}
        for name, cls in _FIELDS:
            value = getattr(op, name)
            if not isinstance(value, cls):
                try:
                    fixed[name] = cls(value)
                except ValueError:
                    raise _fail(i, op, f"unknown {name} {value!r}; use one of {cls.values()}") from None
        out.append(dataclasses.replace(op, **fixed) if fixed else op)
    return tuple(out)


def validate(plan: "Plan") -> None:
    units = {u.name: u for u in plan.units}
    for i, op in enumerate(plan.schedule):
        _check_op(plan, units, i, op)
    prog = plan.program  # raises for triggers the plan does not have
    order = [i for step in prog.canonical() for i in step.ops]
    for k, i in enumerate(order):
        if k and i < order[k - 1]:
            j = order[k - 1]
            raise _fail(j, plan.schedule[j], f"is listed at position {j} but its trigger comes later than the trigger "
                                             f"of op #{i} ({plan.schedule[i].trigger}); list ops in trigger order")
    for facts in (dict(stale=True, grad=True, sync=True), dict(stale=False, grad=True, sync=False),
                  dict(stale=True, grad=False, sync=True)):
        _simulate(plan, units, prog, **facts)


def _check_op(plan: "Plan", units, i: int, op: Op) -> None:
    if op.kind not in K.KINDS:
        raise _fail(i, op, f"unknown kind; kinds are {K.KINDS}")
    if op.when not in K.CONDITIONS:
        raise _fail(i, op, f"unknown condition; conditions are {K.CONDITIONS}")
    if op.what == USED:
        return _check_used(plan, i, op)
    if op.what == SCALES:  # FP8 compute: the float8 weights' absmaxes before their gather
        return _check_scales(plan, i, op)
    if op.what == PARTIAL_GRADS:  # replicated parameters read on sharded activations: summed over the compute axis
        return _check_partial_grads(plan, i, op)
    if op.what == ACTIVATIONS:
        return _check_activations(plan, i, op)
    _check_buffer_op(plan, units, i, op)


def _check_used(plan: "Plan", i: int, op: Op) -> None:
    if op.kind not in (ALL_REDUCE, WAIT) or op.event != END_BACKWARD:
        raise _fail(i, op, "the used-parameter exchange is an all_reduce and a wait at end_backward")
    if op.kind == ALL_REDUCE and tuple(op.axes) != plan.mesh.axis_names:
        raise _fail(i, op, f"the used-parameter exchange runs over every mesh axis {plan.mesh.axis_names}")


def _check_scales(plan: "Plan", i: int, op: Op) -> None:
    bad = [b for b in op.buffers if not (0 <= b < len(plan.buffers)) or not plan.buffers[b].amax_bytes
           or plan.buffers[b].unit != op.unit]
    if op.kind != ALL_REDUCE or bad or not op.buffers:
        raise _fail(i, op, f"the scales of float8 gathers are an all_reduce of unit {op.unit!r}'s float8 buffers "
                           f"(buffers {bad or list(op.buffers)} are not)")
    want = tuple(dict.fromkeys(a for b in op.buffers for a in plan.buffers[b].axes))
    if tuple(op.axes) != want:
        raise _fail(i, op, f"runs over axes {tuple(op.axes)}; its buffers are gathered over {want}")


def _check_partial_grads(plan: "Plan", i: int, op: Op) -> None:
    bad = [b for b in op.buffers if not (0 <= b < len(plan.buffers)) or not plan.buffers[b].partial_axes
           or not plan.buffers[b].requires_grad or plan.buffers[b].unit != op.unit]
    if op.kind != ALL_REDUCE or bad or not op.buffers:
        raise _fail(i, op, f"partial gradients are an all_reduce of unit {op.unit!r}'s buffers whose gradients are "
                           f"partial sums over a compute axis (buffers {bad or list(op.buffers)} are not)")
    want = tuple(dict.fromkeys(a for b in op.buffers for a in plan.buffers[b].partial_axes))
    if tuple(op.axes) != want or len({plan.buffers[b].partial_axes for b in op.buffers}) > 1:
        raise _fail(i, op, f"runs over axes {tuple(op.axes)}; its buffers' gradients are partial over {want}")


def _check_activations(plan: "Plan", i: int, op: Op) -> None:
    """An op some compute axis runs inside a module's call (planner/axes.py: each axis checks its own)."""
    why = AX.check_op(plan, op)
    if why:
        raise _fail(i, op, why)


def _check_buffer_op(plan: "Plan", units, i: int, op: Op) -> None:
    """An op on a unit's own buffers (params or grads): those buffers, and the group its kind runs over."""
    if op.what not in (PARAMS, GRADS):
        raise _fail(i, op, f"unknown what {op.what!r}; use params, grads, partial_grads, used, scales or activations")
    if op.unit not in units:
        raise _fail(i, op, f"names no unit of the plan; units: {list(units)}")
    mine = set(units[op.unit].buffers)
    bad = [b for b in op.buffers if b not in mine]
    if bad:
        raise _fail(i, op, f"touches buffer(s) {bad}, which belong to unit(s) "
                           f"{natural_sorted({plan.buffers[b].unit for b in bad if 0 <= b < len(plan.buffers)})}, not {op.unit!r}")
    want = _group_of(plan, mine, i, op, [plan.buffers[b] for b in op.buffers])
    if want is not None and tuple(op.axes) != want:
        raise _fail(i, op, f"runs over axes {tuple(op.axes)} but its buffers' group is {want}")


def _group_of(plan: "Plan", mine: set, i: int, op: Op, bufs) -> "tuple | None":
    """The axes an op of this kind on ``bufs`` must run over (``()``: local), after the checks of its kind;
    ``None`` for a kind with no group to check (wait, free)."""
    if op.kind == ALL_GATHER:
        if op.what != PARAMS:
            raise _fail(i, op, "all_gather gathers params")
        need = [b.index for b in plan.buffers if b.index in mine and needs_gather(b)]
        if any(b not in need for b in op.buffers):
            raise _fail(i, op, f"gathers a buffer that needs no gather; the unit's buffers that do: {need}")
        want = tuple(dict.fromkeys(a for b in bufs if b.sharded for a in b.axes))
        if len({b.axes for b in bufs if b.sharded}) > 1:
            raise _fail(i, op, "gathers buffers sharded over different groups: one op per group")
    elif op.kind == REDUCE_SCATTER:
        want = tuple(dict.fromkeys(a for b in bufs for a in b.axes))
        if len({b.axes for b in bufs}) > 1:
            raise _fail(i, op, "reduce-scatters buffers sharded over different groups: one op per group")
        if op.what != GRADS or any(not b.sharded or not b.requires_grad for b in bufs):
            raise _fail(i, op, "reduce_scatter reduces the gradients of sharded buffers")
    elif op.kind == ALL_REDUCE:
        want = tuple(dict.fromkeys(a for b in bufs for a in b.replica_axes))
        if len({b.replica_axes for b in bufs}) > 1:
            raise _fail(i, op, "all-reduces buffers over different replica groups: one op per group")
        if op.what != GRADS or any(not b.requires_grad for b in bufs):
            raise _fail(i, op, "all_reduce reduces gradients over the replica axes")
    elif op.kind in (COPY_D2H, COPY_H2D, OPTIM_STEP):
        # CPU offload: a copy (or a host step) moves offloaded buffers only, of its own unit, locally
        what = GRADS if op.kind == COPY_D2H else PARAMS
        if op.what != what:
            raise _fail(i, op, f"{op.kind} moves {what}")
        grads = op.kind != COPY_H2D
        bad = [b.index for b in bufs if not b.offload or (grads and not b.requires_grad)]
        if bad:
            raise _fail(i, op, f"{'steps' if op.kind == OPTIM_STEP else 'copies'} buffer(s) {bad}, which the plan "
                               f"does not offload" + (" (or which take no gradient)" if grads else ""))
        if op.kind == OPTIM_STEP and op.when != SYNC:
            raise _fail(i, op, "optim_step runs in synchronising backwards only (when='sync'): a step under "
                               "no_sync would drop the accumulated gradient")
        want = ()
    elif op.kind == PREPARE:
        need = [b.index for b in plan.buffers if b.index in mine and b.requires_grad]
        if op.what != GRADS or sorted(op.buffers) != need:
            raise _fail(i, op, f"prepare makes the unsharded gradient of exactly the unit's buffers that take "
                               f"gradients, {need}")
        if op.event not in (BEGIN_BACKWARD, PRE_BACKWARD):
            raise _fail(i, op, "prepare runs at begin_backward (the root) or at the unit's pre_backward")
        want = ()
    else:
        return None
    return want


def _needed_reductions(plan: "Plan", bs) -> set:
    """(kind, buffer) of every reduction a unit's gradients need: per buffer, not per kind, since a unit
    whose buffers span several process groups takes one op per group (and dropping one must not pass)."""
    out = set()
    for b in bs:
        if b.requires_grad and b.sharded:
            out.add((REDUCE_SCATTER, b.index))
        if b.requires_grad and b.replica_axes and plan.mesh.axis_size(b.replica_axes) > 1:
            out.add((ALL_REDUCE, b.index))
        if b.requires_grad and b.partial_axes and plan.mesh.axis_size(b.partial_axes) > 1:
            out.add((PARTIAL_GRADS, b.index))
    return out


def _simulate(plan: "Plan", units, prog: Program, *, stale: bool, grad: bool, sync: bool) -> None:
    sim = _Sim(plan, units, f"(in a step with stale={stale}, grad={grad}, sync={sync})")
    steps = list(prog.forward) if not grad else prog.canonical()
    for step in steps:
        sim.enter(step, grad)
        for i in step.ops:
            op = plan.schedule[i]
            if op.applies(stale=stale, grad=grad, sync=sync):
                sim.run(i, op)
        sim.compute(step)
    sim.end(grad, sync)


class _Sim:
    """One step simulated op by op: each unit's state (``sharded``, ``gathering``, ``bound``), which units
    compute now, which reductions were issued and waited for, what offload staged or copied; every method
    raises the :class:`PlanError` naming the op (or the step) that breaks the step. ``mode`` says which step
    (its facts) in each message."""

    def __init__(self, plan: "Plan", units, mode: str):
        self.plan, self.units, self.mode = plan, units, mode
        bufs = self.bufs = {name: [plan.buffers[i] for i in u.buffers] for name, u in units.items()}
        self.gathers = {n: any(needs_gather(b) for b in bs) for n, bs in bufs.items()}
        self.to_gather = {n: {b.index for b in bs if needs_gather(b)} for n, bs in bufs.items()}
        self.gathering: dict[str, set] = {n: set() for n in units}
        self.transient = {n: any(not b.persistent for b in bs) for n, bs in bufs.items()}
        self.reductions = {n: _needed_reductions(plan, bs) for n, bs in bufs.items()}
        self.has_grads = {n: any(b.requires_grad for b in bs) for n, bs in bufs.items()}
        self.state = {n: "sharded" for n in units}
        self.in_use: set[str] = set()
        self.complete: set[str] = set()
        self.issued: dict[str, set] = {n: set() for n in units}
        self.waited: set[str] = set()
        self.prepared: set[str] = set()
        self.hosted = {n: {b.index for b in bs if b.offload == Offload.PARAMS} for n, bs in bufs.items()}
        self.staged: set[int] = set()   # offloaded parameter shards copied to the device, not yet gathered
        self.copied_grads: set[str] = set()
        self.copied_bufs: set[int] = set()  # offloaded buffers whose reduced gradient reached the host this step
        self.hosted_grads = {n: any(b.offload and b.requires_grad for b in bs) for n, bs in bufs.items()}
        self.used_issued = self.used_waited = False
        self.scaled: set[int] = set()  # float8 buffers whose scales were all-reduced for their next gather

    def enter(self, step, grad: bool) -> None:
        """What the step's event ends before its ops run: a unit's compute, its gradients' arrival."""
        if step.event == POST_FORWARD:
            if step.at != ROOT or not grad:
                self.in_use.discard(step.at)
        elif step.event == POST_BACKWARD:
            self.in_use.discard(step.at)
            self.complete.add(step.at)
        elif step.event == END_BACKWARD:
            self.in_use.discard(ROOT)
            self.complete.add(ROOT)

    def run(self, i: int, op: Op) -> None:
        u, mode = op.unit, self.mode
        if op.what == USED:
            if op.kind == ALL_REDUCE:
                self.used_issued = True
            elif not self.used_issued:
                raise _fail(i, op, f"waits for the used-parameter exchange before it is issued {mode}")
            else:
                self.used_waited = True
            return
        if op.what == SCALES:
            self.scaled |= set(op.buffers)
            return
        if op.what == PARTIAL_GRADS:
            return self.partial_grads(i, op)
        if op.kind == PREPARE:
            self.prepared.add(u)
        elif op.kind == COPY_H2D:
            self.staged |= set(op.buffers) & self.hosted[u]
        elif op.kind == COPY_D2H:
            if u not in self.waited:
                raise _fail(i, op, f"copies unit {u!r}'s gradients to the host before their reduction completed "
                                   f"{mode}: put it after the unit's wait for grads")
            self.copied_grads.add(u)
            self.copied_bufs |= set(op.buffers)
        elif op.kind == OPTIM_STEP:
            missing = sorted(set(op.buffers) - self.copied_bufs)
            if missing:
                raise _fail(i, op, f"steps buffer(s) {missing} on the host before their gradient was copied there "
                                   f"{mode}: put it after the unit's copy_d2h of grads")
        elif op.kind == ALL_GATHER:  # one op per process group: a unit may take several
            self.all_gather(i, op)
        elif op.kind == WAIT and op.what == PARAMS:
            self.wait_params(i, op)
        elif op.kind == FREE and op.what == PARAMS:
            if u in self.in_use:
                raise _fail(i, op, f"frees unit {u!r}'s parameters while {u!r} still computes {mode}")
            self.state[u] = "sharded"
        elif op.kind in (REDUCE_SCATTER, ALL_REDUCE):
            if u not in self.complete:
                raise _fail(i, op, f"reduces unit {u!r}'s gradients before they are complete (before "
                                   f"{'end_backward' if u == ROOT else f'post_backward({u})'}) {mode}")
            self.issued[u].update((op.kind, b) for b in op.buffers)
        elif op.kind == WAIT and op.what == GRADS:
            missing = sorted(self.reductions[u] - self.issued[u], key=str)
            if missing:
                what = ", ".join(f"{k} of buffer #{b}" for k, b in missing)
                raise _fail(i, op, f"waits for unit {u!r}'s gradients but its {what} was never issued {mode}: "
                                   f"that gradient would stay unreduced")
            self.waited.add(u)
        elif op.kind == FREE and op.what == GRADS:
            if u not in self.waited:
                raise _fail(i, op, f"frees unit {u!r}'s gradient before its reduction completed {mode}")

    def partial_grads(self, i: int, op: Op) -> None:
        u, mode = op.unit, self.mode
        if u not in self.complete:
            raise _fail(i, op, f"sums unit {u!r}'s partial gradients before they are complete (before "
                               f"{'end_backward' if u == ROOT else f'post_backward({u})'}) {mode}")
        late = sorted(b for b in op.buffers if any((k, b) in self.issued[u] for k in (REDUCE_SCATTER, ALL_REDUCE)))
        if late:
            raise _fail(i, op, f"sums the partial gradients of buffer(s) {late} after their reduction was "
                               f"issued {mode}: put it before the unit's reduce_scatter / all_reduce")
        self.issued[u].update((PARTIAL_GRADS, b) for b in op.buffers)

    def all_gather(self, i: int, op: Op) -> None:
        u, mode, state, gathering = op.unit, self.mode, self.state, self.gathering
        unscaled = sorted(b for b in op.buffers if self.plan.buffers[b].amax_bytes and b not in self.scaled)
        if unscaled:
            raise _fail(i, op, f"gathers float8 buffer(s) {unscaled} of unit {u!r} with no all_reduce of their "
                               f"scales before it {mode}: add one at the same trigger")
        self.scaled -= set(op.buffers)
        missing = self.hosted[u] & set(op.buffers) - self.staged
        if missing:
            raise _fail(i, op, f"gathers buffer(s) {sorted(missing)} of unit {u!r}, whose shards live on the "
                               f"host, with no copy_h2d before it {mode}: add one at the same trigger")
        if state[u] == "gathering" and not gathering[u] & set(op.buffers):
            gathering[u] |= set(op.buffers)
            return
        if state[u] != "sharded" and self.transient[u]:
            raise _fail(i, op, f"gathers unit {u!r} again while it is gathered {mode}; free it first")
        state[u], gathering[u] = "gathering", set(op.buffers)

    def wait_params(self, i: int, op: Op) -> None:
        u, mode, state = op.unit, self.mode, self.state
        if state[u] == "sharded" and self.gathers[u] and self.transient[u]:
            raise _fail(i, op, f"reads unit {u!r}'s buffers before their gather {mode}: add an all_gather "
                               f"of {u!r} before it")
        if state[u] == "gathering" and self.gathering[u] != self.to_gather[u]:
            raise _fail(i, op, f"binds unit {u!r}'s parameters, but its buffer(s) "
                               f"{sorted(self.to_gather[u] - self.gathering[u])} were not gathered {mode}")
        state[u] = "bound"
        self.staged -= self.hosted[u]

    def compute(self, step) -> None:
        """What the step's event starts after its ops ran: a unit's compute, its gradients' accumulation."""
        mode = self.mode
        if step.event in (PRE_FORWARD, PRE_BACKWARD):
            if self.state[step.at] != "bound" and self.bufs[step.at]:
                raise PlanError(f"unit {step.at!r} computes at {step.name} but no op before it gathers and waits "
                                f"for its parameters {mode}: the schedule reads its buffers before their gather")
            self.in_use.add(step.at)
        # a unit's gradients accumulate from its pre_backward on (the root's from begin_backward): its
        # unsharded gradient must exist by then
        late = {BEGIN_BACKWARD: ROOT, PRE_BACKWARD: step.at}.get(step.event)
        if late is not None and self.has_grads[late] and late not in self.prepared:
            raise PlanError(f"unit {late!r}'s gradients start at {step.name} but no prepare op of its grads runs "
                            f"by then {mode}: add one at that step")

    def end(self, grad: bool, sync: bool) -> None:
        """The step's end: every gradient reduced (and copied to the host where offloaded), the used-parameter
        exchange waited for, nothing left gathered."""
        units, mode = self.units, self.mode
        if grad and sync:
            left = [n for n in units if self.has_grads[n] and n not in self.waited]
            if left:
                raise PlanError(f"the schedule leaves the gradients of unit(s) {left} unreduced {mode}: each needs "
                                f"its reduce_scatter / all_reduce after its post_backward and a wait for grads")
            left = [n for n in units if self.hosted_grads[n] and n in self.waited and n not in self.copied_grads]
            if left:
                raise PlanError(f"the schedule never copies the gradients of unit(s) {left} to the host {mode}, but "
                                f"the plan offloads their optimizer step: add a copy_d2h of grads after each one's wait")
            if not self.used_waited:
                raise PlanError(f"the schedule lacks the used-parameter exchange at end_backward {mode} (an "
                                f"all_reduce and a wait of what='used'): parameters no rank used would get zero "
                                f"gradients")
        leaked = [n for n in units if self.state[n] != "sharded" and self.transient[n]]
        if leaked:
            raise PlanError(f"the schedule leaves unit(s) {leaked} gathered when the step ends {mode}: free them")
