"""The emulated process group (``shardplan-emulated``'s, made by runtime/emulated.py): every collective
torch.distributed calls on a Python process group, timed by the network model and queued on the group's comm
thread (CPU) or comm stream (CUDA), its outputs written as torch's fake process group writes them
(docs/emulated.md).

>>> from shardplan.forecast.network import network
>>> g = EmulatedProcessGroup(0, 8, range(8), network("h100-8x-ib400"), "dp")
>>> g.where.link
'intra'
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..forecast.network import Network
from .emulated_cuda import CudaLink
from .emulated_time import BOOK, CommThread, Job, group_placement, op_seconds, wait_job

BACKEND = "shardplan-emulated"
"""The backend's registered name: ``dist.init_process_group("shardplan-emulated", ...)`` after ``configure``."""

GROUPS: "weakref.WeakSet[EmulatedProcessGroup]" = weakref.WeakSet()
"""Every emulated process group of this process that is alive (:func:`drain` waits for them)."""


class EmulatedWork(dist._Work):
    """One emulated op in flight: a job on a CPU comm thread, or an event on a CUDA comm stream."""

    def __init__(self, job: Optional[Job], event=None, link=None, keep: Sequence[Any] = (), timeout_s=None,
                 result: Sequence[torch.Tensor] = ()):
        super().__init__()
        self.job, self.event, self.link, self.keep, self.timeout_s = job, event, link, list(keep), timeout_s
        self.res = list(result)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if self.job is not None:
            limit = timeout.total_seconds() if isinstance(timeout, timedelta) and timeout.total_seconds() > 0 else None
            wait_job(self.job, limit or self.timeout_s)
        elif self.event is not None:
            self.link.wait(self.event)
        self.keep = []  # the caller's stream is ordered after the op: its tensors may be freed in stream order
        return True

    def is_completed(self) -> bool:
        if self.job is not None:
            return self.job.done.is_set()
        return self.event is None or (not torch.cuda.is_current_stream_capturing() and self.event.query())

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.res)
        return fut

    def result(self) -> list:
        return self.res


