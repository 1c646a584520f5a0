"""The schedule: every op one training step runs, the event that triggers it, and its condition.

A step is a sequence of *events*: ``before_forward``; ``pre_forward(u)`` / ``post_forward(u)`` as each
unit's forward starts and ends (nested units nest); ``begin_backward`` at the first event of a
backward; ``pre_backward(u)`` when the gradient of a unit's output arrives; ``post_backward(u)`` when a
unit's gradients are complete; ``end_backward``. Every buffer transition is an op: ``prepare grads``
makes a unit's unsharded gradient exist before any of its gradients accumulate. Each op names the
event it runs on (``event``, ``at``) and a condition (``when``):

* ``""``: always; ``"stale"``: only when the shards changed since the last gather (the optimizer may
  have stepped: ZeRO-1/2 re-gather lazily before the next forward); ``"sync"``: only in a backward that
  synchronises gradients (not under ``no_sync``); ``"no_grad"``: only in a forward with no backward.

The steps run strictly in plan order on every rank, whatever the local data does, so every rank issues
the same collectives in the same order (a total order: blocking waits then cannot deadlock). An event
that arrives early makes the runtime run the steps before it first: a unit the model skipped is still
gathered and its gradient (zeros) still reduced. A ``post_backward(u)`` step runs once ``u``'s
gradients are complete, or when a later event needs the steps after it; a gradient that reaches ``u``
after its reduction is an error, never a silent loss. ``order="dynamic"`` moves every gradient op to
``end_backward`` and every forward free to the end of the forward, so units may run in any order or
repeatedly (at the memory cost of keeping them gathered).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from ..errors import PlanError
from ..units import ROOT
# [Note: the names below are re-exported: the runtime and users import them from here]
from .kinds import (ALL_GATHER, ALL_REDUCE, ALWAYS, BACKWARD, BEFORE_FORWARD, BEGIN_BACKWARD, PREPARE, COLLECTIVES, CONDITIONS, END_BACKWARD,
                    COPY_D2H, COPY_H2D, OPTIM_STEP, Offload,
                    EVENTS, FORWARD, FREE, GRADS, KINDS, NO_GRAD, ORDERS, PARAMS, POST_BACKWARD, POST_FORWARD,
                    PARTIAL_GRADS, PRE_BACKWARD, PRE_FORWARD, REDUCE_SCATTER, SCALES, STALE, STEP, STRATEGIES, SYNC, USED, WAIT, Condition,
                    Event, OpKind, Order, Subject)
from .ops import Op, Program, Step

if TYPE_CHECKING:  # pragma: no cover
    from .values import BufferPlan, UnitPlan

__all__ = ["ALL_GATHER", "REDUCE_SCATTER", "ALL_REDUCE", "WAIT", "FREE", "PREPARE", "COPY_D2H", "COPY_H2D", "OPTIM_STEP", "BEGIN_BACKWARD", "COLLECTIVES", "KINDS", "PARAMS", "GRADS",
           "USED", "SCALES", "PARTIAL_GRADS", "BEFORE_FORWARD", "PRE_FORWARD", "POST_FORWARD", "PRE_BACKWARD", "POST_BACKWARD", "END_BACKWARD",
           "EVENTS", "ALWAYS", "STALE", "SYNC", "NO_GRAD", "CONDITIONS", "ORDERS", "FORWARD", "BACKWARD", "STEP",
           "STRATEGIES", "ROOT", "Op", "Step", "Program", "OpKind", "Subject", "Event", "Condition", "Order",
           "interleave", "skeleton", "needs_gather", "build_schedule", "program", "select"]


# -- the event skeleton ------------------------------------------------------------------------------

def interleave(bwd_order: Sequence[str], grad_order: Sequence[str]) -> list[tuple[str, str]]:
    """Backward events in the order they come for units run in plan order: a unit completes
    (``post_backward``) once its own backward started and every unit before it in the gradient stream
    (units nested in it among them) completed."""
    out, started, g = [], set(), 0
    for u in bwd_order:
        out.append((PRE_BACKWARD, u))
        started.add(u)
        while g < len(grad_order) and grad_order[g] in started:
            out.append((POST_BACKWARD, grad_order[g]))
            g += 1
    out += [(POST_BACKWARD, u) for u in grad_order[g:]]
    return out


def skeleton(units: Sequence["UnitPlan"]) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(forward events, backward (pre_backward) unit order, gradient (post_backward) unit order).

    ``units``: root first, then forward order; ``parent`` says which unit encloses each one.
    """
    fwd: list[tuple[str, str]] = [(BEFORE_FORWARD, ""), (PRE_FORWARD, ROOT)]
    stack: list[str] = []
    pre_order, post_order = [], []
    for u in units[1:]:
        while stack and stack[-1] != u.parent:
            top = stack.pop()
            fwd.append((POST_FORWARD, top))
            post_order.append(top)
        fwd.append((PRE_FORWARD, u.name))
        pre_order.append(u.name)
        stack.append(u.name)
    while stack:
        top = stack.pop()
        fwd.append((POST_FORWARD, top))
        post_order.append(top)
    fwd.append((POST_FORWARD, ROOT))
    return fwd, list(reversed(post_order)), list(reversed(pre_order))


