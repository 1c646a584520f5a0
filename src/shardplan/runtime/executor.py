"""The executor: runs ``plan.schedule`` op by op. Hooks (or the functional face) only report events.

A cursor walks the plan's program (:class:`shardplan.plan.Program`), forward steps then backward
steps, so every rank runs the same ops in the same order whatever its data does:

* An event that arrives ahead of the cursor makes it run every step before it first: a unit the model
  skipped is still gathered and freed, and its gradient (zeros) still reduced.
* An event behind the cursor is harmless while its unit is still gathered; if the plan already freed
  the unit, the model departed from the plan and the executor raises, naming both events.
* A ``post_backward(u)`` step runs as soon as every gradient of ``u`` arrived and the cursor reached it,
  or when a later event needs the steps after it: the next unit's ``pre_backward`` fires only once
  ``u``'s backward is over (autograd accumulates a parameter's gradient as soon as it is ready, before
  anything upstream), so a unit whose parameters did not all get a gradient completes right then.
  ``end_backward`` runs whatever is left. A gradient that reaches ``u`` after its reduction raises: it
  would otherwise be lost.

Gradient accumulation windows end at each synchronising backward: the unsharded gradients are zeroed
lazily at the first touch of the next window, and an all-reduce of "which parameters got a gradient"
gives parameters no rank used a ``None`` gradient, as plain PyTorch does.
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import CollectiveError, RuntimeShardingError
from ..plan import Plan
from ..plan.schedule import (ALL_GATHER, ALL_REDUCE, FREE, GRADS, PARAMS, POST_BACKWARD, POST_FORWARD, PRE_BACKWARD,
                             PRE_FORWARD, REDUCE_SCATTER, ROOT, STALE, USED, WAIT, Op, Step)
from . import collectives as C
from .streams import Streams
from .unit import Grads, Params, PendingGather, PendingReduce, UnitRuntime


def _profiling() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


def in_backward_pass() -> bool:
    """True while the autograd engine runs (a forward now is a recomputation: activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


class Executor:
    """The runtime state of one sharded model. Attached as ``module._shardplan`` by :func:`shard`."""

    def __init__(self, plan: Plan, units: list[UnitRuntime], groups: C.Groups, device: torch.device, rank: int,
                 timeout_s: float, face=None):
        self.plan, self.rank, self.device, self.groups, self.timeout_s = plan, rank, device, groups, timeout_s
        self.units = {u.name: u for u in units}
        self.unit_list = units
        self.buffer = {b.bp.index: b for u in units for b in u.buffers}
        # the face: how gathered parameters reach the compute and where reduced gradients go (runtime/faces.py)
        self.face = face
        self.streams = Streams(device)
        self.ops = plan.schedule
        self.prog = plan.program
        self.fwd_at = {(s.event, s.at): k for k, s in enumerate(self.prog.forward)}
        self.pre_at = {s.at: k for k, s in enumerate(self.prog.backward) if s.event == PRE_BACKWARD}
        self.fwd_pos = self.bwd_pos = 0
        self.stale = True          # shards changed since the last gather (ZeRO-1/2 gather before the next forward)
        self.sync = True           # this backward reduces gradients (False under no_sync)
        self.window = 0            # gradient accumulation window; ends with each synchronising backward
        self.in_backward = False
        self.awaiting_backward = False
        self.used = bytearray(len(plan.params))  # parameters that got a gradient on this rank in this window
        self.used_pending: Optional[tuple] = None
        self.versions = -1
        self.record: Optional[list] = None
        self.hook_seconds = 0.0
        self.track_memory = False
        self.live_bytes = self.peak_live_bytes = 0
        self.n_gathered = self.max_gathered = 0
        self.transient = {u.name for u in units if any(not b.bp.persistent for b in u.buffers)}
        # the plan keeps full parameters between steps and re-gathers them only when the shards went stale
        self.regathers = any(op.when == STALE for op in self.ops)
        self._todo: dict[tuple, list] = {}
        self._run_op = {(ALL_GATHER, PARAMS): self._all_gather, (WAIT, PARAMS): self._wait_params,
                        (FREE, PARAMS): self._free_params, (REDUCE_SCATTER, GRADS): self._reduce,
                        (ALL_REDUCE, GRADS): self._reduce, (WAIT, GRADS): self._wait_grads,
                        (FREE, GRADS): self._free_grads, (ALL_REDUCE, USED): self._exchange_used,
                        (WAIT, USED): self._wait_used}

    # -- events: forward -----------------------------------------------------------------------------
    def before_forward(self) -> None:
        if self.in_backward or self.awaiting_backward or 0 < self.fwd_pos < len(self.prog.forward):
            self._abandon()
        self.fwd_pos = 0
        for u in self.unit_list:
            u.start_forward()
        if self.regathers and not self.stale and self._versions() != self.versions:
            raise RuntimeShardingError(
                "the local shards changed since the last all-gather of the full parameters, but no gradient-"
                "synchronising backward came in between (ZeRO-0/1/2 re-gather after one): call optimizer.step() "
                "between backward and the next forward, or shardplan.mark_shards_changed(model) after changing "
                "the shards by hand")
        self._advance_forward(0)
        self.stale = False

    def pre_forward(self, name: str) -> None:
        if in_backward_pass():  # a recomputation (activation checkpointing): the unit's backward begins
            self.pre_backward(name)
            return
        self.units[name].entered += 1
        k = self.fwd_at[(PRE_FORWARD, name)]
        if k >= self.fwd_pos:
            self._advance_forward(k)
            return
        u = self.units[name]
        if u.params is not Params.UNSHARDED and u.buffers:
            raise RuntimeShardingError(self._departure(f"pre_forward({name})", self.prog.forward, self.fwd_pos))

    def post_forward(self, name: str) -> None:
        if in_backward_pass():
            return
        k = self.fwd_at[(POST_FORWARD, name)]
        if k >= self.fwd_pos:
            self._advance_forward(k)
        if name == ROOT:
            self.awaiting_backward = torch.is_grad_enabled()
            if self.regathers:  # the full parameters now match the shards (see before_forward)
                self.versions = self._versions()

    def _advance_forward(self, k: int) -> None:
        grad = torch.is_grad_enabled()
        while self.fwd_pos <= k:
            step = self.prog.forward[self.fwd_pos]
            self.fwd_pos += 1
            self._run_step(step, grad=grad)

    def _departure(self, event: str, steps, pos: int) -> str:
        expected = steps[pos].name if pos < len(steps) else "the end of this pass"
        unit = event[event.index("(") + 1:-1]
        return (f"shardplan: {event} arrived but the plan already freed unit {unit!r}: the model ran it again or out of "
                f"plan order (the schedule expected {expected} next). Units that run in a data-dependent order or "
                f"more than once per step need plan(..., order='dynamic') (keeps units gathered until the forward "
                f"ends) or plan.with_reshard_after_forward({{{unit!r}: False}}); a fixed order other than module "
                f"registration needs plan(..., trace=(args, kwargs)) or other units=")

    # -- events: backward ------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        self.awaiting_backward = False
        for u in self.unit_list:
            u.start_pass()
        me = weakref.ref(self)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: me() and me().end_backward())
        self._prepare(self.units[ROOT])

    def pre_backward(self, name: str) -> None:
        self.begin_backward()
        k = self.pre_at.get(name)
        if k is None:
            return
        u = self.units[name]
        if k >= self.bwd_pos:
            self._advance_backward(k)
            self._drain()
        elif u.params is not Params.UNSHARDED and u.buffers and u.grads in (Grads.REDUCING, Grads.DONE):
            raise RuntimeShardingError(self._departure(f"pre_backward({name})", self.prog.backward, self.bwd_pos))

    def _advance_backward(self, k: int) -> None:
        """Run the backward steps up to ``k``. A ``post_backward`` step passed this way completes its unit:
        a later event needs what comes after it, so its gradients are as complete as they will get."""
        while self.bwd_pos <= k:
            step = self.prog.backward[self.bwd_pos]
            self.bwd_pos += 1
            u = self.units[step.at]
            if step.event == POST_BACKWARD:
                self._run_step(step, grad=True)
                if u.grads in (Grads.IDLE, Grads.RUNNING):  # passed without a reduction (no_sync, dynamic)
                    u.grads = Grads.COMPLETE
                continue
            self._run_step(step, grad=True)
            self._prepare(u)
            if u.grads is Grads.IDLE:
                u.grads = Grads.RUNNING

    def _drain(self) -> None:
        """Run ``post_backward`` steps at the cursor whose units are complete."""
        steps = self.prog.backward
        while self.bwd_pos < len(steps) and steps[self.bwd_pos].event == POST_BACKWARD \
                and self.units[steps[self.bwd_pos].at].grads is Grads.COMPLETE:
            self._advance_backward(self.bwd_pos)

    def on_grad(self, name: str, index: int) -> None:
        """A full parameter's gradient was accumulated (post-accumulate-grad hook)."""
        self.begin_backward()
        self.used[index] = 1
        u = self.units[name]
        self.check_not_reduced(u, [self.plan.params[index].name])
        u.got += 1
        if u.grads is Grads.IDLE:
            u.grads = Grads.RUNNING
        if u.got >= u.expected and name != ROOT:
            self._complete(u)

    def check_not_reduced(self, u: UnitRuntime, names: list[str]) -> None:
        """A gradient arriving for ``u`` after its reduction would be lost: raise instead."""
        if u.grads in (Grads.REDUCING, Grads.DONE) and self.sync:
            raise RuntimeShardingError(
                f"shardplan: parameter {names[0]!r} of unit {u.name!r} received a gradient after the unit's gradients "
                f"were reduced: it is used outside the unit's forward, or the units' backward ran in another order "
                f"than the plan's. Move it to the root unit (units=...), use it inside its unit's forward, or plan "
                f"with order='dynamic' (reduces every gradient at the end of backward)")

    def complete(self, name: str) -> None:
        """Every gradient of unit ``name`` has arrived (the functional face knows it exactly)."""
        if name != ROOT:
            self._complete(self.units[name])

    def _complete(self, u: UnitRuntime) -> None:
        if u.grads in (Grads.IDLE, Grads.RUNNING):
            u.grads = Grads.COMPLETE
            self._drain()

    def end_backward(self) -> None:
        """The autograd engine's final callback: run every backward step left, then ``end_backward``."""
        try:
            self._advance_backward(len(self.prog.backward) - 1)
            self._run_step(self.prog.end, grad=True)
            self._release_leftovers()
        finally:
            self.fwd_pos = self.bwd_pos = 0
            self.in_backward = False
            if self.sync:
                self.window += 1
                self.stale = self.stale or self.face.stale_after_sync
                self.used = bytearray(len(self.plan.params))
                self.face.window_ended()
            for u in self.unit_list:
                u.start_pass()
            self._account()

    # -- running ops ---------------------------------------------------------------------------------
    def _run_step(self, step: Step, *, grad: bool) -> None:
        key = (step.event, step.at, self.stale, grad, self.sync)
        todo = self._todo.get(key)
        if todo is None:  # which ops of this step run under these facts, with their handlers: once
            todo = self._todo[key] = [(self.ops[i], self._run_op[(self.ops[i].kind, self.ops[i].what)])
                                      for i in step.ops if self.ops[i].applies(stale=key[2], grad=grad, sync=key[4])]
        for op, fn in todo:
            self.run(op, fn)

    def run(self, op: Op, fn=None) -> None:
        if self.record is not None:
            self.record.append(op)
        fn = fn or self._run_op[(op.kind, op.what)]
        if _profiling():
            with torch.profiler.record_function(f"shardplan.{op.kind} {op.what} unit={op.unit} at={op.trigger}"):
                fn(op)
        else:
            fn(op)
        if self.track_memory:
            self._account()

    def _unit(self, op: Op) -> UnitRuntime:
        return self.units[op.unit]

    def _all_gather(self, op: Op) -> None:
        u = self._unit(op)
        works, keep = [], []
        cuda = self.streams.cuda
        outs = [(self.buffer[i], self.buffer[i].gather_output()) for i in op.buffers]
        with self.streams.on("gather"):
            for b, out in outs:
                group = self.groups.gather(b.bp.axes) if b.sharded else C.Group(None, 1, 0)
                collective = group.pg is not None
                send = self.face.gather_input(b, collective)
                if collective:
                    keep.append(send)
                    works.append(self._call(C.all_gather, op, out, send, group, async_op=not cuda))
                elif out.data_ptr() != send.data_ptr():
                    with torch.no_grad():
                        out.copy_(send)
        u.gather = PendingGather(op, works, self.streams.event("gather"), keep)
        if u.params is Params.SHARDED and u.name in self.transient:
            self.n_gathered += 1
            self.max_gathered = max(self.max_gathered, self.n_gathered)
        u.params = Params.GATHERING

    def _finish_gather(self, u: UnitRuntime) -> None:
        g = u.gather
        for w in g.works:
            self._wait(w, g.op)
        self.streams.wait(g.event)
        for i in g.op.buffers:
            self.buffer[i].finish_gather()
        u.gather = None

    def _wait_params(self, op: Op) -> None:
        u = self._unit(op)
        if u.gather is not None:
            self._finish_gather(u)
        elif u.params is Params.SHARDED and u.name in self.transient:
            raise RuntimeShardingError(f"shardplan: {op.trigger} waits for unit {u.name!r}'s parameters but nothing "
                                       f"gathered them; the schedule is inconsistent")
        u.params = Params.UNSHARDED
        self.face.bind(u)

    def _free_params(self, op: Op) -> None:
        self._reshard(self._unit(op), [self.buffer[i] for i in op.buffers])

    def _reduce(self, op: Op) -> None:
        u = self._unit(op)
        if u.reduce is None:
            inputs = {b.bp.index: b.reduction_input(self.window, self._local_result(b)) for b in u.with_grads}
            u.reduce = PendingReduce(op, {i: [] for i in inputs}, inputs, {})
            u.grads = Grads.REDUCING
        rec = u.reduce
        cuda = self.streams.cuda
        if op.kind == REDUCE_SCATTER:
            todo = []
            for i in op.buffers:
                b, group = self.buffer[i], self.groups.reduce(self.buffer[i].bp.axes)
                if group.pg is None:  # a group of one: the (cast) gradient is the result
                    rec.results[i] = rec.inputs[i]
                    continue
                rec.results[i] = self.face.reduce_output(b)
                todo.append((i, group))
            with self.streams.on("reduce"):
                for i, group in todo:
                    rec.works[i].append(self._call(C.reduce_scatter, op, rec.results[i], rec.inputs[i], group,
                                                   async_op=not cuda))
        else:
            for i in op.buffers:
                group = self.groups.reduce(self.buffer[i].bp.replica_axes)
                target = rec.results.setdefault(i, rec.inputs[i])
                if not cuda:  # gloo: the all-reduce reads the reduce-scatter's output
                    for w in rec.works[i]:
                        self._wait(w, op)
                    rec.works[i] = []
                with self.streams.on("reduce"):
                    rec.works[i].append(self._call(C.all_reduce, op, target, group, async_op=not cuda))
        rec.event = self.streams.event("reduce")

    def _local_result(self, b) -> Optional[torch.Tensor]:
        """Where a reduction that moves nothing (a shard group of one, replicated) should leave its result,
        if the face has a place for it; else the reduction's input is the result."""
        local = (not b.sharded) or self.groups.reduce(b.bp.axes).pg is None
        return self.face.local_reduce_output(b) if local else None

    def _wait_grads(self, op: Op) -> None:
        u = self._unit(op)
        rec = u.reduce
        if rec is None:  # nothing to reduce on this mesh: the gradient is its own result
            inputs = {b.bp.index: b.reduction_input(self.window, self._local_result(b)) for b in u.with_grads}
            rec = PendingReduce(op, {}, inputs, {})
        for ws in rec.works.values():
            for w in ws:
                self._wait(w, op)
        self.streams.wait(rec.event)
        for i in op.buffers:
            b = self.buffer[i]
            self.face.deliver(b, rec.results.get(i, rec.inputs[i]))
            b.detach_grads()
        u.reduce = None
        u.grads = Grads.DONE

    def _free_grads(self, op: Op) -> None:
        for i in op.buffers:
            self.buffer[i].release_grads()

    def _exchange_used(self, op: Op) -> None:
        flags = torch.frombuffer(self.used, dtype=torch.uint8).to(torch.int32)  # a copy: the collective writes it
        group = self.groups.used
        work = self._call(C.all_reduce, op, flags, group, async_op=True, op=dist.ReduceOp.MAX)
        self.used_pending = (work, flags)

    def _wait_used(self, op: Op) -> None:
        work, flags = self.used_pending
        self._wait(work, op)
        self.used_pending = None
        self.face.unused([i for i, f in enumerate(flags.tolist()) if not f])

    # -- helpers -----------------------------------------------------------------------------------
    def _prepare(self, u: UnitRuntime) -> None:
        for b in u.with_grads:
            b.prepare_grads(self.window)
        self._account()

    def _versions(self) -> int:
        return self.face.shard_version()

    def _abandon(self) -> None:
        """A step ended without its backward (or was interrupted): finish what is in flight and release what
        the schedule would have released. Only local work: every rank reaches here the same way."""
        for u in self.unit_list:
            if u.gather is not None:
                self._finish_gather(u)
            if u.reduce is not None:
                for ws in u.reduce.works.values():
                    for w in ws:
                        self._wait(w, u.reduce.op)
                u.reduce = None
            self._reshard(u)
        self.fwd_pos = self.bwd_pos = 0
        self.in_backward = self.awaiting_backward = False

    def _release_leftovers(self) -> None:
        """After end_backward every unit must be sharded again (units the step never reached included)."""
        for u in self.unit_list:
            if u.params is not Params.SHARDED:
                self._reshard(u)

    def _reshard(self, u: UnitRuntime, buffers=None) -> None:
        """The modules hold ``u``'s local shards again and its gathered storage is released."""
        if u.gather is not None:
            self._finish_gather(u)
        self.face.unbind(u)
        for b in (u.buffers if buffers is None else buffers):
            b.release_full()
        if u.params is not Params.SHARDED and u.name in self.transient:
            self.n_gathered -= 1
        u.params = Params.SHARDED

    def _wait(self, work, op: Op) -> None:
        try:
            if self.streams.cuda or work is C.DONE:
                work.wait()  # NCCL: the compute stream waits; the process group's own timeout applies
            elif not work.wait(timeout=timedelta(seconds=self.timeout_s)):
                raise TimeoutError(f"no completion within {self.timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - re-raised with the op named
            raise CollectiveError(f"shardplan: {op.kind} {op.what} unit={op.unit or 'all'} at {op.trigger} failed on "
                                  f"rank {self.rank}: {exc}. Every rank must run the same schedule: check that all "
                                  f"ranks called forward/backward") from exc

    def _call(self, fn, sched_op: Op, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            o = sched_op
            raise CollectiveError(f"shardplan: {o.kind} {o.what} unit={o.unit or 'all'} at {o.trigger} failed "
                                  f"on rank {self.rank}: {exc}") from exc

    # -- inspection ---------------------------------------------------------------------------------
    def _account(self) -> None:
        """Live bytes of every distinct storage the runtime holds (see ``plan.memory()``)."""
        if not self.track_memory:
            return
        seen: dict[int, int] = {}
        for u in self.unit_list:
            for t in u.tensors():
                if t is not None:
                    st = t.untyped_storage()
                    if st.size():
                        seen[st.data_ptr()] = st.size()
        self.live_bytes = sum(seen.values())
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def local_params(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter, by plan name (what the optimizer steps)."""
        return self.face.local_params()

    def shard_of(self, buffer_index: int) -> torch.Tensor:
        """This rank's flat shard of a buffer (``plan.buffers[buffer_index]``)."""
        return self.buffer[buffer_index].shard

    def mark_shards_changed(self) -> None:
        """The local shards were written outside an optimizer step (a checkpoint load): gather again."""
        self.stale = True
