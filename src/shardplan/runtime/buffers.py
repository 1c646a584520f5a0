"""Per-rank storage of one planned buffer: the local shard, the gathered buffer, gradients.

Layouts (see ``shardplan.layout``): ``contiguous`` and ``replicated`` buffers are used in place
(every unsharded parameter is a view of the gathered buffer); ``interleaved`` buffers gather into a
packed tensor and copy out into parameter layout (and copy gradients back in before reducing).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from .. import layout as L
from ..dtypes import to_torch
from ..plan import BufferPlan, Plan


def alloc(numel: int, dtype, device, zero: bool = False) -> torch.Tensor:
    return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)


def free_storage(t: torch.Tensor) -> None:
    if t.untyped_storage().size() != 0:
        t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    need = t.numel() * t.element_size()
    if t.untyped_storage().size() != need:
        t.untyped_storage().resize_(need)


def alias(base: torch.Tensor, offset: int, shape) -> torch.Tensor:
    """A tensor over ``base``'s storage with its own version counter (so writes into ``base``
    by collectives never trip autograd's saved-tensor checks on the parameters)."""
    t = torch.empty(0, dtype=base.dtype, device=base.device)
    stride = []
    acc = 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    t.set_(base.untyped_storage(), base.storage_offset() + offset, tuple(shape), tuple(reversed(stride)))
    return t


