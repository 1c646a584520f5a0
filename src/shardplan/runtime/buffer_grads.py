"""The gradient side of one buffer on this rank (a mixin of ``BufferState``, runtime/buffers.py): the gradients
autograd formed landed in the unsharded flat gradient, the reduction's input made from it (copy-in, reduce
dtype, quantized segments), the reduced result handed to the local shards as their ``.grad``, and the flat
gradient's storage released."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..errors import RuntimeShardingError
from .dtensor_params import grad as as_dtensor_grad
from .norms import wrap as wrap_grad
from .quantize import quantize_into
from .seams import detached_local
from .storage import alloc_storage, free_storage

_chunk_cat = getattr(torch, "_chunk_cat", None)  # (torch >= 2.4, FSDP2's copy-in; else the per-parameter views)


def _local_part(g: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor gradient, in the placements of its DTensor parameter."""
    if getattr(g, "placements", None) is not None and tuple(g.placements) != tuple(param.placements):
        g = g.redistribute(param.device_mesh, param.placements)
    return g.to_local() if hasattr(g, "to_local") else g


class BufferGrads:
    """The gradients of a ``BufferState`` (its attributes ``members``, ``flat``, ``bp``, ... are set in its
    ``__init__``)."""

    # [Note: gradients land, they are not accumulated in place]
    # Autograd forms each full parameter's gradient as it would without shardplan (the first
    # contribution is stolen, later ones are added), and a unit's gradients land in its unsharded flat
    # gradient in one foreach copy when the unit completes (``collect_grads``), as FSDP2 copies into its
    # reduce-scatter input. Pointing ``.grad`` at views of a zeroed flat buffer instead costs a zeroing and
    # one in-place add per parameter and step, and keeps the whole buffer alive from the unit's first
    # gradient on (the root's for all of backward). Under ``no_sync`` the gradients stay with autograd,
    # which adds the next micro-step's into them, and land at the synchronising backward. The flat tensor
    # and its per-parameter views are made once; between windows only its storage is released.

    def collect_grads(self, window: int) -> None:
        """Land the gradients autograd formed on the full parameters (the module face) and drop them there."""
        arrived = []
        for i, m in enumerate(self.members):
            g = m.full.grad
            if g is not None:
                if m.wrap is not None:  # a DTensor (tensor parallelism): this rank's part, in its own placement
                    g = _local_part(g, m.full)
                arrived.append((i, g))
                m.full.grad = None
        if arrived:
            self.land_grads(window, arrived)

    def start_grads(self) -> None:
        """The unit's gradients start forming (its ``prepare grads`` op)."""
        self.forming = self.requires_grad

    def forming_bytes(self) -> int:
        """Bytes of the gradients autograd forms before they land (in the compute dtype): the plan counts them
        in the flat gradient's place from ``prepare`` on (the runtime's accounting does the same, see
        :meth:`Executor._account`)."""
        if not self.forming or (self.flat is not None and self.flat.untyped_storage().size()):
            return 0
        return self.bp.grad_numel * self.bp.compute_itemsize  # autograd's, in the compute dtype

    def prepare_grads(self, window: int) -> None:
        """Make the unsharded gradient of ``window`` exist: zeros where nothing landed in this window."""
        if self.requires_grad and (self.flat_window != window or not self.flat.untyped_storage().size()):
            self._fresh_flat()
            self.flat.zero_()
            self.flat_window = window

    def _fresh_flat(self) -> None:
        """The flat gradient with storage, not lent to the local shards' gradients (contents undefined)."""
        if self.flat is None or self.lent:  # a lent one still holds the local shards' gradients: a new one
            self.flat = torch.empty(self.bp.grad_numel, dtype=self.fdtype, device=self.device)
            self.lent = False
            self.viewed = False
        else:
            alloc_storage(self.flat)

    def _views(self) -> None:
        """Each member's part of ``flat`` (``m.view``) and the padding between them, made once per flat tensor."""
        if self.viewed:
            return
        for m in self.members:
            m.view = self.flat[m.whole].view(m.info.shape)
        self.gap_views = [self.flat[g] for g in self._gaps()] if self.gappy else []
        self.viewed = True

    def land_grads(self, window: int, arrived: list) -> None:
        """Add ``(parameter index, gradient)`` pairs into the unsharded gradient; the first arrival of a
        window copies instead of zeroing and adding (the other parameters' pieces are zeroed)."""
        grads = [g for _, g in arrived]
        members = self.members
        if self.flat_window == window and self.flat is not None and self.flat.untyped_storage().size():
            self._views()
            torch._foreach_add_([members[i].view for i, _ in arrived], grads)
            return
        self._fresh_flat()
        self.flat_window = window
        # every member arrived, in member order (``arrived`` is), and they tile the flat gradient
        if self.tiled and len(arrived) == len(members) and _chunk_cat is not None and \
                sum(map(torch.Tensor.numel, grads)) == self.bp.grad_numel:
            # [Note: landing in one call] each gradient has its parameter's shape (autograd checks it), so
            # the concatenation of their elements, in member order, is exactly the flat layout. (The count is
            # checked all the same: an ``out=`` of another size would be resized, not refused; a gradient of
            # another shape takes the per-view path below, whose copy refuses it.)
            _chunk_cat(grads, 0, 1, out=self.flat.view(1, -1))
            return
        self._views()
        torch._foreach_copy_([members[i].view for i, _ in arrived], grads)
        rest = self.gap_views
        if len(arrived) < len(members):
            given = {i for i, _ in arrived}
            rest = rest + [m.view for i, m in enumerate(members) if i not in given]
        if rest:
            torch._foreach_zero_(rest)

    def _gaps(self) -> list[slice]:
        """The padding between parameters in the flat gradient (it is reduced too: kept zero, finite)."""
        out, c = [], 0
        for off, p in sorted((m.whole.start, m.whole.stop - m.whole.start) for m in self.members):
            if off > c:
                out.append(slice(c, off))
            c = max(c, off + p)
        if c < self.bp.grad_numel:
            out.append(slice(c, self.bp.grad_numel))
        return out

    def reduction_input(self, window: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The gradient as the reduction reads it: gathered layout, reduce dtype (written into ``out`` when
        given: a reduction that moves nothing then leaves its result there)."""
        self.prepare_grads(window)
        g = self.flat
        if self.packed is not None:  # copy-in: parameter layout -> packed segments
            self._views()
            g = torch.zeros(self.G, dtype=self.cdtype, device=self.device)
            view = g.view(self.bp.group_size, self.S)
            for m in self.members:
                n = m.even
                if n:
                    view[:, m.info.offset:m.info.offset + n].copy_(m.view.reshape(self.bp.group_size, n))
                    continue
                for seg, box, n in m.copy_plan:
                    view[seg, m.info.offset:m.info.offset + n].copy_(m.view[box].reshape(-1))
        if self.bp.reduce_quant:  # every segment quantized on its own: the all-to-all sends segment k to rank k
            wire = torch.empty(self.bp.reduce_bytes, dtype=torch.uint8, device=self.device)
            with torch.no_grad():
                quantize_into(g[:self.G], self.bp.reduce_quant, wire, self.bp.group_size)
            return wire
        if out is not None:
            out.copy_(g[:out.numel()])
            return out
        return g if g.dtype == self.rdtype else g.to(self.rdtype)

    def assign_local_grads(self, result: torch.Tensor) -> list[int]:
        """Give the local shards their reduced gradient (``result``: S elements, or G if replicated);
        returns the plan indices of parameters whose ``.grad`` this created."""
        if result.dtype != self.dtype:
            result = result.to(self.dtype)
        if self.flat is not None and result.untyped_storage().data_ptr() == self.flat.untyped_storage().data_ptr():
            self.lent = True  # the local gradients are views of the flat one: the next window makes a new one
        created, into, adds = [], [], []
        base = result.storage_offset()
        try:
            for m in self.members:
                lp = m.local
                if not lp.requires_grad:
                    continue
                have = lp.grad
                if m.dspec is not None:  # a DTensor parameter (dtensor_params.py): a DTensor gradient over the view
                    g = result.as_strided(m.dspec[1], m.dspec[2], base + m.shard.start)
                    if have is None:
                        lp.grad = as_dtensor_grad(g, m.dspec)
                        created.append(m.index)
                    else:
                        into.append(have._local_tensor)
                        adds.append(g)
                    continue
                g = result.as_strided(m.lshape, m.lstride, base + m.shard.start)
                if have is None:
                    lp.grad = g if self.grad_owner is None else wrap_grad(self.grad_owner, g, m.name)
                    created.append(m.index)
                else:  # accumulated into the existing .grad, all in one foreach add below
                    into.append(have)
                    adds.append(g)
            if into:
                with torch._C.DisableTorchFunctionSubclass():  # ShardGrads: plain tensors here, no dispatch
                    torch._foreach_add_(into, adds)
        except RuntimeError:
            # [Note: a child module's .to()/.half() after shard() replaced a local parameter's .data; torch's
            # own error here is a bare grad dtype/device mismatch. Diagnosed only on failure: no per-step cost.]
            why = detached_local(self)
            if why:
                raise RuntimeShardingError(why) from None
            raise
        return created

    def release_grads(self) -> None:
        """The unsharded gradient is reduced and delivered: release its storage (kept as one tensor with its
        views for the next window, unless the local gradients still read it)."""
        self.flat_window = -1
        self.forming = False
        if self.flat is None:
            return
        if self.lent:  # the local gradients hold its storage now: drop ours, the next window makes a new one
            self.flat = None
            self.viewed = False
            for m in self.members:
                m.view = None
            self.gap_views = []
        else:
            free_storage(self.flat)
