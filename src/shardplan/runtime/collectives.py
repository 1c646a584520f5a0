"""Every collective shardplan issues, in one place: picks the API the installed torch has.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``; older releases only have the former.
A group of one rank needs no communication: those calls become local copies. Process groups are
made here too (one per purpose and mesh axes); what ranks tell each other through the rendezvous store
instead (the start-up exchange, the error report) is runtime/stores.py's.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import RuntimeShardingError
from ..planner import geometry as G
from . import emulated  # registers the shardplan-emulated backend

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_GLOO_AVERAGES = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 7)
"""gloo has ``ReduceOp.AVG`` from torch 2.7 on (a sum, then a division); before, shardplan sums and divides."""


@dataclass
class Group:
    """A process group with its size and this rank's index in it (``None`` pg: a group of one)."""

    pg: Optional[object]
    size: int
    rank: int


class _Done:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


DONE = _Done()
ONE = Group(None, 1, 0)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = True):
    if group.pg is None:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return DONE
    return _all_gather(out, inp, group=group.pg, async_op=async_op) or DONE


class _Averaged:
    """A sum in flight whose result is divided by the group size when it is waited for: ``ReduceOp.AVG``
    where the backend lacks it (gloo before torch 2.7), computed as gloo computes it since."""

    def __init__(self, work, out: torch.Tensor, n: int):
        self.work, self.out, self.n, self.divided = work, out, n, False

    def wait(self, timeout=None):
        ok = self.work.wait() if timeout is None else self.work.wait(timeout=timeout)
        if ok is not False and not self.divided:
            self.out.div_(self.n)
            self.divided = True
        return ok

    def is_completed(self):
        return self.work.is_completed()


def _sums_for_avg(group: Group) -> bool:
    return not _GLOO_AVERAGES and dist.get_backend(group.pg) == "gloo"


def _averaged(work, out: torch.Tensor, group: Group, async_op: bool):
    if async_op:
        return _Averaged(work, out, group.size)
    out.div_(group.size)
    return DONE


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = True):
    """Average ``inp`` over the group; this rank gets its segment in ``out``."""
    if group.pg is None:
        out.copy_(inp)
        return DONE
    if _sums_for_avg(group):
        return _averaged(_reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=group.pg, async_op=async_op),
                         out, group, async_op)
    return _reduce_scatter(out, inp, op=dist.ReduceOp.AVG, group=group.pg, async_op=async_op) or DONE


def all_reduce(t: torch.Tensor, group: Group, async_op: bool = True, op=None):
    """Average (or ``op``) ``t`` over the group, in place."""
    if group.pg is None:
        return DONE
    if op is None and _sums_for_avg(group):
        return _averaged(dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group.pg, async_op=async_op), t, group,
                         async_op)
    return dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.AVG, group=group.pg, async_op=async_op) or DONE


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = True):
    """Equal parts of ``inp`` to the ranks of ``group`` (the i-th to the i-th), theirs into ``out``: a quantized
    reduce-scatter's exchange (the sum is local, see runtime/quantize.py)."""
    if group.pg is None:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return DONE
    return dist.all_to_all_single(out, inp, group=group.pg, async_op=async_op) or DONE


def all_reduce_sum(t: torch.Tensor, group: Group, async_op: bool = True):
    """Sum ``t`` over the group, in place (partial gradients over a compute axis); nothing over a group of one."""
    if group.pg is None:
        return DONE
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group.pg, async_op=async_op) or DONE


def all_reduce_max(t: torch.Tensor, group: Group) -> None:
    """The elementwise max of ``t`` over ``group``, in place, in stream order (FP8 compute's absmaxes before a
    float8 gather); nothing over a group of one."""
    if group.pg is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)


def all_gather_list(mine: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Every rank's ``mine`` (same shape and dtype on every rank), indexed by the rank's place in the group."""
    if group.pg is None:
        return [mine]
    every = [torch.empty_like(mine) for _ in range(group.size)]
    dist.all_gather(every, mine, group=group.pg)
    return every


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, group: Group, out_splits: Optional[list] = None,
                      in_splits: Optional[list] = None) -> None:
    """Rows of ``inp`` to the ranks of ``group`` (``in_splits[i]`` rows to the i-th; equal parts if ``None``),
    rows from them into ``out`` (``out_splits``), synchronously: expert parallelism's token exchange."""
    if group.pg is None:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group.pg)


