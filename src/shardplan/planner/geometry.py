"""Per-rank geometry and layout policy: which buffer layout a spec gets, and which piece of every
parameter each rank holds (:class:`~shardplan.planner.values.Piece`: its global box, its box in the
tensor-parallel-local tensor, where it sits in the rank's shard and in the gathered buffer). Pure
functions over the plan's values; checkpoints are built on the pieces' boxes, never on the buffer layout.

>>> piece(mesh, p, index=3, b=buffers[p.buffer], rank=1, full_offset=0).box   # e.g. (slice(64, 128), slice(0, 256))
"""

from __future__ import annotations

import math
import operator
from typing import Optional, Sequence

from .. import layout as L
from ..dtypes import dtype_name, is_floating, itemsize
from ..errors import PlanError
from ..mesh import Mesh
from ..spec import P
from .kinds import LAYOUTS, LayoutChoice  # noqa: F401  (LAYOUTS: re-exported)
from .values import Box, BufferPlan, ParamPlan, Piece


# -- per-rank pieces -------------------------------------------------------------------------------

def check_rank(mesh: Mesh, rank: int) -> int:
    """``rank`` as an ``int`` when it is a rank of ``mesh``; else a :class:`PlanError` naming the ranks."""
    try:
        r = operator.index(rank)
    except TypeError:
        r = -1
    if not 0 <= r < mesh.size:
        raise PlanError(f"rank {rank!r} is not a rank of {mesh!r} (0..{mesh.size - 1})")
    return r


def owner_axes(plan, name: str) -> tuple[str, ...]:
    """Mesh axes along which ranks hold different pieces of ``plan``'s parameter ``name`` (storage and compute),
    in mesh order."""
    p = plan.param(name)
    b = plan.buffers[p.buffer]
    axes = set(b.axes if b.sharded else ()) | ({p.tp_axis} if p.tp_axis else set())
    return tuple(a for a in plan.mesh.axis_names if a in axes)


def replicas(plan, name: str) -> int:
    """How many ranks hold each element of ``name`` (copies over the axes that do not shard it)."""
    return plan.mesh.size // plan.mesh.axis_size(owner_axes(plan, name))


def segment(mesh: Mesh, b: BufferPlan, rank: int) -> int:
    """Index of ``rank``'s segment in ``b``'s gathered layout (its rank in the shard group)."""
    return mesh.axis_index(rank, b.axes) if b.sharded else 0


def storage_box(mesh: Mesh, p: ParamPlan, b: BufferPlan, rank: int) -> Optional[Box]:
    """The box of ``rank``'s shard inside the tensor-parallel-local tensor (``p.shape``); ``None``: empty."""
    full = tuple(slice(0, d) for d in p.shape)
    if not b.sharded or p.numel == 0:
        return full
    if b.layout == L.CONTIGUOUS:
        r0, r1 = L.contiguous_rows(p.offset, p.numel, p.row, b.shard_numel, segment(mesh, b, rank))
        return None if r1 <= r0 else (slice(r0, r1),) + full[1:]
    box = []
    spec = p.storage_spec
    for d, size in enumerate(p.shape):
        axes = spec.dim_axes(d)
        parts = mesh.axis_size(axes) if axes else 1
        s, e = L.chunk_range(size, parts, mesh.axis_index(rank, axes)) if axes else (0, size)
        if e <= s:
            return None
        box.append(slice(s, e))
    return tuple(box)


def global_box(mesh: Mesh, p: ParamPlan, storage: Optional[Box], rank: int) -> Optional[Box]:
    """The storage box moved to ``rank``'s tensor-parallel block of the whole tensor."""
    c = p.compute
    if storage is None or c is None:
        return storage
    start = mesh.axis_index(rank, (c.axis,)) * p.shape[c.dim]
    s = storage[c.dim]
    return storage[:c.dim] + (slice(start + s.start, start + s.stop),) + storage[c.dim + 1:]


def shard_offset(mesh: Mesh, p: ParamPlan, b: BufferPlan, rank: int) -> int:
    """Where ``rank``'s piece of ``p`` starts in its own shard of ``b`` (elements).

    [Note: for a contiguous parameter a rank holds no rows of, this is still the formula's value (callers
    check ``box is None`` first), so it is ``plan.piece(name, rank).shard_offset`` of every rank]
    """
    if b.layout == L.CONTIGUOUS:
        seg = segment(mesh, b, rank)
        return max(p.offset, seg * b.shard_numel) - seg * b.shard_numel
    return p.offset


