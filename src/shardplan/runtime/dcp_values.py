"""The one converter between a parameter's local shard (this rank's box of it, or an optimizer state shaped
like it) and the value ``torch.distributed.checkpoint`` (DCP) saves, both ways. Every state dict shardplan
hands DCP gets its values here: ``model.state_dict()`` / ``optimizer.state_dict()`` (runtime/state_dict.py),
``shardplan.checkpoint.state_dict`` and ``shardplan.checkpoint`` (checkpoint/values.py), the functional face's trees,
and the host copies ``async_save`` writes (checkpoint/async_io.py).

Three kinds of value, by what can describe the plan's layout:

* a **DTensor** where the plan's boxes are DTensor placements (:func:`describe`: always under
  ``layout="chunked"``): :func:`dtensor_value`, a zero-copy view over a ``DeviceMesh`` of the plan's mesh;
* a **ShardedTensor** for any layout, packed ones included (contiguous packing onto a subset of ranks, which
  no DTensor placement describes): :func:`sharded_value`, whose shards are the boxes ``plan.local_slices``
  gives every rank of the parameter's shard group;
* the plain local tensor where no axis splits the parameter.

Back: :func:`local_of` (this rank's tensor of a value DCP loaded into) and :func:`local_box` (this rank's box
of any saved value: a DTensor on any mesh or placement, a full tensor, or a local shard).

[Note: why shardplan's own checkpoints still give ShardedTensors for DTensor layouts too] On disk the two
are one format: DCP stores a tensor as its global shape and the boxes (offset, size) its ranks wrote, not the
Python type that described them, and loads any saved boxes into any target boxes; a checkpoint written
from DTensors loads into ShardedTensors and back (tests/test_fsdp2_state_dict.py, test_torch_dcp_optimizer.py).
What keeps ShardedTensor as the value of ``shardplan.checkpoint`` is where its tensors live: ``async_save``
stages them in (pinned) host memory and ``offload="params"`` keeps the shards there, and a DTensor over a
host tensor with a CUDA mesh exists only through DTensor's private constructor (``DTensor(local, spec)``,
as torch's own stager assigns ``_local_tensor``): the public ``DTensor.from_local`` copies the tensor to the
mesh's device, a device copy of every offloaded parameter at each save. A ShardedTensor's placements name
any device publicly. One converter, two descriptions, one on-disk format.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Optional

import torch

from .. import layout as L
from ..errors import CheckpointError
from ..planner import geometry as G


@contextlib.contextmanager
def quiet_sharded_tensor():
    """Silence torch's ``ShardedTensor`` deprecation warnings inside the block only.

    >>> with quiet_sharded_tensor():
    ...     dcp.save(sd, checkpoint_id=path)

    [Note: ``catch_warnings`` restores ``warnings.filters`` on exit, so the user's own filters are never
    changed; it is process-global while it lasts, which is fine for the synchronous calls it wraps]
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*")
        yield


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a storage of its own over the same memory (zero-copy) where it is a CPU tensor viewing
    part of a larger storage, as every parameter in a flat buffer does; otherwise ``t`` itself.

    >>> own_storage(flat[10:20]).untyped_storage().nbytes()   # 10 elements' bytes, flat's memory

    [Note: DCP's file writer clones every CPU tensor whose storage is larger than the tensor (``torch.save``
    would write the whole storage). For shardplan's local shards that was a copy of every parameter on every
    save (1.9 GB per rank for a 1B model at world 2), allocated fresh, page faults and all, one tensor at a
    time: the one systematic difference from FSDP2 + DCP, whose sharded parameters own their storage. DCP's
    loads copy into the tensors, so they never needed this]
    """
    if t.device.type != "cpu" or t.numel() == 0 or not t.is_contiguous():
        return t
    storage = t.untyped_storage()
    if storage.nbytes() == t.nbytes:
        return t
    start = t.storage_offset() * t.element_size()
    return torch.empty(0, dtype=t.dtype).set_(storage[start:start + t.nbytes], 0, t.shape, t.stride())


# -- which layouts DTensor describes ------------------------------------------------------------------------

def _fmt(box) -> str:
    return "nothing" if box is None else "[" + ", ".join(f"{s.start}:{s.stop}" for s in box) + "]"


def dtensor_piece(global_shape, mesh_shape, coord, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, global offset)`` of the piece DTensor gives the rank at ``coord``: each ``Shard(d)``, in
    mesh-dimension order, keeps the rank's ``torch.chunk`` piece of what is left of dimension ``d``
    (DTensor's own rule, written out: torch's helper for it is private and changed across releases)."""
    shape, off = list(global_shape), [0] * len(global_shape)
    for n, c, placement in zip(mesh_shape, coord, placements):
        d = getattr(placement, "dim", None)
        if d is None:  # Replicate
            continue
        chunk = -(-shape[d] // n)
        start = min(chunk * c, shape[d])
        off[d] += start
        shape[d] = min(chunk, shape[d] - start)
    return tuple(shape), tuple(off)


def _dtensor_box(global_shape, mesh_shape, coord, placements) -> Optional[tuple[slice, ...]]:
    """The global box DTensor gives the rank at ``coord`` (``None``: an empty piece)."""
    shape, off = dtensor_piece(global_shape, mesh_shape, coord, placements)
    if math.prod(shape) == 0 and len(shape):
        return None
    return tuple(slice(o, o + s) for o, s in zip(off, shape))


def describe(plan) -> dict[str, tuple[Optional[tuple], str]]:
    """``{name: (placements, "")}`` for every parameter whose plan boxes are DTensor placements, and
    ``{name: (None, why)}`` for the others. Pure: every rank decides alike."""
    from torch.distributed.tensor import Replicate, Shard
    mesh = plan.mesh
    mesh_shape = [s for _, s in mesh.axes]
    coords = [[mesh.axis_index(r, (a,)) for a in mesh.axis_names] for r in range(mesh.size)]
    out: dict[str, tuple[Optional[tuple], str]] = {}
    seen: dict[tuple, tuple[Optional[tuple], str]] = {}
    for p in plan.params:
        shape = p.global_shape
        placements, why = [], ""
        for a in mesh.axis_names:
            dims = [d for d in range(len(shape)) if a in p.spec.dim_axes(d)]
            if len(dims) > 1:
                why = f"mesh axis {a!r} shards dims {dims}"
            placements.append(Shard(dims[0]) if dims else Replicate())
        layout = plan.buffers[p.buffer].layout
        # [Note: a chunked box depends on the shape and spec only; a contiguous one on the offset too]
        key = (shape, p.spec, p.tp_dim, p.tp_axis, layout) if layout != L.CONTIGUOUS else None
        if not why and key in seen:
            out[p.name] = seen[key]
            continue
        if not why:
            for r, coord in enumerate(coords):
                have = plan.local_slices(p.name, r)
                if have is not None and any(s.stop <= s.start for s in have):
                    have = None
                want = _dtensor_box(shape, mesh_shape, coord, placements)
                if have != want:
                    kind = "packs whole rows contiguously" if layout == L.CONTIGUOUS else "splits it"
                    why = (f"the plan {kind} (layout {layout!r}, spec {p.spec!r}): rank {r} holds {_fmt(have)}, "
                           f"where a DTensor {tuple(placements)} would hold {_fmt(want)}")
                    break
        res = (None, why) if why else (tuple(placements), "")
        out[p.name] = res
        if key is not None and not why:
            seen[key] = res
    return out


# -- local shard -> value -----------------------------------------------------------------------------------

def dtensor_value(local: torch.Tensor, mesh, placements: tuple, global_shape, local_shape) -> torch.Tensor:
    """This rank's shard ``local`` as a DTensor view over ``mesh`` (zero copy on the mesh's device).

    >>> dtensor_value(shard, mesh, (Shard(0),), (1024, 64), (512, 64))   # DTensor of global shape (1024, 64)
    """
    from torch.distributed.tensor import DTensor
    local = local.detach()
    if tuple(local.shape) != tuple(local_shape):  # an empty piece: the plan's (0, ...) vs DTensor's zero on dim d
        local = local.reshape(local_shape)
    g = torch.Size(global_shape)
    stride = tuple(math.prod(g[d + 1:]) for d in range(len(g)))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=g, stride=stride)