def _nbytes(ts: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _fill_gather(out: torch.Tensor, inp: torch.Tensor) -> None:
    n = max(out.numel() // max(inp.numel(), 1), 1)
    if _shares(out, inp):  # in place: the input is this rank's slot of the output
        inp = inp.clone()
    if out.is_contiguous():
        out.view(n, -1).copy_(inp.reshape(1, -1))
    else:
        for chunk in out.chunk(n):
            chunk.copy_(inp.reshape(chunk.shape))


def _fill_scatter(out: torch.Tensor, inp: torch.Tensor, rank: int) -> None:
    flat = inp.reshape(-1)
    k = out.numel()
    src = flat[rank * k:(rank + 1) * k]
    if src.data_ptr() == out.data_ptr():  # in place: this rank's chunk is the output
        return
    out.copy_((src.clone() if _shares(out, inp) else src).view(out.shape))


def _fill_copy(out: torch.Tensor, inp: torch.Tensor) -> None:
    k = min(out.numel(), inp.numel())
    if out.data_ptr() != inp.data_ptr() and k:
        out.reshape(-1)[:k].copy_(inp.reshape(-1)[:k])


def _nothing() -> None:
    return None


def _reads(ts: Sequence[torch.Tensor], times: int = 1) -> Callable[[], None]:
    """A kernel per tensor that reads it whole ``times`` times (a sum into one scalar, values untouched): on CUDA,
    the HBM reads of a reduction that a fake fill does not make ([Note: HBM traffic])."""
    def read() -> None:
        for t in ts:
            for _ in range(times):
                t.sum(dtype=torch.float32)
    return read


class EmulatedProcessGroup(dist.ProcessGroup):
    """One emulated process group: ``rank`` of ``size`` ranks whose global ranks are ``global_ranks``, timed
    by ``net``. Made by ``dist.init_process_group`` / ``dist.new_group`` with backend ``shardplan-emulated``."""

    def __init__(self, rank: int, size: int, global_ranks: Sequence[int], net: Network, name: str,
                 timeout_s: Optional[float] = None):
        super().__init__(rank, size)
        self.net, self.global_ranks = net, list(global_ranks)
        self.where = group_placement(net, self.global_ranks)
        self.timeout_s = timeout_s
        self._name, self._desc = name, ""
        self._thread: Optional[CommThread] = None
        self._cuda: dict = {}
        self._coalesced: Optional[list] = None
        GROUPS.add(self)

    # -- names, as the trampoline asks for them ----------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    # -- the one path every op takes -------------------------------------------------------------------------
    def _issue(self, kind: str, payload: int, tensors: Sequence[torch.Tensor], fill: Callable[[], None],
               moved: int = 0, seconds: Optional[float] = None, result: Sequence[torch.Tensor] = (),
               reads: Sequence[torch.Tensor] = (), times: int = 1) -> EmulatedWork:
        if seconds is None:  # callers that give the seconds have scaled them
            seconds = op_seconds(self.net, kind, payload, self.where) * BOOK.scale(kind)
        # [Note: HBM traffic] NCCL's ring moves about its payload through HBM on each rank; the fake fill
        # writes the outputs only, which is most of that for an all-gather (the gathered output) but little
        # of a reduction's: a reduce-scatter reads its whole input (and writes 1/n of it), an all-reduce
        # reads and writes its tensor about twice. On CUDA the reductions' reads are added as kernels (a
        # sum per input), so compute beside them sees their traffic; their time counts inside the op's
        if reads and tensors and tensors[0].is_cuda:
            fill, moved = (lambda f=fill, r=_reads(reads, times): (f(), r())), moved + times * _nbytes(reads)
        if self._coalesced is not None:  # inside _start_coalescing: one op at _end_coalescing
            self._coalesced.append((kind, payload, tensors, fill, moved))
            return EmulatedWork(None, result=result)
        BOOK.issued(kind, payload, seconds)
        if tensors and tensors[0].is_cuda:
            link = self._link(tensors[0].device)
            done = link.run(fill, moved, seconds)
            for t in tensors:  # as NCCL's default: freed on their own stream, reused after the comm stream's work
                t.record_stream(link.stream)
            return EmulatedWork(None, done, link, tensors, result=result)
        if self._thread is None:
            self._thread = CommThread(self._name or "group")
        job = self._thread.submit(Job(kind, payload, seconds, fill))
        return EmulatedWork(job, timeout_s=self.timeout_s, result=result)

    def _link(self, device: torch.device) -> CudaLink:
        key = device.index
        if key not in self._cuda:
            self._cuda[key] = CudaLink(device)
        return self._cuda[key]

    def _gather(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> EmulatedWork:
        pairs = list(zip(outs, ins))
        return self._issue("all_gather", _nbytes(outs), [*outs, *ins],
                           lambda: [_fill_gather(o, i) for o, i in pairs], moved=_nbytes(outs) + _nbytes(ins),
                           result=list(outs))

    def _scatter(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> EmulatedWork:
        pairs, r = list(zip(outs, ins)), self.rank()
        return self._issue("reduce_scatter", _nbytes(ins), [*outs, *ins],
                           lambda: [_fill_scatter(o, i, r) for o, i in pairs], moved=2 * _nbytes(outs),
                           result=list(outs), reads=list(ins))

    # -- all-gather --------------------------------------------------------------------------------------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        outs, inp = list(output_tensors[0]), input_tensors[0]
        return self._issue("all_gather", _nbytes(outs), [*outs, inp],
                           lambda: [o.copy_(inp) for o in outs], moved=2 * _nbytes(outs), result=outs)

    def all_gather_single(self, output, input, opts=None):
        return self._gather([output], [input])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._gather(outputs, inputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        outs = [o for lst in output_lists for o in lst]
        pairs = [(o, i) for lst, i in zip(output_lists, inputs) for o in lst]
        return self._issue("all_gather", _nbytes(outs), [*outs, *inputs],
                           lambda: [o.copy_(i) for o, i in pairs], moved=2 * _nbytes(outs), result=outs)

    # -- reduce-scatter -----------------------------------------------------------------------------------------
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        out, ins, r = output_tensors[0], list(input_tensors[0]), self.rank()
        return self._issue("reduce_scatter", _nbytes(ins), [out, *ins], lambda: out.copy_(ins[r]),
                           moved=2 * _nbytes([out]), result=[out], reads=ins)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._scatter([output], [input])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._scatter(outputs, inputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- all-reduce, broadcast, all-to-all, barrier, send/recv -------------------------------------------------
    def allreduce(self, tensors, opts=None):
        return self._issue("all_reduce", _nbytes(tensors), list(tensors), _nothing, result=list(tensors),
                           reads=list(tensors), times=2)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        return self._issue("broadcast", _nbytes(tensors), list(tensors), _nothing, result=list(tensors))

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        return self._issue("all_to_all", _nbytes([input]), [output, input], lambda: _fill_copy(output, input),
                           moved=2 * _nbytes([output]), result=[output])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        outs, ins = list(output_tensors), list(input_tensors)
        return self._issue("all_to_all", _nbytes(ins), [*outs, *ins],
                           lambda: [_fill_copy(o, i) for o, i in zip(outs, ins)], moved=2 * _nbytes(outs),
                           result=outs)

    def barrier(self, opts=None):
        return self._issue("barrier", 0, [], _nothing)

    def _p2p(self, kind: str, tensors, peer: int) -> EmulatedWork:
        pair = group_placement(self.net, [self.global_ranks[self.rank()] if self.global_ranks else self.rank(),
                                          self.global_ranks[peer] if self.global_ranks else peer])
        return self._issue(kind, _nbytes(tensors), list(tensors), _nothing,
                           seconds=op_seconds(self.net, kind, _nbytes(tensors), pair) * BOOK.scale(kind), result=list(tensors))

    def send(self, tensors, dst, tag=0):
        return self._p2p("send", tensors, dst)

    def recv(self, tensors, src, tag=0):
        return self._p2p("recv", tensors, src)

    # -- coalescing (dist._coalescing_manager with a device) ---------------------------------------------------
    def _start_coalescing(self, device=None) -> None:
        self._coalesced = []

    def _end_coalescing(self, device=None) -> EmulatedWork:
        ops, self._coalesced = self._coalesced or [], None
        if not ops:
            return EmulatedWork(None)
        kinds = {k for k, *_ in ops}
        # [Note: NCCL runs a group of same-kind ops as one kernel: one latency, the bytes summed; mixed kinds
        # are timed one after the other]
        seconds = (op_seconds(self.net, ops[0][0], sum(p for _, p, *_ in ops), self.where) * BOOK.scale(ops[0][0])
                   if len(kinds) == 1
                   else sum(op_seconds(self.net, k, p, self.where) * BOOK.scale(k) for k, p, *_ in ops))
        fills = [f for *_, f, _m in ops]
        tensors = [t for _, _, ts, _, _ in ops for t in ts]
        return self._issue(ops[0][0] if len(kinds) == 1 else "coalesced", sum(p for _, p, *_ in ops), tensors,
                           lambda: [f() for f in fills], moved=sum(m for *_, m in ops), seconds=seconds)

    # -- the end ------------------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Block until every op issued so far has ended (the comm thread's queue, the comm streams)."""
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
        for link in self._cuda.values():
            link.drain()

    def shutdown(self) -> None:
        self.drain()




def drain() -> None:
    """Block until every emulated op of this process has ended."""
    for g in list(GROUPS):
        g.drain()