def full_offsets(params: Sequence[ParamPlan], buffers: Sequence[BufferPlan]) -> tuple[int, ...]:
    """Per parameter (in ``params`` order) where it starts in its buffer's full parameters, in parameter layout:
    copy-out (interleaved) buffers hold their parameters back to back, in buffer order; the others in place,
    at the parameter's offset in the gathered buffer.

    >>> full_offsets(plan.params, plan.buffers)[3]        # the fourth parameter's
    """
    by_name = {p.name: p for p in params}
    packed: dict[str, int] = {}
    for b in buffers:
        if b.copy_out:
            c = 0
            for n in b.params:
                packed[n] = c
                c += by_name[n].numel
    return tuple(packed[p.name] if buffers[p.buffer].copy_out else p.offset for p in params)


def piece(mesh: Mesh, p: ParamPlan, *, index: int, b: BufferPlan, rank: int, full_offset: int) -> Piece:
    """``rank``'s piece of parameter ``p`` (``index``: its position in ``plan.params``, ``b``: its buffer)."""
    box = storage_box(mesh, p, b, rank)
    shape = tuple(s.stop - s.start for s in box) if box is not None else ((0,) + tuple(p.shape[1:]) if p.shape else (0,))
    return Piece(param=p.name, index=index, buffer=p.buffer, rank=rank, box=global_box(mesh, p, box, rank),
                 storage_box=box, shard_offset=shard_offset(mesh, p, b, rank), shape=shape, full_offset=full_offset)


def pieces(mesh: Mesh, params: Sequence[ParamPlan], buffers: Sequence[BufferPlan], offsets: Sequence[int],
           rank: int) -> tuple[Piece, ...]:
    """Every piece ``rank`` holds, in ``params`` order (``offsets``: :func:`full_offsets`)."""
    return tuple(piece(mesh, p, index=i, b=buffers[p.buffer], rank=rank, full_offset=offsets[i])
                 for i, p in enumerate(params))


# -- layout policy ---------------------------------------------------------------------------------

def placement_kind(spec: P, mesh: Mesh, level: int, layout: LayoutChoice = LayoutChoice.AUTO) -> tuple[str, tuple[str, ...]]:
    """The layout a spec gets and its shard axes in mesh order (ZeRO-0 replicates everything).
    ``layout="chunked"`` never packs contiguously: every rank holds ``torch.chunk`` pieces (FSDP2's and
    DTensor's layout), so its shards can be described as DTensors."""
    if level == 0 or not spec.axes:
        return L.REPLICATED, ()
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    axes = tuple(sorted(spec.axes, key=order.__getitem__))
    if layout == LayoutChoice.AUTO and spec.sharded_dims == (0,) and spec.dim_axes(0) == axes:
        return L.CONTIGUOUS, axes
    return L.INTERLEAVED, axes


def _interleaved(members, mesh: Mesh, A: int) -> L.Placement:
    chunks = []
    for info, spec in members:
        parts = [mesh.axis_size(spec.dim_axes(d)) if spec.dim_axes(d) else 1 for d in range(len(info.shape))]
        chunks.append(math.prod(L.chunk_shape(info.shape, parts)))
    return L.place_interleaved(chunks, A)


def layout_unit(members, mesh: Mesh, level: int, compute: Optional[str],
                layout: LayoutChoice = LayoutChoice.AUTO, gather: Optional[dict] = None) -> dict[tuple, tuple[L.Placement, list]]:
    """Group a unit's (info, spec) pairs into buffers: {(dtype, requires_grad, axes, kind, gather dtype): (placement,
    members)}. ``gather`` maps parameter names to their quantized gather format (:mod:`shardplan.lowp`; a
    replicated buffer is never gathered, so never quantized).

    A contiguous group whose padding would exceed 1% of its data *and* twice the interleaved padding
    joins the interleaved group of its key: zero copy-out is worth a little padding, not a lot.
    """
    groups: dict[tuple, list] = {}
    for info, spec in members:
        kind, axes = placement_kind(spec, mesh, level, layout)
        fmt = (gather or {}).get(info.name, "") if kind != L.REPLICATED else ""
        key = (dtype_name(info.dtype), info.requires_grad, axes, kind, fmt)
        groups.setdefault(key, []).append((info, spec))
    out: dict[tuple, tuple[L.Placement, list]] = {}
    for key, mem in groups.items():
        dtype, rg, axes, kind, fmt = key
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
        ikey = (dtype, rg, axes, L.INTERLEAVED, fmt)
        merged = out.pop(ikey, (None, []))[1] + mem
        out[ikey] = (_interleaved(merged, mesh, A), merged)
    return out