# -- building --------------------------------------------------------------------------------------

def needs_gather(b: "BufferPlan") -> bool:
    """A buffer whose full parameters must be produced from the shard (collective, or a local cast)."""
    return b.sharded or not b.alias


def build_schedule(units: Sequence["UnitPlan"], buffers: Sequence["BufferPlan"], mesh, level: int, prefetch: int,
                   order: Order = Order.STATIC, n_params: int = 0) -> tuple[Op, ...]:
    """The schedule of one training step. ``units``: root first, then forward order."""
    fwd_events, bwd_order, grad_order = skeleton(units)
    pre_order = [ROOT] + list(reversed(grad_order))
    make = _Ops(units, buffers, mesh, prefetch)
    ops = _forward(make, fwd_events, pre_order, level, order)
    prev, backward = _backward(make, bwd_order, grad_order, level, order)
    return tuple(ops + backward + _end_backward(make, prev, pre_order, level, n_params))


class _Ops:
    """The op makers of one schedule (each returns a list of ops for one unit at one event) and the one
    piece of state the forward and the backward share: which units are gathered now (``gathered``)."""

    def __init__(self, units: Sequence["UnitPlan"], buffers: Sequence["BufferPlan"], mesh, prefetch: int):
        self.by_name = {u.name: u for u in units}
        self.buffers, self.mesh, self.prefetch = buffers, mesh, prefetch
        self.gathered: set[str] = set()

    def bufs(self, u: str, pred) -> list["BufferPlan"]:
        return [self.buffers[i] for i in self.by_name[u].buffers if pred(self.buffers[i])]

    def mine(self, u: str) -> list["BufferPlan"]:
        return [self.buffers[i] for i in self.by_name[u].buffers]

    @staticmethod
    def op(kind, u, what, event, at, entries=(), axes_of=None, nbytes=0, prefetch_=False, when=ALWAYS) -> Op:
        entries = list(entries)
        axes = tuple(dict.fromkeys(a for b in entries for a in (axes_of(b) if axes_of else b.axes)))
        return Op(kind=kind, unit=u, what=what, event=event, at=at, buffers=tuple(b.index for b in entries), axes=axes,
                  bytes=nbytes, prefetch=prefetch_, when=when)

    @staticmethod
    def by_group(entries, axes_of) -> list[list["BufferPlan"]]:
        """``entries`` split by the process group their collective runs over: one op names one group."""
        groups: dict = {}
        for b in entries:
            groups.setdefault(tuple(axes_of(b)), []).append(b)
        return list(groups.values())

    def gather(self, u, event, at, pf=False, when=ALWAYS) -> list[Op]:
        op = self.op
        entries = self.bufs(u, needs_gather)
        if not entries:
            return []
        # a local cast (a replicated buffer computing in another dtype) rides with the first group's op
        parts = self.by_group([b for b in entries if b.sharded], lambda b: b.axes) or [[]]
        parts[0] = [b for b in entries if not b.sharded] + parts[0]
        # CPU offload of the parameters: the shard is copied in from the host ahead of each of its gathers
        hosted = [b for b in entries if b.offload == Offload.PARAMS]
        copy = [op(COPY_H2D, u, PARAMS, event, at, hosted, lambda b: (), sum(b.shard_numel * b.itemsize for b in hosted),
                   pf, when)] if hosted else []
        out = list(copy)
        for p in parts:
            p = sorted(p, key=lambda b: b.index)
            # FP8 compute: the float8 weights' absmaxes over the gather's group first (their scales)
            tw = [b for b in p if b.amax_bytes]
            if tw:
                out.append(op(ALL_REDUCE, u, SCALES, event, at, tw, lambda b: b.axes, sum(b.amax_bytes for b in tw),
                              pf, when))
            out.append(op(ALL_GATHER, u, PARAMS, event, at, p, lambda b: b.axes if b.sharded else (),
                          sum(b.gather_bytes for b in p if b.sharded), pf, when))
        return out

    def copy_back(self, u, event=BEFORE_FORWARD, at="", pf=False, when=STALE) -> list[Op]:
        """CPU offload of the optimizer: the shards the host stepped are on the device before anything reads
        them. ZeRO-1/2 gather every unit at ``before_forward`` after a step (``stale``), so every copy comes
        first; ZeRO-3 copies each unit in just before its first forward gather (``always``: a no-op but
        after a step), so the next forward waits for unit k's host step only ([Note: the host step overlaps
        the next forward], runtime/offload/)."""
        mine = self.bufs(u, lambda b: b.offload == Offload.OPTIMIZER)
        return [self.op(COPY_H2D, u, PARAMS, event, at, mine, lambda b: (),
                        sum(b.shard_numel * b.itemsize for b in mine), pf, when)] if mine else []

    def wait_params(self, u, event, at, when=ALWAYS) -> list[Op]:
        mine = self.mine(u)
        return [self.op(WAIT, u, PARAMS, event, at, mine, when=when)] if mine else []

    def free_params(self, u, event, at, when=ALWAYS) -> list[Op]:
        mine = self.mine(u)
        return [self.op(FREE, u, PARAMS, event, at, mine, when=when)] if mine else []

    def prepare(self, u, event, at) -> list[Op]:
        grads = self.bufs(u, lambda b: b.requires_grad)
        return [self.op(PREPARE, u, GRADS, event, at, grads, lambda b: ())] if grads else []  # local: no group

    def reduce(self, u, event, at) -> list[Op]:
        op, mesh = self.op, self.mesh
        grads = self.bufs(u, lambda b: b.requires_grad)
        if not grads:
            return []
        out = []
        # [Note: partial gradients] (planner/tp_partial.py) summed over their compute axis first
        for ar in self.by_group([b for b in grads if b.partial_axes and mesh.axis_size(b.partial_axes) > 1],
                                lambda b: b.partial_axes):
            out.append(op(ALL_REDUCE, u, PARTIAL_GRADS, event, at, ar, lambda b: b.partial_axes,
                          sum(b.gathered_numel * b.reduce_itemsize for b in ar), when=SYNC))
        for rs in self.by_group([b for b in grads if b.sharded], lambda b: b.axes):
            out.append(op(REDUCE_SCATTER, u, GRADS, event, at, rs, None,
                          sum(b.reduce_bytes for b in rs), when=SYNC))
        for ar in self.by_group([b for b in grads if b.replica_axes and mesh.axis_size(b.replica_axes) > 1],
                                lambda b: b.replica_axes):
            out.append(op(ALL_REDUCE, u, GRADS, event, at, ar, lambda b: b.replica_axes,
                          sum(b.reduced_numel * b.reduce_itemsize for b in ar), when=SYNC))
        return out

    def finish(self, u, event, at) -> list[Op]:
        op = self.op
        grads = self.bufs(u, lambda b: b.requires_grad)
        if not grads:
            return []
        out = [op(WAIT, u, GRADS, event, at, grads, when=SYNC)]
        hosted = [b for b in grads if b.offload]  # CPU offload: the reduced gradient shard goes to the host
        if hosted:
            nbytes = sum(b.shard_numel * b.itemsize for b in hosted)
            out.append(op(COPY_D2H, u, GRADS, event, at, hosted, lambda b: (), nbytes, when=SYNC))
            # ... and the host steps it while backward goes on (runtime/offload/: [Note: the overlapped step])
            out.append(op(OPTIM_STEP, u, PARAMS, event, at, hosted, lambda b: (), nbytes, when=SYNC))
        transient = [b for b in grads if not b.keeps_grads]
        if transient:
            out.append(op(FREE, u, GRADS, event, at, transient, when=SYNC))
        return out

    def unshard(self, order_: list[str], u: str, event: str) -> list[Op]:
        """Gather ``u`` unless a prefetch did, wait for it, and prefetch the next ``prefetch`` units."""
        out = []
        j = order_.index(u)
        for k, v in enumerate(order_[j:j + 1 + self.prefetch]):
            if v not in self.gathered:
                if event == PRE_FORWARD:  # (ZeRO-3) the stepped shards of v first
                    out += self.copy_back(v, event, u, pf=k > 0, when=ALWAYS)
                out += self.gather(v, event, u, pf=k > 0)
                self.gathered.add(v)
            if k == 0:
                out += self.wait_params(u, event, u)
        return out


