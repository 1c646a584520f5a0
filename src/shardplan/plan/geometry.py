"""Per-rank geometry and layout policy: which buffer layout a spec gets, and which global box of every
parameter each rank holds. Pure functions over the plan's values; checkpoints are built on
``local_slices``, never on the buffer layout."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from .. import layout as L
from ..dtypes import dtype_name, is_floating, itemsize
from ..mesh import Mesh
from ..spec import P

if TYPE_CHECKING:  # pragma: no cover
    from .types import BufferPlan, Plan


# -- per-rank boxes --------------------------------------------------------------------------------

def segment(mesh: Mesh, b: "BufferPlan", rank: int) -> int:
    return mesh.axis_index(rank, b.axes) if b.sharded else 0


def local_slices(plan: "Plan", name: str, rank: int) -> Optional[tuple[slice, ...]]:
    """The global box: the storage box moved to ``rank``'s tensor-parallel block."""
    box = storage_slices(plan, name, rank)
    p = plan.param(name)
    if box is None or p.tp_dim < 0:
        return box
    start = plan.mesh.axis_index(rank, (p.tp_axis,)) * p.shape[p.tp_dim]
    s = box[p.tp_dim]
    return box[:p.tp_dim] + (slice(start + s.start, start + s.stop),) + box[p.tp_dim + 1:]


def storage_slices(plan: "Plan", name: str, rank: int) -> Optional[tuple[slice, ...]]:
    """The box of ``rank``'s shard inside the tensor-parallel-local tensor (``p.shape``)."""
    p = plan.param(name)
    b = plan.buffers[p.buffer]
    full = tuple(slice(0, d) for d in p.shape)
    if not b.sharded or p.numel == 0:
        return full
    if b.layout == L.CONTIGUOUS:
        r0, r1 = L.contiguous_rows(p.offset, p.numel, p.row, b.shard_numel, segment(plan.mesh, b, rank))
        return None if r1 <= r0 else (slice(r0, r1),) + full[1:]
    box = []
    spec = p.storage_spec
    for d, size in enumerate(p.shape):
        axes = spec.dim_axes(d)
        parts = plan.mesh.axis_size(axes) if axes else 1
        s, e = L.chunk_range(size, parts, plan.mesh.axis_index(rank, axes)) if axes else (0, size)
        if e <= s:
            return None
        box.append(slice(s, e))
    return tuple(box)


def local_shape(plan: "Plan", name: str, rank: int) -> tuple[int, ...]:
    box = storage_slices(plan, name, rank)
    p = plan.param(name)
    if box is None:
        return (0,) + tuple(p.shape[1:]) if p.shape else (0,)
    return tuple(s.stop - s.start for s in box)


def local_offset(plan: "Plan", name: str, rank: int) -> int:
    p = plan.param(name)
    b = plan.buffers[p.buffer]
    if b.layout == L.CONTIGUOUS:
        seg = segment(plan.mesh, b, rank)
        return max(p.offset, seg * b.shard_numel) - seg * b.shard_numel
    return p.offset


# -- layout policy ---------------------------------------------------------------------------------

LAYOUTS = ("auto", "chunked")  # plan(layout=...): the planner's choice, or torch.chunk per sharded dim everywhere


def placement_kind(spec: P, mesh: Mesh, level: int, layout: str = "auto") -> tuple[str, tuple[str, ...]]:
    """The layout a spec gets and its shard axes in mesh order (ZeRO-0 replicates everything).
    ``layout="chunked"`` never packs contiguously: every rank holds ``torch.chunk`` pieces (FSDP2's and
    DTensor's layout), so its shards can be described as DTensors."""
    if level == 0 or not spec.axes:
        return L.REPLICATED, ()
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    axes = tuple(sorted(spec.axes, key=order.__getitem__))
    if layout == "auto" and spec.sharded_dims == (0,) and spec.dim_axes(0) == axes:
        return L.CONTIGUOUS, axes
    return L.INTERLEAVED, axes


def _interleaved(members, mesh: Mesh, A: int) -> L.Placement:
    chunks = []
    for info, spec in members:
        parts = [mesh.axis_size(spec.dim_axes(d)) if spec.dim_axes(d) else 1 for d in range(len(info.shape))]
        chunks.append(math.prod(L.chunk_shape(info.shape, parts)))
    return L.place_interleaved(chunks, A)


def layout_unit(members, mesh: Mesh, level: int, compute: Optional[str],
                layout: str = "auto") -> dict[tuple, tuple[L.Placement, list]]:
    """Group a unit's (info, spec) pairs into buffers: {(dtype, requires_grad, axes, kind): (placement, members)}.

    A contiguous group whose padding would exceed 1% of its data *and* twice the interleaved padding
    joins the interleaved group of its key: zero copy-out is worth a little padding, not a lot.
    """
    groups: dict[tuple, list] = {}
    for info, spec in members:
        kind, axes = placement_kind(spec, mesh, level, layout)
        key = (dtype_name(info.dtype), info.requires_grad, axes, kind)
        groups.setdefault(key, []).append((info, spec))
    out: dict[tuple, tuple[L.Placement, list]] = {}
    for key, mem in groups.items():
        dtype, rg, axes, kind = key
        cdt = compute if compute and is_floating(dtype) else dtype
        A = L.align_elems(itemsize(dtype), itemsize(cdt))
        W = mesh.axis_size(axes) if axes else 1
        if kind == L.REPLICATED:
            out[key] = (L.place_replicated([math.prod(i.shape) for i, _ in mem], A), mem)
            continue
        if kind == L.CONTIGUOUS:
            items = tuple((math.prod(i.shape), math.prod(i.shape[1:])) for i, _ in mem)
            cont = L.place_contiguous(items, W, A)
            inter = _interleaved(mem, mesh, A)
            total = sum(n for n, _ in items)
            if cont is not None and cont.shard_numel * W - total <= max(2 * (inter.shard_numel * W - total), total // 100):
                out[key] = (cont, mem)
                continue
        ikey = (dtype, rg, axes, L.INTERLEAVED)
        merged = out.pop(ikey, (None, []))[1] + mem
        out[ikey] = (_interleaved(merged, mesh, A), merged)
    return out