def sharded_value(plan, groups, rank: int, name: str, local: torch.Tensor):
    """``local`` (``rank``'s box of parameter ``name``, or a state tensor shaped like it) as a DCP value:
    a ``ShardedTensor`` whose shards are the boxes ``plan.local_slices`` gives each rank of the group,
    or ``local`` itself where no axis splits ``name``.

    >>> sharded_value(plan, groups, rank, "layers.0.w", local)   # ShardedTensor of global shape
    """
    with quiet_sharded_tensor():
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    local = own_storage(local)
    p = plan.param(name)
    axes = G.owner_axes(plan, name)  # the buffer's shard axes, and the compute axis sharding it
    group = groups.gather(axes) if axes else None
    if group is None or group.size == 1:
        return local
    dev = local.device.type if local.device.type == "cpu" else f"cuda:{local.device.index}"
    mds, mine = [], None
    for r in plan.mesh.group_of(rank, axes):
        box = plan.local_slices(name, r)
        if box is None:
            continue
        # [Note: placements name *global* ranks: under HSDP a shard group is a sub-group ([2, 3] say), and
        # torch maps the placement's global rank into the group]
        md = ShardMetadata([s.start for s in box], [s.stop - s.start for s in box], f"rank:{r}/{dev}")
        mds.append(md)
        if r == rank:
            mine = md
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(mds, torch.Size(p.global_shape), props)
    shards = [Shard(local, mine)] if mine is not None else []
    with quiet_sharded_tensor():
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta, process_group=group.pg)