class BufferState:
    def __init__(self, plan: Plan, bp: BufferPlan, rank: int, device: torch.device, level: int):
        self.bp = bp
        self.layout = bp.layout
        self.dtype, self.cdtype, self.rdtype = to_torch(bp.dtype), to_torch(bp.compute_dtype), to_torch(bp.reduce_dtype)
        self.S, self.G = bp.shard_numel, bp.gathered_numel
        self.sharded = bp.layout != L.REPLICATED
        self.seg = plan.segment(bp, rank)
        self.requires_grad = bp.requires_grad
        self.device = device
        self.infos = [plan.param(n) for n in bp.params]
        self.alias = self.cdtype == self.dtype and (not self.sharded or level in (0, 1, 2))
        self.persistent = level in (0, 1, 2) or self.alias
        self.full = alloc(self.G, self.cdtype, device, zero=True)
        if self.alias:
            self.shard = self.full[self.seg * self.S:(self.seg + 1) * self.S] if self.sharded else self.full
        else:
            self.shard = alloc(self.S, self.dtype, device, zero=True)
        # interleaved: parameters live in param layout in `out`, gathered data lands in `full`
        self.out = alloc(bp.numel, self.cdtype, device) if bp.layout == L.INTERLEAVED else None
        self.out_offsets = []
        c = 0
        for p in self.infos:
            self.out_offsets.append(c)
            c += p.numel
        # local pieces: (global box, offset in shard, numel)
        self.local_boxes = []
        for p in self.infos:
            box = plan.local_slices(p.name, rank)
            shape = plan.local_shape(p.name, rank)
            self.local_boxes.append((box, plan.local_offset(p.name, rank) if box is not None else 0, shape))
        self.copy_plans = self._copy_plans(plan) if bp.layout == L.INTERLEAVED else None
        self.grad_full: Optional[torch.Tensor] = None
        self.grad_views: list[torch.Tensor] = []
        self.grad_lent = False  # grad_full is also the local params' .grad (replicated, same dtypes)
        self.needs_zero = False
        self.local: list[nn.Parameter] = []
        self.full_params: list[nn.Parameter] = []

    # -- construction ---------------------------------------------------------------------------
    def _copy_plans(self, plan: Plan):
        """Per parameter: (segment index, global box, numel) for every member of the shard group."""
        group = plan.mesh.group_of(plan.mesh.rank_of([0] * len(plan.mesh.axis_names)), self.bp.axes) if self.bp.axes else (0,)
        out = []
        for p in self.infos:
            pieces = []
            for seg, r in enumerate(group):
                box = plan.local_slices(p.name, r)
                if box is not None:
                    pieces.append((seg, box, math.prod(s.stop - s.start for s in box)))
            out.append(pieces)
        return out

    def fill_local(self, originals: list[torch.Tensor]) -> None:
        """Copy this rank's pieces of the full parameters into the shard."""
        with torch.no_grad():
            for (box, off, shape), t in zip(self.local_boxes, originals):
                if box is None or t is None:
                    continue
                n = math.prod(shape)
                self.shard[off:off + n].copy_(t[box].reshape(-1))  # (ZeRO-1/2: a slice of `full`; the first forward gathers the rest)

    def make_params(self) -> None:
        self.local = []
        for (box, off, shape), p in zip(self.local_boxes, self.infos):
            n = math.prod(shape)
            self.local.append(nn.Parameter(self.shard[off:off + n].view(shape), requires_grad=p.requires_grad))
        self.full_params = []
        for i, p in enumerate(self.infos):
            base, off = (self.out, self.out_offsets[i]) if self.out is not None else (self.full, p.offset)
            self.full_params.append(nn.Parameter(alias(base, off, p.shape), requires_grad=p.requires_grad))
        if not self.persistent:
            self.free()

    # -- gathered storage -------------------------------------------------------------------------
    def allocate(self) -> None:
        alloc_storage(self.full)
        if self.out is not None:
            alloc_storage(self.out)

    def free(self) -> None:
        if self.persistent:
            return
        free_storage(self.full)
        if self.out is not None:
            free_storage(self.out)

    def release_gather_buffer(self) -> None:
        """After copy-out, the packed gathered tensor of an interleaved buffer is not needed."""
        if self.out is not None and not self.persistent:
            free_storage(self.full)

    def copy_out(self) -> None:
        if self.out is None:
            return
        packed = self.full.view(self.bp.group_size, self.S) if self.sharded else self.full.view(1, -1)
        with torch.no_grad():
            for i, p in enumerate(self.infos):
                target = self.out[self.out_offsets[i]:self.out_offsets[i] + p.numel].view(p.shape)
                base = p.offset
                for seg, box, n in self.copy_plans[i]:
                    target[box].copy_(packed[seg, base:base + n].view([s.stop - s.start for s in box]))

    # -- gradients -------------------------------------------------------------------------------------
    def grad_numel(self) -> int:
        return self.bp.numel if self.out is not None else self.G

    def prepare_grads(self) -> None:
        """Point every unsharded parameter's .grad at a view of one flat buffer (zeroed once)."""
        if not self.requires_grad:
            return
        if self.grad_full is None or (self.needs_zero and self.grad_lent and any(l.grad is not None for l in self.local)):
            if self.grad_views:  # the old flat gradient now belongs to the local .grads: detach from it
                for fp in self.full_params:
                    fp.grad = None
            self.grad_full = alloc(self.grad_numel(), self.cdtype, self.device, zero=True)
            self.grad_lent = False
            self.grad_views = []
        elif self.needs_zero:
            self.grad_full.zero_()
        self.needs_zero = False
        if not self.grad_views:
            for i, p in enumerate(self.infos):
                off = self.out_offsets[i] if self.out is not None else p.offset
                self.grad_views.append(self.grad_full[off:off + p.numel].view(p.shape))
        for fp, v in zip(self.full_params, self.grad_views):
            if fp.requires_grad and fp.grad is not v:
                if fp.grad is not None:  # a gradient autograd made before we got here
                    v.add_(fp.grad)
                fp.grad = v

    def collect_grads(self) -> torch.Tensor:
        """Flat gradient in gathered layout and reduce dtype, ready for the reduce-scatter."""
        if self.grad_full is None:
            self.prepare_grads()
        for fp, v in zip(self.full_params, self.grad_views):
            if fp.grad is not None and fp.grad is not v:
                v.add_(fp.grad)
        g = self.grad_full
        if self.out is not None:  # copy-in: param layout -> packed segments
            packed = torch.zeros(self.G, dtype=self.cdtype, device=self.device)
            view = packed.view(self.bp.group_size, self.S) if self.sharded else packed.view(1, -1)
            for i, p in enumerate(self.infos):
                src = self.grad_views[i]
                for seg, box, n in self.copy_plans[i]:
                    view[seg, p.offset:p.offset + n].copy_(src[box].reshape(-1))
            g = packed
        return g if self.rdtype == self.cdtype else g.to(self.rdtype)

    def drop_full_grads(self) -> None:
        for fp in self.full_params:
            fp.grad = None
        self.grad_full = None
        self.grad_views = []

    def assign_local_grads(self, flat: torch.Tensor) -> None:
        """Give the local shards their reduced gradient (``flat``: S elements, or G if replicated)."""
        if flat.dtype != self.dtype:
            flat = flat.to(self.dtype)
        for (box, off, shape), lp in zip(self.local_boxes, self.local):
            if not lp.requires_grad:
                continue
            g = flat[off:off + math.prod(shape)].view(shape)
            if lp.grad is None:
                lp.grad = g
            else:
                lp.grad.add_(g)
