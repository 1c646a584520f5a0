"""``shardplan-emulated``: a ``torch.distributed`` backend under which this process plays rank ``r`` of an
``N``-rank job whose collectives take the time a network model gives them (docs/emulated.md).

>>> import torch, torch.distributed as dist
>>> from shardplan.runtime.emulated import emulated_network, ledger
>>> with emulated_network("h100-8x-ib400", rank=0, world_size=8) as net:
...     out = torch.empty(8 * 1024)
...     dist.all_gather_into_tensor(out, torch.ones(1024))    # takes α + bytes/β of 8 GPUs over NVLink
...     net.ledger()["all_gather"].count
1

Each collective (all-gather, reduce-scatter, all-reduce, all-to-all, broadcast, barrier, send/recv; their
coalesced and ``_into_tensor``/``single`` forms) is timed by the forecast's network model
(:func:`shardplan.runtime.emulated_time.op_seconds`: α–β per link class, rings, NCCL's tree across nodes) for
its group's place on the nodes (rank ``r`` on node ``r // gpus_per_node``), and writes its outputs as torch's
fake process group does: an all-gather repeats this rank's input in every slot, a reduce-scatter gives this
rank's chunk of its own input, an all-reduce and a broadcast leave the tensor as it is, an all-to-all copies
the input. So the numbers of a step do not depend on the network, only its time does.

On a CPU one thread per process group plays its stream (FIFO): the op is queued, the thread writes the outputs
and sleeps out the modelled time, ``wait()`` blocks until it has ended. On CUDA the op runs on the group's
comm stream after the caller's current stream, as kernels only (:mod:`.emulated_cuda`), and ``wait()`` makes
the caller's current stream wait for it (``async_op=False``: at once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # a store with no keys: none are used

from ..errors import RuntimeShardingError
from ..forecast.network import Network, check_fits, network as _network
from ..mesh import Mesh
from .emulated_cuda import CudaLink
from .emulated_time import BOOK, CommThread, Job, Ledger, group_placement, ledger, op_seconds, reset_ledger, wait_job

BACKEND = "shardplan-emulated"
"""The backend's registered name: ``dist.init_process_group("shardplan-emulated", ...)`` after :func:`configure`."""

_ACTIVE: dict = {}
_GROUPS: "weakref.WeakSet[EmulatedProcessGroup]" = weakref.WeakSet()


def configure(net: Union[str, dict, Network, None]) -> Optional[Network]:
    """The network the next ``shardplan-emulated`` process groups of this process are timed by (``None``:
    none; creating one then fails). :func:`emulated_network` does this for you.

    >>> configure("h100-8x-ib400").name
    'h100-8x-ib400'
    >>> configure(None)
    """
    if net is None:
        _ACTIVE.clear()
        BOOK.network = ""
        return None
    _ACTIVE["network"] = _network(net)
    BOOK.network = _ACTIVE["network"].name
    return _ACTIVE["network"]


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
        _GROUPS.add(self)

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
               moved: int = 0, seconds: Optional[float] = None, result: Sequence[torch.Tensor] = ()) -> EmulatedWork:
        seconds = op_seconds(self.net, kind, payload, self.where) if seconds is None else seconds
        if self._coalesced is not None:  # inside _start_coalescing: one op at _end_coalescing
            self._coalesced.append((kind, payload, tensors, fill, moved))
            return EmulatedWork(None, result=result)
        BOOK.issued(kind, payload, seconds)
        if tensors and tensors[0].is_cuda:
            link = self._link(tensors[0].device)
            return EmulatedWork(None, link.run(fill, moved, seconds), link, tensors, result=result)
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
                           result=list(outs))

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
                           moved=2 * _nbytes([out]), result=[out])

    def reduce_scatter_single(self, output, input, opts=None):
        return self._scatter([output], [input])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._scatter(outputs, inputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- all-reduce, broadcast, all-to-all, barrier, send/recv -------------------------------------------------
    def allreduce(self, tensors, opts=None):
        return self._issue("all_reduce", _nbytes(tensors), list(tensors), _nothing, result=list(tensors))

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
                           seconds=op_seconds(self.net, kind, _nbytes(tensors), pair), result=list(tensors))

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
        seconds = (op_seconds(self.net, ops[0][0], sum(p for _, p, *_ in ops), self.where) if len(kinds) == 1
                   else sum(op_seconds(self.net, k, p, self.where) for k, p, *_ in ops))
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


