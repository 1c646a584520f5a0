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
from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence, Union

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # a store with no keys: none are used

from ..errors import RuntimeShardingError
from ..forecast.network import Network, check_fits, network as _network
from ..mesh import Mesh
from .emulated_cuda import SPIN as _SPIN
from .emulated_group import BACKEND, EmulatedProcessGroup, EmulatedWork, drain
from .emulated_time import BOOK, Ledger, group_placement, ledger, reset_ledger, timed_kinds

_ACTIVE: dict = {}


def configure(net: Union[str, dict, Network, None], *, comm_ctas: Optional[int] = None) -> Optional[Network]:
    """The network the next ``shardplan-emulated`` process groups of this process are timed by (``None``:
    none; creating one then fails). :func:`emulated_network` does this for you. ``comm_ctas``: on a GPU, the
    SMs each collective holds while it runs (NCCL runs a collective on one thread block per channel, 16 to
    32 on an 8-GPU NVLink node; 1, the default, takes next to none from compute; ``None`` keeps the last one).

    >>> configure("h100-8x-ib400").name
    'h100-8x-ib400'
    >>> configure(None)
    """
    if comm_ctas is not None:
        if not isinstance(comm_ctas, int) or comm_ctas < 1:
            raise RuntimeShardingError(f"comm_ctas={comm_ctas!r}: give the number of SMs a collective holds, 1 or more")
        _SPIN["ctas"] = comm_ctas
    if net is None:
        _ACTIVE.clear()
        BOOK.network = ""
        return None
    _ACTIVE["network"] = _network(net)
    BOOK.network = _ACTIVE["network"].name
    return _ACTIVE["network"]


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


@contextlib.contextmanager
def emulated_network(network: Union[str, dict, Network], *, rank: int = 0, world_size: int,
                     timeout_s: float = 600.0, comm_ctas: Optional[int] = None) -> Iterator[EmulatedNetwork]:
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
    configure(net, comm_ctas=comm_ctas)
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
           "emulated_network", "is_emulated", "ledger", "reset_ledger", "timed_kinds"]
