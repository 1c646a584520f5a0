"""Per-rank storage of one planned buffer: the local shard, the full parameters, the gradients.

Which tensors exist and when they live follows the buffer's facts (``alias``, ``persistent``,
``grad_alias``, ``keeps_grads``), decided by the planner; :mod:`shardplan.plan.accounting` counts the
same tensors. Layouts (see :mod:`shardplan.layout`): ``contiguous`` and ``replicated`` buffers are used
in place (every full parameter is a view of the gathered buffer); ``interleaved`` buffers gather into a
packed tensor and copy out into parameter layout (and copy gradients back in before reducing).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from ..dtypes import to_torch
from ..errors import RuntimeShardingError
from ..plan import BufferPlan, Plan


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
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    t.set_(base.untyped_storage(), base.storage_offset() + offset, tuple(shape), tuple(reversed(stride)))
    return t


def same_storage(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    return a is not None and b is not None and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() \
        and a.untyped_storage().size() > 0


class BufferState:
    """Tensors of one buffer on this rank, and the moves between them. No collectives here."""

    def __init__(self, plan: Plan, bp: BufferPlan, rank: int, device: torch.device):
        self.bp = bp
        self.dtype, self.cdtype, self.rdtype = to_torch(bp.dtype), to_torch(bp.compute_dtype), to_torch(bp.reduce_dtype)
        self.S, self.G = bp.shard_numel, bp.gathered_numel
        self.sharded, self.requires_grad = bp.sharded, bp.requires_grad
        self.device = device
        self.seg = plan.segment(bp, rank)
        self.infos = [plan.param(n) for n in bp.params]
        self.param_index = [plan.index(n) for n in bp.params]
        # full: the full parameters' storage, in parameter layout (interleaved: packed elsewhere)
        self.full = torch.zeros(bp.numel if bp.copy_out else self.G, dtype=self.cdtype, device=device)
        self.packed = torch.zeros(self.G, dtype=self.cdtype, device=device) if bp.copy_out else None
        if bp.alias:
            self.shard = self.full[self.seg * self.S:(self.seg + 1) * self.S] if self.sharded else self.full
        else:
            self.shard = torch.zeros(self.S, dtype=self.dtype, device=device)
        self.offsets = []  # offset of each parameter in `full`
        c = 0
        for p in self.infos:
            self.offsets.append(c if bp.copy_out else p.offset)
            c += p.numel
        self.local_boxes = []  # (box in the tensor-parallel-local tensor or None, offset in shard, local shape)
        for p in self.infos:
            box = plan.storage_slices(p.name, rank)
            self.local_boxes.append((box, plan.local_offset(p.name, rank) if box is not None else 0,
                                     plan.local_shape(p.name, rank)))
        self.copy_plans = self._copy_plans(plan) if bp.copy_out else None
        self.flat: Optional[torch.Tensor] = None  # the unsharded gradient, in compute dtype
        self.flat_window = -1
        self.views: list[torch.Tensor] = []
        self.handles: list[torch.Tensor] = []  # what the full parameters' .grad are: the views (or DTensors over them)
        self.wraps: list = [None] * len(self.infos)  # tensor-parallel parameters: local tensor -> DTensor
        self.local: list[nn.Parameter] = []
        self.full_params: list[nn.Parameter] = []
        if self.packed is not None:
            free_storage(self.packed)

    def _copy_plans(self, plan: Plan):
        """Per parameter: (segment index, global box, numel) for every member of the shard group."""
        first = plan.mesh.rank_of([0] * len(plan.mesh.axis_names))
        group = plan.mesh.group_of(first, self.bp.axes) if self.bp.axes else (first,)
        out = []
        for p in self.infos:
            pieces = []
            for seg, r in enumerate(group):
                box = plan.storage_slices(p.name, r)
                if box is not None:
                    pieces.append((seg, box, math.prod(s.stop - s.start for s in box)))
            out.append(pieces)
        return out

    # -- construction ---------------------------------------------------------------------------
    def fill_local(self, originals: list[Optional[torch.Tensor]]) -> None:
        """Copy this rank's pieces of the full parameters into the shard."""
        with torch.no_grad():
            for (box, off, shape), t in zip(self.local_boxes, originals):
                if box is None or t is None:
                    continue
                self.shard[off:off + math.prod(shape)].copy_(t[box].reshape(-1))

    def make_params(self, wraps: Optional[list] = None) -> None:
        """The local shards and the full parameters; ``wraps[i]`` (tensor parallelism) turns parameter i's
        full tensor into the DTensor its module computes with, over the same storage."""
        self.wraps = list(wraps) if wraps is not None else self.wraps
        self.local = [nn.Parameter(self.shard[off:off + math.prod(shape)].view(shape), requires_grad=p.requires_grad)
                      for (box, off, shape), p in zip(self.local_boxes, self.infos)]
        self.full_params = [nn.Parameter(self._wrap(i, alias(self.full, off, p.shape)), requires_grad=p.requires_grad)
                            for i, (off, p) in enumerate(zip(self.offsets, self.infos))]
        if not self.bp.persistent:
            free_storage(self.full)

    # -- full parameters --------------------------------------------------------------------------
    def gather_output(self) -> torch.Tensor:
        """Allocate what the all-gather writes into (the full buffer, or the packed one) and return it."""
        if not self.bp.persistent:
            alloc_storage(self.full)
        if self.packed is not None:
            alloc_storage(self.packed)
            return self.packed
        return self.full

    def gather_input(self, collective: bool) -> torch.Tensor:
        """The shard as the all-gather sends it: cast to the compute dtype, or a copy when it is part of
        the output (in-place gathers are not portable across backends)."""
        if self.cdtype != self.dtype:
            return self.shard.to(self.cdtype)
        return self.shard.clone() if collective and self.bp.alias else self.shard

    def finish_gather(self) -> None:
        """After the all-gather completed: copy interleaved pieces out into parameter layout."""
        if self.packed is None:
            return
        packed = self.packed.view(self.bp.group_size, self.S) if self.sharded else self.packed.view(1, -1)
        with torch.no_grad():
            for i, p in enumerate(self.infos):
                target = self.full[self.offsets[i]:self.offsets[i] + p.numel].view(p.shape)
                for seg, box, n in self.copy_plans[i]:
                    target[box].copy_(packed[seg, p.offset:p.offset + n].view([s.stop - s.start for s in box]))
        free_storage(self.packed)

    def release_full(self) -> None:
        if not self.bp.persistent:
            free_storage(self.full)
        if self.packed is not None:
            free_storage(self.packed)

    # -- gradients ------------------------------------------------------------------------------------
    def prepare_grads(self, window: int) -> None:
        """Make the unsharded gradient of ``window`` exist (zeroed once per window) and point every full
        parameter's ``.grad`` at its view, folding in gradients autograd made before we got here."""
        if not self.requires_grad:
            return
        if self.flat is None or self.flat_window != window:
            lent = self.flat is not None and any(same_storage(lp.grad, self.flat) for lp in self.local)
            if self.flat is None or lent:  # the old one still holds the local shards' gradients
                self._new_flat(torch.zeros)
            else:
                self.flat.zero_()
            self.flat_window = window
        for fp, h in zip(self.full_params, self.handles):
            if fp.requires_grad and fp.grad is not h:
                if fp.grad is not None:
                    h.add_(fp.grad)
                fp.grad = h

    def _wrap(self, i: int, t: torch.Tensor) -> torch.Tensor:
        return self.wraps[i](t) if self.wraps[i] is not None else t

    def _new_flat(self, make) -> None:
        self.flat = make(self.bp.grad_numel, dtype=self.cdtype, device=self.device)
        self.views = [self.flat[off:off + p.numel].view(p.shape) for off, p in zip(self.offsets, self.infos)]
        self.handles = [self._wrap(i, v) for i, v in enumerate(self.views)]

    def land_grads(self, window: int, arrived: list) -> None:
        """Add ``(parameter index, gradient)`` pairs into the unsharded gradient; the first arrival of a
        window copies instead of zeroing and adding (the other parameters' pieces are zeroed)."""
        fresh = self.flat is None or self.flat_window != window
        if self.flat is None:
            self._new_flat(torch.empty)
        views = [self.views[i] for i, _ in arrived]
        grads = [g for _, g in arrived]
        if not fresh:
            torch._foreach_add_(views, grads)
            return
        self.flat_window = window
        given = {i for i, _ in arrived}
        rest = [v for i, v in enumerate(self.views) if i not in given]
        torch._foreach_copy_(views, grads)
        if rest:
            torch._foreach_zero_(rest)
        if self.bp.grad_numel != sum(p.numel for p in self.infos):
            self._zero_gaps()

    def _zero_gaps(self) -> None:
        """Zero the padding between parameters (it is reduced too: keep it finite)."""
        c = 0
        for off, p in sorted(zip(self.offsets, (p.numel for p in self.infos))):
            if off > c:
                self.flat[c:off].zero_()
            c = max(c, off + p)
        if c < self.flat.numel():
            self.flat[c:].zero_()

    def reduction_input(self, window: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The gradient as the reduction reads it: gathered layout, reduce dtype (written into ``out`` when
        given: a reduction that moves nothing then leaves its result there)."""
        self.prepare_grads(window)
        g = self.flat
        if self.packed is not None:  # copy-in: parameter layout -> packed segments
            g = torch.zeros(self.G, dtype=self.cdtype, device=self.device)
            view = g.view(self.bp.group_size, self.S)
            for i, p in enumerate(self.infos):
                for seg, box, n in self.copy_plans[i]:
                    view[seg, p.offset:p.offset + n].copy_(self.views[i][box].reshape(-1))
        if out is not None:
            out.copy_(g[:out.numel()])
            return out
        return g if self.rdtype == self.cdtype else g.to(self.rdtype)

    def assign_local_grads(self, result: torch.Tensor) -> list[int]:
        """Give the local shards their reduced gradient (``result``: S elements, or G if replicated);
        returns the plan indices of parameters whose ``.grad`` this created."""
        if result.dtype != self.dtype:
            result = result.to(self.dtype)
        created = []
        try:
            for (box, off, shape), lp, idx in zip(self.local_boxes, self.local, self.param_index):
                if not lp.requires_grad:
                    continue
                g = result[off:off + math.prod(shape)].view(shape)
                if lp.grad is None:
                    lp.grad = g
                    created.append(idx)
                else:
                    lp.grad.add_(g)
        except RuntimeError:
            # [Note: a child module's .to()/.half() after shard() replaced a local parameter's .data; torch's
            # own error here is a bare grad dtype/device mismatch. Diagnosed only on failure: no per-step cost.]
            from .seams import detached_local
            why = detached_local(self)
            if why:
                raise RuntimeShardingError(why) from None
            raise
        return created

    def detach_grads(self) -> None:
        """The full parameters stop pointing at the unsharded gradient (it is reduced; a later gradient
        must not land in it)."""
        for fp in self.full_params:
            fp.grad = None

    def release_grads(self) -> None:
        self.detach_grads()
        self.flat, self.views, self.handles, self.flat_window = None, [], [], -1

    def local_grad_by_index(self) -> dict[int, nn.Parameter]:
        return dict(zip(self.param_index, self.local))

    def tensors(self) -> list[Optional[torch.Tensor]]:
        """Every tensor this buffer holds now (for the runtime's memory accounting)."""
        return [self.shard, self.full, self.packed, self.flat] + [lp.grad for lp in self.local]