def _create(opts, backend_opts) -> EmulatedProcessGroup:
    net = _ACTIVE.get("network")
    if net is None:
        raise RuntimeShardingError(f"backend {BACKEND!r} has no network to time its collectives by; use "
                                   f"`with shardplan.emulated_network('h100-8x-ib400', rank=0, world_size=8):`, or "
                                   f"call shardplan.runtime.emulated.configure(network) before init_process_group")
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    timeout = getattr(opts, "timeout", None)
    return EmulatedProcessGroup(opts.group_rank, opts.group_size, ranks, net, str(opts.group_id or "default"),
                                timeout.total_seconds() if isinstance(timeout, timedelta) else None)


def _register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


_register()


@dataclasses.dataclass(frozen=True)
class EmulatedNetwork:
    """The running emulated network of :func:`emulated_network`: its ``network`` model, this process's ``rank``
    of ``world_size``; :meth:`ledger` and :meth:`reset` read and empty the process's ledger.

    >>> EmulatedNetwork(configure("h100-8x-ib400"), 0, 8).placement(range(16)).link
    'inter'
    """

    network: Network
    rank: int
    world_size: int

    def ledger(self) -> Ledger:
        return ledger()

    def reset(self) -> None:
        reset_ledger()

    def placement(self, global_ranks: Sequence[int]):
        """Where a group of these global ranks sits on the network's nodes (its link: intra or inter)."""
        return group_placement(self.network, global_ranks)


def drain() -> None:
    """Block until every emulated op of this process has ended."""
    for g in list(_GROUPS):
        g.drain()


@contextlib.contextmanager
def emulated_network(network: Union[str, dict, Network], *, rank: int = 0, world_size: int,
                     timeout_s: float = 600.0) -> Iterator[EmulatedNetwork]:
    """This process as ``rank`` of ``world_size`` ranks on an emulated ``network`` (a preset name, a dict, a
    ``benchmarks/collectives.py`` JSON file or a :class:`~shardplan.forecast.network.Network`): the default
    process group is ``shardplan-emulated``'s, made on entry and destroyed on exit; the ledger is emptied on entry.

    >>> with emulated_network("h100-8x-ib400", rank=3, world_size=16) as net:   # two nodes of 8
    ...     net.placement(range(16)).nodes
    2
    """
    net = _network(network)
    if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise RuntimeShardingError(f"emulated_network: rank {rank!r} of world_size {world_size!r}: give a positive "
                                   f"world_size and a rank in 0..world_size-1")
    check_fits(net, Mesh(world=world_size))
    if dist.is_initialized():
        raise RuntimeShardingError("emulated_network makes the default process group, but one is already initialised "
                                   "in this process; use it in a process without torch.distributed.init_process_group")
    configure(net)
    reset_ledger()
    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        yield EmulatedNetwork(net, rank, world_size)
    finally:
        drain()
        if dist.is_initialized():
            dist.destroy_process_group()
        configure(None)


def is_emulated(pg: Any = None) -> bool:
    """Whether ``pg`` (default: the default process group) is an emulated one.

    >>> is_emulated()
    False
    """
    if pg is None:
        if not (dist.is_available() and dist.is_initialized()):
            return False
        pg = dist.group.WORLD
    return isinstance(pg, EmulatedProcessGroup)


__all__ = ["BACKEND", "EmulatedNetwork", "EmulatedProcessGroup", "EmulatedWork", "configure", "drain",
           "emulated_network", "is_emulated", "ledger", "reset_ledger", "time"]
