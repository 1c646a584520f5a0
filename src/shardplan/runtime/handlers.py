"""The executor's op handlers: one per (kind, subject) of the schedule (``_handlers``: the table), each doing
one op's work on this rank's units and buffers through the comm engine, the gradient tracker and the face;
the compute axes' in-module ops (``activations``) are run by the module call that issues them. A mixin of
:class:`~shardplan.runtime.executor.Executor`, over its state; the executor decides when each op runs.
"""

from __future__ import annotations

import torch

from ..errors import RuntimeShardingError
from ..planner.kinds import ACTIVATIONS, ALL_TO_ALL
from ..planner.schedule import (ALL_GATHER, ALL_REDUCE, COPY_D2H, COPY_H2D, FREE, GRADS, OPTIM_STEP, PARAMS,
                                PARTIAL_GRADS, PREPARE, REDUCE_SCATTER, SCALES, USED, WAIT, Op)
from .capture import session as CAP
from .unit import Grads, Params, PendingReduce, PendingUsed, UnitRuntime


class OpHandlers:
    """The handler of each op the schedule holds, by (kind, subject)."""

    def _handlers(self) -> dict:
        """The handler table: (kind, subject) -> the method that runs such an op (bound to this executor)."""
        table = {(ALL_GATHER, PARAMS): self._all_gather, (WAIT, PARAMS): self._wait_params,
                 (FREE, PARAMS): self._free_params, (REDUCE_SCATTER, GRADS): self._reduce,
                 (ALL_REDUCE, GRADS): self._reduce, (ALL_REDUCE, PARTIAL_GRADS): self._reduce,
                 (WAIT, GRADS): self._wait_grads,
                 (FREE, GRADS): self._free_grads, (ALL_REDUCE, USED): self._exchange_used,
                 (WAIT, USED): self._wait_used, (PREPARE, GRADS): self._prepare_grads,
                 (COPY_D2H, GRADS): self._offload_copy, (COPY_H2D, PARAMS): self._offload_copy,
                 (OPTIM_STEP, PARAMS): self._offload_copy,  # [offload hook]
                 (ALL_REDUCE, SCALES): self._scales}
        # the compute axes' in-module collectives: run inside module calls (run_in_module), never by the cursor
        table.update({(kind, ACTIVATIONS): self._in_module
                       for kind in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL)})
        return table

    def _in_module(self, op: Op, collective=None):
        if collective is None:
            raise RuntimeShardingError(f"shardplan: {op.kind} {op.what} at {op.at!r} runs inside that module's call "
                                       f"(Executor.run_in_module), not from a step of the schedule")
        return collective()

    def _all_gather(self, op: Op) -> None:
        u = self.units[op.unit]
        self.comm.gather(op, u)
        if u.params is Params.SHARDED and u.name in self.transient:
            self.n_gathered += 1
            self.max_gathered = max(self.max_gathered, self.n_gathered)
        u.params = Params.GATHERING

    def _scales(self, op: Op) -> None:
        """FP8 compute: the float8 weights' absmaxes over the gather's group, then their scales (the next op is
        their all-gather, which casts with them)."""
        self.comm.scales(op, [self.buffer[i] for i in op.buffers])

    def _wait_params(self, op: Op) -> None:
        u = self.units[op.unit]
        if u.gather is not None:
            self._finish_gather(u)
        elif u.params is Params.SHARDED and u.name in self.transient:
            raise RuntimeShardingError(f"shardplan: {op.trigger} waits for unit {u.name!r}'s parameters but nothing "
                                       f"gathered them; the schedule is inconsistent")
        u.params = Params.UNSHARDED
        self.face.bind(u)

    def _finish_gather(self, u: UnitRuntime) -> None:
        g = u.gather
        self.comm.finish_gather(u)
        if self.offload is not None:  # [offload hook] offload="params": the device copies of the shards go
            self.offload.gathered([i for o in (g.op,) + g.extra for i in o.buffers])

    def _free_params(self, op: Op) -> None:
        self._reshard(self.units[op.unit], [self.buffer[i] for i in op.buffers])

    def _reduction_inputs(self, u: UnitRuntime) -> dict:
        window = self.grads.window
        out = {}
        for b in u.with_grads:
            if self.track_memory and b.bp.lands_in_reduce_dtype and b.forming_bytes():
                # [Note: landing in the reduce dtype] (planner/accounting.py): the formed gradients and the wider
                # unsharded gradient they are copied into are alive together
                self._account()
                self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes + b.bp.grad_numel * b.bp.flat_itemsize)
            self.face.land(b, window)
            out[b.bp.index] = b.reduction_input(window, self.comm.local_result(b))
        if self.partial_check is not None:  # tensor parallelism, first synchronising backward (tensor_parallel.py)
            self.partial_check(u)
        return out

    def _reduce(self, op: Op) -> None:
        u = self.units[op.unit]
        self.comm.reduce(op, u, lambda: self._reduction_inputs(u))
        u.grads = Grads.REDUCING

    def _wait_grads(self, op: Op) -> None:
        u = self.units[op.unit]
        rec = u.reduce
        if rec is None:  # nothing to reduce on this mesh: the gradient is its own result
            rec = PendingReduce(op, {}, self._reduction_inputs(u), {})
        self.comm.finish_reduce(rec, op)
        for i in op.buffers:
            self.face.deliver(self.buffer[i], rec.results.get(i, rec.inputs[i]))
        u.reduce = None
        u.grads = Grads.DONE

    def _prepare_grads(self, op: Op) -> None:
        """The unit's gradients start: autograd forms them on the full parameters (the module face) or hands
        them to the unit's backward (the tree face); they land in the flat gradient when the unit completes
        (see [Note: gradients land, they are not accumulated in place] in buffers.py)."""
        for i in op.buffers:
            self.buffer[i].start_grads()

    def _free_grads(self, op: Op) -> None:
        for i in op.buffers:
            self.buffer[i].release_grads()

    def _exchange_used(self, op: Op) -> None:
        flags = torch.frombuffer(self.grads.used, dtype=torch.uint8).to(torch.int32)  # a copy: the collective writes it
        self.grads.pending_used = PendingUsed(op, self.comm.all_reduce_max(op, flags), flags)

    def _wait_used(self, op: Op) -> None:
        rec = self.grads.pending_used
        self.comm.wait(rec.work, op)
        self.grads.pending_used = None
        unused = [i for i, f in enumerate(rec.flags.tolist()) if not f]
        if CAP._ACTIVE is not None:
            CAP.note_unused(self, unused)
        self.face.unused(unused)

    def _offload_copy(self, op: Op) -> None:
        """[offload hook] copy_d2h / copy_h2d / optim_step: CPU offload's ops (runtime/offload/)."""
        if self.offload is None:
            raise RuntimeShardingError("shardplan: this plan offloads to host memory (plan(offload=...)), which runs "
                                       "with shardplan.shard(model, plan) only; plan without offload for this face")
        self.offload.run(op)

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