def all_gather_rows(out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
    """Every rank's ``inp`` stacked along dim 0 into ``out`` (group order), synchronously: context
    parallelism's key/value exchange."""
    if group.pg is None:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return
    _all_gather(out, inp.contiguous(), group=group.pg)


def reduce_scatter_rows_sum(out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
    """The sum over the group of ``inp``, this rank's block of rows into ``out``, synchronously (the
    backward of :func:`all_gather_rows`)."""
    if group.pg is None:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return
    _reduce_scatter(out, inp.contiguous(), op=dist.ReduceOp.SUM, group=group.pg)


def broadcast(t: torch.Tensor, src_index: int, group: Group):
    """Broadcast from the group's ``src_index``-th rank."""
    if group.pg is None:
        return DONE
    return dist.broadcast(t, src=dist.get_global_rank(group.pg, src_index), group=group.pg) or DONE


def broadcast_str(s: str, group: Group) -> str:
    """Rank 0's string on every rank of ``group``."""
    if group.pg is None:
        return s
    obj = [s]
    dist.broadcast_object_list(obj, src=dist.get_global_rank(group.pg, 0), group=group.pg)
    return obj[0]


def broadcast_object(obj, pg):
    """Rank 0's ``obj`` (a picklable value) on every rank of process group ``pg`` (``None``: ``obj``)."""
    if pg is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    return box[0]


def all_gather_objects(obj, pg) -> list:
    """Every rank's ``obj`` of process group ``pg``, in rank order (``None``: ``[obj]``)."""
    if pg is None:
        return [obj]
    out = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, obj, group=pg)
    return out


def world() -> Group:
    """The default process group (every rank), or a group of one where there is none."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ONE
    return Group(dist.group.WORLD, dist.get_world_size(), dist.get_rank())


def barrier(group: Group) -> None:
    if group.pg is not None:
        dist.barrier(group=group.pg)


class Groups:
    """The process groups of one sharded model: per (purpose, axes), the world, and the small CPU group
    the used-parameter exchange runs on (gloo even where tensors live on GPUs: it needs no device sync)."""

    def __init__(self, groups: dict, world: Group, used: Group):
        self._groups, self.world, self.used = groups, world, used

    def gather(self, axes) -> Group:
        return self._groups.get(("gather", tuple(axes)), ONE) if axes else ONE

    def reduce(self, axes) -> Group:
        return self._groups.get(("reduce", tuple(axes)), ONE) if axes else ONE

    def axis(self, axis: str) -> Group:
        """The group along one mesh axis (a DeviceMesh dimension: state dicts as DTensors)."""
        return self._groups.get(("axis", (axis,)), ONE)


def build_groups(plan, rank: int, backend: str, timeout_s: float) -> Groups:
    """One process group per (purpose, axes); every rank creates every group in the same order.

    ``SHARDPLAN_SINGLETON_GROUPS=1`` makes real process groups of one rank too, so a single GPU runs the
    same NCCL path as many (tests and traces); otherwise a group of one is a local copy.
    """
    mesh = plan.mesh
    wanted: list[tuple[str, tuple[str, ...]]] = []
    for b in plan.buffers:
        for key in (("gather", b.axes), ("reduce", b.axes), ("reduce", b.replica_axes), ("reduce", b.partial_axes)):
            if key[1] and key not in wanted:
                wanted.append(key)
    tp = dict.fromkeys(("gather", G.owner_axes(plan, p.name)) for p in plan.params if p.tp_axis)
    wanted += [k for k in tp if k not in wanted]  # checkpoints: the ranks holding pieces of a tensor-parallel parameter
    everyone = ("world", tuple(mesh.axis_names))
    wanted.append(everyone)
    for a in mesh.axis_names:  # one group per mesh axis, for a DeviceMesh built later without a collective
        wanted.append(("axis", (a,)))
    force = os.environ.get("SHARDPLAN_SINGLETON_GROUPS") == "1"
    timeout = timedelta(seconds=timeout_s)
    made: dict = {}
    for key in wanted:
        axes = key[1]
        if key[0] == "axis":  # any group over exactly these ranks serves (DTensor state dicts are rare)
            same = [made[k] for k in (("gather", axes), ("reduce", axes), ("world", axes)) if k in made]
            if same:
                made[key] = same[0]
                continue
        size = mesh.axis_size(axes)
        mine = ONE
        for ranks in mesh.groups(axes):
            pg = dist.new_group(list(ranks), backend=backend, timeout=timeout) if size > 1 or force else None
            if rank in ranks:
                mine = Group(pg, size, ranks.index(rank))
        made[key] = mine
    world = made[everyone]
    used = world  # its tensor lives on the CPU: on any other backend it gets a gloo group of its own
    if backend not in ("gloo", REHEARSAL_BACKEND, EMULATED_BACKEND) and world.pg is not None:
        used = Group(dist.new_group(list(range(mesh.size)), backend="gloo", timeout=timeout), mesh.size, rank)
    return Groups(made, world, used)


# -- rehearsal: one rank of an N-rank world, every collective a local stand-in ----------------------------

REHEARSAL_BACKEND = "fake"
EMULATED_BACKEND = "shardplan-emulated"  # rehearse(network=...): runtime/emulated.py's timed collectives

_REHEARSALS = itertools.count(1)
_rehearsal = ""
"""The running rehearsal's tag (``""``: none), unique in this process and in processes forked from it."""


def start_rehearsal(rank: int, world: int, network=None) -> None:
    """Make this process rank ``rank`` of a ``world``-rank process group whose collectives do not
    communicate: torch's fake process group (outputs keep their shape and dtype, nothing is sent, no time
    passes), or under ``network`` (a preset name, dict, JSON file or ``Network``) shardplan's emulated one
    (runtime/emulated.py: the same outputs, each collective taking the network model's time on its stream).

    [Note: the fake store implements no keys, so nothing that goes through the store (the start-up
    exchange, an error report) can run: :func:`rehearsing` tells start-up to check locally only]"""
    global _rehearsal
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeShardingError("a rehearsal makes its own (fake) process group, but one is already initialised "
                                   "in this process; rehearse in a process without torch.distributed.init_process_group")
    if network is not None:
        emulated.configure(network)  # the backend's network
    dist.init_process_group(REHEARSAL_BACKEND if network is None else EMULATED_BACKEND, store=FakeStore(), rank=rank,
                            world_size=world)
    _rehearsal = f"rehearsal{next(_REHEARSALS)}"


def rehearsing() -> bool:
    """Whether the default process group is a rehearsal's (:func:`start_rehearsal`), fake or emulated."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() in (REHEARSAL_BACKEND, EMULATED_BACKEND)


def end_rehearsal() -> None:
    global _rehearsal
    if rehearsing():
        dist.destroy_process_group()  # an emulated group drains its comm thread and streams first (its shutdown)
    _rehearsal = ""


def mesh_dim_names(axis_names) -> tuple[str, ...]:
    """The dimension names of a ``DeviceMesh`` shardplan builds over mesh axes ``axis_names``: the axis names,
    and during a rehearsal the axis names tagged with it (``"tp@rehearsal1"``).

    [Note: DTensor caches sharding propagation and redistribution plans for the whole process, keyed by
    specs whose ``DeviceMesh`` compares equal by its ranks, device type and dimension names, not by its
    process groups; a hit hands back the cached specs with *their* mesh, which finds its groups by name.
    A rehearsal's groups are gone when it ends, and a later run of the same mesh shape (in this process or
    one forked from it) that creates its groups in another order or number would get the rehearsal's
    meshes back: "Could not resolve the process group registered under the name 12" (or, where that name was
    made again, another group's). Named apart, a rehearsal's meshes equal no later mesh, so its cache
    entries are never hit again (they stay, unused: DTensor has no public way to drop them). Two real runs
    of one process, each with its own default process group, share the hazard; torch's own meshes do too]"""
    names = tuple(axis_names)
    return tuple(f"{a}@{_rehearsal}" for a in names) if _rehearsal and rehearsing() else names


def shutdown() -> None:
    """Destroy the default gloo process group if there is one (a failed run's exit, quietly: a group alive
    while Python finalises can abort it with a C++ message). An NCCL group is left to the process's exit:
    destroying it can wait for the collectives other ranks never join."""
    try:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