def _forward(make: _Ops, fwd_events, pre_order: list[str], level: int, order: Order) -> list[Op]:
    """The forward's ops: the parameter stream (copies in, gathers, waits, frees)."""
    ops: list[Op] = []
    deferred: list[Op] = []
    for event, at in fwd_events:
        if event == BEFORE_FORWARD:
            if level != 3:
                for u in pre_order:
                    ops += make.copy_back(u)
            if level in (0, 1, 2):
                for u in pre_order:
                    ops += make.gather(u, event, at, when=STALE)
            continue
        if event == PRE_FORWARD:
            ops += make.unshard(pre_order, at, event) if level == 3 else make.wait_params(at, event, at)
            continue
        # post_forward
        if at == ROOT:
            ops += deferred
            for u in pre_order:
                if level != 3 or u in make.gathered:
                    ops += make.free_params(u, event, at, when=NO_GRAD)
            continue
        if level == 3 and make.by_name[at].reshard_after_forward:
            freed = make.free_params(at, event, at)
            if order == Order.DYNAMIC:  # keep units gathered until the forward ends: they may run again
                deferred += [Op(kind=o.kind, unit=o.unit, what=o.what, event=POST_FORWARD, at=ROOT, buffers=o.buffers,
                                axes=o.axes, bytes=o.bytes) for o in freed]
            else:
                ops += freed
            make.gathered.discard(at)
    return ops