# -- value -> local shard -----------------------------------------------------------------------------------

def _is_sharded_tensor(v) -> bool:
    with quiet_sharded_tensor():
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    return isinstance(v, ShardedTensor)


def local_of(v):
    """This rank's tensor of a DCP value (``None``: a ``ShardedTensor`` of which this rank holds nothing).

    >>> local_of(sd["model"]["layers.0.w"])   # after dcp.load(sd, ...): the local shard, loaded in place
    """
    if _is_sharded_tensor(v):
        with quiet_sharded_tensor():
            shards = v.local_shards()
        return shards[0].tensor if shards else None
    return v


def local_box(plan, rank: int, name: str, key: str, v, lp: torch.Tensor, mesh, placements):
    """What to copy into this rank's shard ``lp`` of parameter ``name`` for a saved value ``v`` (``key`` names it
    in errors): a DTensor (on ``mesh`` with other ``placements``: redistributed; on another mesh or for a layout
    DTensor cannot describe, ``placements`` ``None``: gathered and cut), a full tensor (cut to this rank's box),
    or this rank's plain local shard (itself). A rank holding none of it gets ``lp`` back (nothing to copy).

    >>> local_box(plan, rank, "w", "w", full_w, shard, mesh, (Shard(0),))   # shard's box of full_w
    """
    from torch.distributed.tensor import DTensor
    p = plan.param(name)
    box = plan.local_slices(p.name, rank)
    if not isinstance(v, torch.Tensor):
        return v
    if tuple(v.shape) != p.global_shape and (isinstance(v, DTensor) or tuple(v.shape) != tuple(lp.shape)):
        raise CheckpointError(f"load_state_dict: {key!r} has shape {tuple(v.shape)}; the parameter's global shape "
                              f"is {p.global_shape} (this rank's shard: {tuple(lp.shape)})")
    if isinstance(v, DTensor):
        if mesh is not None and v.device_mesh == mesh:
            if tuple(v.placements) != placements:
                v = v.redistribute(mesh, placements)
            local = v.to_local()
        else:  # another mesh or a layout DTensor cannot describe: every rank gathers it and cuts its box
            stale = stale_mesh(v.device_mesh)
            if stale:
                raise CheckpointError(
                    f"load_state_dict: {key!r} is a DTensor over a DeviceMesh this process cannot gather over: "
                    f"{stale}. A DTensor that torch.save wrote in another run (a per-rank optimizer.state_dict() "
                    f"file, say) loads back only at the same world size; to load at another, save with "
                    f"torch.distributed.checkpoint (dcp.save({{'optim': opt.state_dict()}}), which reshards) or "
                    f"shardplan.checkpoint.save(path, model, opt) and load with shardplan.checkpoint.load")
            full = v.full_tensor()
            local = None if box is None else full[box]
    elif tuple(v.shape) == p.global_shape:
        local = None if box is None else v[box]  # a full tensor (torch's full/broadcast loading gives these)
    else:
        return v  # this rank's plain local shard
    if local is None or local.numel() == 0:
        return lp.detach()  # this rank holds none of it: nothing to copy
    return local.reshape(lp.shape)


