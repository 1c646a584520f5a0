"""The comm engine: issues the schedule's collectives on side streams and waits for them.

It owns the in-flight records (:class:`~shardplan.runtime.unit.PendingGather`,
:class:`~shardplan.runtime.unit.PendingReduce`) and every wait. It never decides *when*: the executor
calls it as the cursor hands out ops. Every collective goes through :mod:`.collectives`; a failure or
a timeout is re-raised as a :class:`~shardplan.errors.CollectiveError` naming the op.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from ..planner.schedule import PARTIAL_GRADS, REDUCE_SCATTER, Op
from . import collectives as C
from .buffers import BufferState
from .streams import Streams
from .unit import PendingGather, PendingReduce, UnitRuntime
from .quantize import dequantize_mean


class CommEngine:
    """Collectives of one sharded model on this rank."""

    def __init__(self, buffers: dict[int, BufferState], groups: C.Groups, device: torch.device, rank: int,
                 timeout_s: float):
        self.buffer, self.groups, self.rank, self.timeout_s = buffers, groups, rank, timeout_s
        self.streams = Streams(device)
        self.face = None  # the executor's face (the executor sets it)

    # -- parameters ----------------------------------------------------------------------------------
    def gather(self, op: Op, u: UnitRuntime) -> None:
        """All-gather ``op``'s buffers of ``u`` on the gather stream; record it as ``u.gather``."""
        face = self.face
        works, keep = [], []
        cuda = self.streams.cuda
        outs = [(self.buffer[i], self.buffer[i].gather_output()) for i in op.buffers]
        groups = [self.groups.gather(op.axes) if b.sharded else C.ONE for b, _ in outs]  # the op names its group
        # [Note: a gather that moves nothing] (a shard group of one: world 1, or replicated buffers) is a
        # local cast or copy: it runs on the compute stream, without a side stream or an event to wait on
        moves = any(g.pg is not None for g in groups)
        with self.streams.on("gather") if moves else contextlib.nullcontext():
            for (b, out), group in zip(outs, groups):
                collective = group.pg is not None
                if b.tw:  # [Note: FP8 compute's tensorwise gather] one scale per weight: the absmax of all of it,
                    # all-reduced by the op before this one (``all_reduce scales``, where the plan has one), or
                    # local over a shard group of one (the plan then has none: ``amax_bytes`` 0)
                    if b.bp.amax_bytes:
                        b.take_scales(op)
                    else:
                        b.set_scales(b.amax())
                send = face.gather_input(b, collective, None if collective else out)
                if collective:
                    keep.append(send)
                    works.append(self.call(C.all_gather, op, out, send, group, async_op=not cuda))
                elif out.data_ptr() != send.data_ptr():
                    with torch.no_grad():
                        out.copy_(send)
        event = self.streams.event("gather") if moves else None
        if u.gather is not None:  # the unit's buffers over another group: one pending gather for all
            g = u.gather
            u.gather = PendingGather(g.op, g.works + works, g.event if event is None else event, g.keep + keep,
                                     g.extra + (op,))
        else:
            u.gather = PendingGather(op, works, event, keep)

    def scales(self, op: Op, buffers: list) -> None:
        """FP8 compute's ``all_reduce scales`` op: each float8 buffer's absmaxes, max over the gather's group (on
        the gather stream, ahead of the all-gather that casts with them), then its scales."""
        group = self.groups.gather(op.axes)
        with self.streams.on("gather") if group.pg is not None else contextlib.nullcontext():
            for b in buffers:
                amax = b.amax()
                self.call(C.all_reduce_max, op, amax, group)
                b.set_scales(amax)
                b.scaled = True

    def finish_gather(self, u: UnitRuntime) -> None:
        """Wait for ``u``'s all-gather, make the compute stream wait for it, copy out interleaved pieces."""
        g = u.gather
        for w in g.works:
            self.wait(w, g.op)
        self.streams.wait(g.event)
        for o in (g.op,) + g.extra:
            for i in o.buffers:
                self.buffer[i].finish_gather()
        u.gather = None

    # -- gradients -----------------------------------------------------------------------------------
    def reduce(self, op: Op, u: UnitRuntime, inputs: Callable[[], dict]) -> None:
        """Reduce-scatter (or all-reduce over replica axes) ``op``'s buffers of ``u`` on the reduce stream;
        ``inputs()`` gives the reduction inputs the first time a reduction of this pass touches ``u``."""
        face = self.face
        if u.reduce is None:
            ins = inputs()
            u.reduce = PendingReduce(op, {i: [] for i in ins}, ins, {})
        rec = u.reduce
        cuda = self.streams.cuda
        if op.what == PARTIAL_GRADS:  # [Note: partial gradients] (planner/tp_partial.py): summed in place first
            group = self.groups.reduce(op.axes)
            if group.pg is None:
                return
            with self.streams.on("reduce"):
                for i in op.buffers:
                    w = self.call(C.all_reduce_sum, op, rec.inputs[i], group, async_op=not cuda)
                    if not cuda:  # gloo: the reduce-scatter over another group reads the sum
                        self.wait(w, op)
            rec.event = self.streams.event("reduce")
            return
        if op.kind == REDUCE_SCATTER:
            todo = []
            for i in op.buffers:
                b, group = self.buffer[i], self.groups.reduce(op.axes)  # the op names its group
                if b.bp.reduce_quant:  # [Note: a quantized reduction] all-to-all of codes and scales, fp32 sum after
                    rec.results[i] = torch.empty(b.S, dtype=torch.float32, device=b.device)
                    rec.unpack[i] = torch.empty_like(rec.inputs[i]) if group.pg is not None else rec.inputs[i]
                    if group.pg is not None:
                        todo.append((i, group))
                    continue
                if group.pg is None:  # a group of one: the (cast) gradient is the result
                    rec.results[i] = rec.inputs[i]
                    continue
                rec.results[i] = face.reduce_output(b)
                todo.append((i, group))
            if not todo:  # nothing moves (a shard group of one): no side stream, no event
                return
            with self.streams.on("reduce"):
                for i, group in todo:
                    if i in rec.unpack:
                        rec.works[i].append(self.call(C.all_to_all, op, rec.unpack[i], rec.inputs[i], group,
                                                      async_op=not cuda))
                        continue
                    rec.works[i].append(self.call(C.reduce_scatter, op, rec.results[i], rec.inputs[i], group,
                                                  async_op=not cuda))
        else:
            for i in op.buffers:
                group = self.groups.reduce(op.axes)
                target = rec.results.setdefault(i, rec.inputs[i])
                if not cuda:  # gloo: the all-reduce reads the reduce-scatter's output
                    for w in rec.works[i]:
                        self.wait(w, op)
                    rec.works[i] = []
                with self.streams.on("reduce"):
                    rec.works[i].append(self.call(C.all_reduce, op, target, group, async_op=not cuda))
        rec.event = self.streams.event("reduce")

    def finish_reduce(self, rec: PendingReduce, op: Op) -> None:
        """Wait for every reduction of ``rec``; the compute stream then waits for the reduce stream."""
        for ws in rec.works.values():
            for w in ws:
                self.wait(w, op)
        self.streams.wait(rec.event)
        if rec.unpack:
            with torch.no_grad():
                for i, got in rec.unpack.items():
                    b = self.buffer[i]  # got: every rank's codes and scales of this rank's segment
                    dequantize_mean(got, b.bp.reduce_quant, b.S, b.bp.group_size, rec.results[i])
            rec.unpack.clear()

    def local_result(self, b: BufferState) -> Optional[torch.Tensor]:
        """Where a reduction that moves nothing (a shard group of one, replicated) should leave its result,
        if the face has a place for it; else the reduction's input is the result."""
        local = (not b.sharded) or self.groups.reduce(b.bp.axes).pg is None
        return self.face.local_reduce_output(b) if local else None

    # -- the used-parameter exchange -------------------------------------------------------------------
    def all_reduce_max(self, op: Op, flags: torch.Tensor):
        """Start an elementwise max of ``flags`` over every rank (on the small CPU group); returns the work."""
        return self.call(C.all_reduce, op, flags, self.groups.used, async_op=True, op=dist.ReduceOp.MAX)

    # -- waiting and errors ----------------------------------------------------------------------------
    def wait(self, work, op: Op) -> None:
        try:
            if self.streams.cuda or work is C.DONE:
                work.wait()  # NCCL: the compute stream waits; the process group's own timeout applies
            elif not work.wait(timeout=timedelta(seconds=self.timeout_s)):
                raise TimeoutError(f"no completion within {self.timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - re-raised with the op named
            raise CollectiveError(f"shardplan: {op.kind} {op.what} unit={op.unit or 'all'} at {op.trigger} failed on "
                                  f"rank {self.rank}: {exc}. Every rank must run the same schedule: check that all "
                                  f"ranks called forward/backward") from exc

    def call(self, fn, sched_op: Op, *args, **kwargs):
        """``fn(*args, **kwargs)`` (a collective of ``sched_op``), its failure re-raised naming the op."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            o = sched_op
            raise CollectiveError(f"shardplan: {o.kind} {o.what} unit={o.unit or 'all'} at {o.trigger} failed "
                                  f"on rank {self.rank}: {exc}") from exc