def _backward(make: _Ops, bwd_order: list[str], grad_order: list[str], level: int,
              order: Order) -> tuple[Optional[str], list[Op]]:
    """The backward's ops up to ``end_backward``'s own: both streams, in the order they interleave for units
    run in plan order; and the unit whose reduction is still in flight at the end (``None``: none)."""
    ops: list[Op] = []
    prev: Optional[str] = None
    late: list[Op] = []
    ops += make.prepare(ROOT, BEGIN_BACKWARD, "")  # the root's gradients may arrive at any point of backward
    for event, u in interleave(bwd_order, grad_order):
        if event == PRE_BACKWARD:
            if level == 3:
                ops += make.unshard(bwd_order, u, event)
            ops += make.prepare(u, event, u)  # before any gradient of the unit is accumulated
            continue
        # the gradient stream keeps one reduction in flight: the previous one completes first. Under
        # order="dynamic" units may finish their backward in any order, so it all runs at end_backward
        ev, at = (END_BACKWARD, "") if order == Order.DYNAMIC else (event, u)
        if any(make.buffers[i].requires_grad for i in make.by_name[u].buffers):
            if prev is not None:
                late += make.finish(prev, ev, at)
            late += make.reduce(u, ev, at)
            prev = u
        if level == 3:
            late += make.free_params(u, ev, at)
            make.gathered.discard(u)
        if order != Order.DYNAMIC:
            ops += late
            late = []
    ops += late
    return prev, ops


def _end_backward(make: _Ops, prev: Optional[str], pre_order: list[str], level: int, n_params: int) -> list[Op]:
    """``end_backward``'s own ops: the used-parameter exchange, the last reductions, the last frees."""
    ops: list[Op] = []
    # every gradient has arrived: which parameters got one is known, and its exchange overlaps the rest
    ops.append(Op(kind=ALL_REDUCE, unit="", what=USED, event=END_BACKWARD, axes=make.mesh.axis_names, bytes=n_params,
                  when=SYNC))
    if prev is not None:
        ops += make.finish(prev, END_BACKWARD, "")
    ops += make.reduce(ROOT, END_BACKWARD, "")
    ops += make.finish(ROOT, END_BACKWARD, "")
    ops.append(Op(kind=WAIT, unit="", what=USED, event=END_BACKWARD, when=SYNC))
    for u in ([ROOT] if level == 3 else pre_order):
        ops += make.free_params(u, END_BACKWARD, "")
    return ops


def program(units: Sequence["UnitPlan"], schedule: Sequence[Op]) -> Program:
    """Assign every op of ``schedule`` to its step; raise :class:`PlanError` for an op whose trigger the
    step skeleton does not have."""
    fwd_events, bwd_order, grad_order = skeleton(units)
    bwd_events = [(BEGIN_BACKWARD, "")] + interleave(bwd_order, grad_order)
    slots: dict[tuple[str, str], list[int]] = {e: [] for e in fwd_events + bwd_events + [(END_BACKWARD, "")]}
    for i, o in enumerate(schedule):
        if o.in_module:  # runs inside a module's call (tensor parallelism), placed after a step's ops
            continue
        key = (o.event, o.at)
        if key not in slots:
            known = [f"{e}({a})" if a else e for e, a in slots]
            raise PlanError(f"schedule op #{i} ({o.kind} {o.what} of {o.unit!r}) is triggered by {o.trigger}, "
                            f"which never happens in this plan; triggers: {', '.join(known[:12])} ...")
        slots[key].append(i)

    def step(key) -> Step:
        return Step(key[0], key[1], tuple(slots[key]))

    return Program(tuple(step(e) for e in fwd_events), tuple(step(e) for e in bwd_events), step((END_BACKWARD, "")))


def select(schedule: Iterable[Op], *, stale: bool = True, grad: bool = True, sync: bool = True,
           recompute=False) -> tuple[Op, ...]:
    return tuple(o for o in schedule if o.applies(stale=stale, grad=grad, sync=sync, recompute=recompute))