def stale_mesh(mesh) -> str:
    """Why ``mesh`` cannot run collectives in this process ("" where it can).

    >>> stale_mesh(torch.load("optim-0.pt")["state"][0]["exp_avg"].device_mesh)   # saved at world 2, here 1
    'it spans ranks 0..1, and the world has 1'

    [Note: a DeviceMesh unpickled from another run (``torch.save`` of a DTensor) names its process groups by
    the names they were registered under there; here a name resolves to nothing or to another group (at world
    4, the world-2 mesh's dim-0 name is a group of 4 ranks), and a ``full_tensor()`` over it fails with a raw
    size error or, where the sizes happen to fit, gathers the wrong ranks' pieces. So each dimension's group
    must hold exactly the mesh's ranks along it.]
    """
    import torch.distributed as dist
    ranks, world = mesh.mesh, dist.get_world_size()
    if ranks.numel() and int(ranks.max()) >= world:
        return f"it spans ranks {int(ranks.min())}..{int(ranks.max())}, and the world has {world}"
    coord = mesh.get_coordinate()
    if coord is None:
        return f"rank {dist.get_rank()} is not one of its ranks {ranks.flatten().tolist()}"
    for d in range(ranks.dim()):
        along = ranks[tuple(slice(None) if i == d else c for i, c in enumerate(coord))].tolist()
        try:
            have = dist.get_process_group_ranks(mesh.get_group(d))
        except (RuntimeError, ValueError, KeyError) as exc:
            return f"its dimension {d}'s process group does not resolve here ({exc})"
        if sorted(have) != sorted(along):
            return f"its dimension {d} names the process group of ranks {sorted(have)} here, not of ranks {along}"
    return ""


# -- the same values over host copies (async_save's staging) ------------------------------------------------

def value_tensors(sd: dict, prefix: str = "") -> list:
    """``[(flat key, tensor)]`` of a state dict of these values: plain tensors and ``ShardedTensor`` local shards.

    >>> value_tensors({"model": {"w": st}})   # [("model.w#0", st.local_shards()[0].tensor)]
    """
    out = []
    for k, v in sd.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out += value_tensors(v, key + ".")
        elif _is_sharded_tensor(v):
            with quiet_sharded_tensor():
                out += [(f"{key}#{i}", s.tensor) for i, s in enumerate(v.local_shards())]
        elif isinstance(v, torch.Tensor):
            out.append((key, v))
    return out


def over_copies(sd: dict, copies: dict, rank: int, prefix: str = "") -> dict:
    """``sd`` with every tensor replaced by its copy in ``copies`` (keyed as :func:`value_tensors` keys them).
    A ``ShardedTensor`` keeps its boxes and group; its placements and properties say where the copies are
    (``cpu``; pinned or not), as torch checks.

    >>> over_copies(sd, {"model.w#0": host_w}, rank)   # the same values, over host memory
    """
    import dataclasses
    with quiet_sharded_tensor():
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
    out = {}
    for k, v in sd.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out[k] = over_copies(v, copies, rank, key + ".")
        elif isinstance(v, ShardedTensor):
            with quiet_sharded_tensor():
                md = v.metadata()
                local = [(copies[f"{key}#{i}"], tuple(s.metadata.shard_offsets)) for i, s in enumerate(v.local_shards())]
                pinned = bool(local) and local[0][0].is_pinned()
                boxes = [ShardMetadata(list(m.shard_offsets), list(m.shard_sizes), f"rank:{m.placement.rank()}/cpu")
                         for m in md.shards_metadata]
                by_offset = {tuple(m.shard_offsets): m for m in boxes if m.placement.rank() == rank}
                meta = ShardedTensorMetadata(boxes, md.size, dataclasses.replace(md.tensor_properties, pin_memory=pinned))
                out[k] = ShardedTensor._init_from_local_shards_and_global_metadata(
                    [Shard(t, by_offset[off]) for t, off in local], meta, process_group=v._process_group)
        elif isinstance(v, torch.Tensor):
            out[k] = copies[key]
        else:
            out[k] = v
    return out
