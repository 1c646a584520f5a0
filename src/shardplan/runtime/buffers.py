"""Per-rank storage of one planned buffer: the local shard, the full parameters, the gradients.

Which tensors exist and when they live follows the buffer's facts (``alias``, ``persistent``,
``grad_alias``, ``keeps_grads``), decided by the planner; :mod:`shardplan.planner.accounting` counts the
same tensors. Layouts (see :mod:`shardplan.layout`): ``contiguous`` and ``replicated`` buffers are used
in place (every full parameter is a view of the gathered buffer); ``interleaved`` buffers gather into a
packed tensor and copy out into parameter layout (and copy gradients back in before reducing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..dtypes import to_torch
from ..planner import BufferPlan, Plan, geometry as G
from ..planner.values import ParamPlan, Piece
from .buffer_grads import BufferGrads
from .dtensor_params import contiguous_strides, plain
from .quantize import dequantize_into, quantize_into
from .scales import Float8Scales, NonFiniteChecks
from .storage import alias, alloc_storage, free_storage


@dataclass(eq=False)
class Member:
    """One parameter of a buffer on this rank: its plan value, its piece (:class:`shardplan.planner.Piece`:
    which box of it this rank holds, where in the shard, where in the full parameters), and the tensors
    the runtime keeps over the buffer's storage."""

    info: ParamPlan
    piece: Piece
    copy_plan: tuple = ()           # interleaved buffers: (segment, storage box, numel) of every group member
    even: int = 0                   # ... and each segment's numel where they are equal row blocks in order (one copy)
    wrap: Optional[Callable] = None  # tensor parallelism: full tensor -> the DTensor its module computes with
    local: Optional[nn.Parameter] = None  # this rank's shard, a view of the flat shard
    full: Optional[nn.Parameter] = None   # the full parameter, over the gathered storage
    view: Optional[torch.Tensor] = None   # its part of the unsharded gradient
    dspec: Optional[tuple] = None         # dtensor_params: (DTensorSpec, local shape, strides); ``local`` is a DTensor

    def __post_init__(self):
        # [Note: read on every step: plain attributes, not properties over the frozen values]
        self.name, self.index = self.info.name, self.piece.index
        self.shard = slice(self.piece.shard_offset, self.piece.shard_offset + self.piece.numel)  # piece in the shard
        self.whole = slice(self.piece.full_offset, self.piece.full_offset + self.info.numel)  # in the full storage
        self.held = self.piece.numel  # elements of the piece (0: this rank holds none of it)


class BufferState(BufferGrads, Float8Scales, NonFiniteChecks):
    """Tensors of one buffer on this rank, and the moves between them. No collectives here. Its gradients are the
    mixin ``BufferGrads``' (runtime/buffer_grads.py); the scales of its low-precision gathers and their non-finite
    checks are the mixins' (runtime/scales.py)."""

    def __init__(self, plan: Plan, bp: BufferPlan, rank: int, device: torch.device):
        self.bp = bp
        self.dtype, self.cdtype, self.rdtype = to_torch(bp.dtype), to_torch(bp.compute_dtype), to_torch(bp.reduce_dtype)
        self.S, self.G = bp.shard_numel, bp.gathered_numel
        self.sharded, self.requires_grad = bp.sharded, bp.requires_grad
        self.device = device
        self.seg = G.segment(plan.mesh, bp, rank)
        group = self._group(plan) if bp.copy_out else ()
        self.members = [Member(plan.param(pc.param), pc, self._copy_plan(plan, pc.param, group))
                        for pc in plan.buffer_pieces(bp.index, rank)]
        for m in self.members:  # (decided once: the copies run at every gather and reduction)
            m.even = self._even(m.copy_plan, tuple(m.info.shape), bp.group_size)
        # full: the full parameters' storage, in parameter layout (interleaved: packed elsewhere). [Note: FP8
        # compute's tensorwise gather] (bp.tensorwise) gathers float8 codes (as uint8) straight into it; the full
        # parameters are torchao float8 tensors over it, with one scale each (``scales``), never dequantized
        self.tw = bp.tensorwise
        sdtype = torch.uint8 if self.tw else self.cdtype
        self.full = torch.zeros(bp.numel if bp.copy_out else self.G, dtype=sdtype, device=device)
        self.packed = torch.zeros(self.G, dtype=sdtype, device=device) if bp.copy_out else None
        if bp.alias:
            self.shard = self.full[self.seg * self.S:(self.seg + 1) * self.S] if self.sharded else self.full
        else:
            self.shard = torch.zeros(self.S, dtype=self.dtype, device=device)
        # the unsharded gradient: in the compute dtype, or the reduce dtype ([Note: gradients land in the reduce
        # dtype], planner/values.py)
        self.fdtype = self.rdtype if bp.lands_in_reduce_dtype else self.cdtype
        self.flat: Optional[torch.Tensor] = None
        self.flat_window = -1
        self.lent = False  # the local shards' gradients are views of ``flat``
        self.grad_owner = None  # shard()'s executor: local gradients are its norms.ShardGrad views (torch's norms)
        self.forming = False  # the unit's backward started: autograd is forming the gradients that will land
        self.gappy = bp.grad_numel != sum(m.info.numel for m in self.members)  # padding between parameters
        # [Note: landing in one call] when the members tile the flat gradient in order (no padding between
        # them), a full landing is one ``_chunk_cat`` into it: no per-parameter views to make (they are made
        # only for the paths that need them, see ``_views``)
        ends = [(m.whole.start, m.whole.stop) for m in self.members]
        self.tiled = bool(ends) and not self.gappy and ends[0][0] == 0 and ends[-1][1] == bp.grad_numel and \
            all(a[1] == b[0] for a, b in zip(ends, ends[1:])) and \
            all(len(m.info.shape) and m.info.numel for m in self.members)  # _chunk_cat wants a non-empty dim 0:
        # a 0-d gradient crashes it (torch 2.13: one alone segfaults, several raise) and a zero-size one raises,
        # so a buffer holding a scalar (a learnt temperature) or an empty parameter lands per view
        self.viewed = False  # the members' ``view`` (and ``gap_views``) are over the current ``flat``
        self.gap_views: list = []
        if self.packed is not None:
            free_storage(self.packed)
        # [Note: a quantized gather] (bp.gather_dtype) gathers codes and scales into ``wire`` (uint8), which
        # ``finish_gather`` dequantizes into the full (or packed) buffer; ``plan`` names a parameter on error
        self.qfmt = "" if self.tw else bp.gather_dtype
        self.wire: Optional[torch.Tensor] = None
        self.plan = plan if bp.gather_dtype else None
        self.scales = torch.ones(len(self.members), dtype=torch.float32, device=device) if self.tw else None
        self.defer_check = device.type != "cpu"  # see [Note: the non-finite check without a host sync]
        self.pending_check = None
        self.pending_tw = None  # the same for a tensorwise (float8 compute) gather's absmax
        self.scaled = False     # the scales were all-reduced for the next gather (its ``all_reduce scales`` op)
        # (fixed per buffer: the members this rank holds a piece of, and whether padding sends zero codes)
        self.held_idx = [i for i, m in enumerate(self.members) if m.held]
        self.padded = sum(m.held for m in self.members) != self.S

    def _group(self, plan: Plan) -> tuple[int, ...]:
        """The ranks of one shard group, in segment order (the copy-out reads their segments)."""
        first = plan.mesh.rank_of([0] * len(plan.mesh.axis_names))
        return plan.mesh.group_of(first, self.bp.axes) if self.bp.axes else (first,)

    @staticmethod
    def _copy_plan(plan: Plan, name: str, group: tuple[int, ...]) -> tuple:
        out = []
        for seg, r in enumerate(group):
            pc = plan.piece(name, r)
            if pc.storage_box is not None:
                out.append((seg, pc.storage_box, math.prod(s.stop - s.start for s in pc.storage_box)))
        return tuple(out)

    # [Note: one copy per parameter when its pieces are equal row blocks] An interleaved buffer's gathered
    # storage is ``[group, S]``: segment k holds rank k's piece of every parameter at the parameter's offset.
    # Where every rank holds an equal block of whole rows, in rank order (dim 0 divisible by the group: the
    # common case), the full parameter viewed as ``[group, rows/group * rest]`` *is* the column block
    # ``[:, offset:offset + n]`` of the gathered storage, so the copy-out (and the gradient's copy-in) is one
    # strided copy, not one per rank: at 64 ranks a 1B GPT's step spent 3/4 of its time launching them.
    @staticmethod
    def _even(copy_plan: tuple, shape: tuple, group: int) -> int:
        """``n`` when segment k of ``copy_plan`` holds rows ``[k*r, (k+1)*r)`` of a ``shape`` parameter (whole
        rows, every k in order), else 0."""
        if len(copy_plan) != group or not shape or shape[0] % group:
            return 0
        r = shape[0] // group
        for k, (seg, box, n) in enumerate(copy_plan):
            if seg != k or box[0].start != k * r or box[0].stop != (k + 1) * r or \
                    any(b.start != 0 or b.stop != d for b, d in zip(box[1:], shape[1:])):
                return 0
        return copy_plan[0][2]

    # -- construction ---------------------------------------------------------------------------
    def fill_local(self, originals: list[Optional[torch.Tensor]]) -> None:
        """Copy this rank's pieces of the full parameters into the shard."""
        with torch.no_grad():
            for m, t in zip(self.members, originals):
                if m.piece.storage_box is None or t is None:
                    continue
                self.shard[m.shard].copy_(t[m.piece.storage_box].reshape(-1))

    def make_params(self, wraps: Optional[list] = None, float8: Optional[Callable] = None) -> None:
        """The local shards and the full parameters; ``wraps[i]`` (tensor parallelism) turns parameter i's
        full tensor into the DTensor its module computes with, over the same storage. A tensorwise buffer's
        full parameters come from ``float8(name, codes, scale, dtype, requires_grad)`` (:mod:`shardplan.fp8`):
        torchao float8 tensors over the gathered codes, the scale a view of ``scales``."""
        for i, m in enumerate(self.members):
            if wraps is not None:
                m.wrap = wraps[i]
            m.local = nn.Parameter(self.shard[m.shard].view(m.piece.shape), requires_grad=m.info.requires_grad)
            if self.tw:
                codes = alias(self.full, m.piece.full_offset, m.info.shape).view(torch.float8_e4m3fn)
                m.full = float8(m.name, codes, self.scales[i], self.cdtype, m.info.requires_grad)
            else:
                m.full = nn.Parameter(self._wrap(m, alias(self.full, m.piece.full_offset, m.info.shape)),
                                      requires_grad=m.info.requires_grad)
            m.lshape, m.lstride = tuple(m.piece.shape), contiguous_strides(m.piece.shape)
            m.fshape, m.fstride = tuple(m.info.shape), contiguous_strides(m.info.shape)
        if not self.bp.persistent:
            free_storage(self.full)

    # -- full parameters --------------------------------------------------------------------------
    def gather_output(self) -> torch.Tensor:
        """Allocate what the all-gather writes into (the full buffer, or the packed one) and return it."""
        if not self.bp.persistent:
            alloc_storage(self.full)
        if self.packed is not None:
            alloc_storage(self.packed)
        if self.qfmt:
            self.wire = torch.empty(self.bp.gather_bytes, dtype=torch.uint8, device=self.device)
            return self.wire
        return self.packed if self.packed is not None else self.full

    def gather_input(self, collective: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The shard as the all-gather sends it: cast to the compute dtype, or a copy when it is part of
        the output (in-place gathers are not portable across backends). A gather that moves nothing
        (``collective`` False) writes the shard straight into ``out``, casting in the same copy. A quantized
        gather sends the master shard's codes and scales (quantized in fp32); a tensorwise one its float8 codes."""
        if self.tw:
            send = out if not collective and out is not None else \
                torch.empty(self.S, dtype=torch.uint8, device=self.device)
            self._quantize_tw(send)
            return send
        if self.qfmt:
            send = out if not collective and out is not None else \
                torch.empty(self.bp.wire_shard_bytes, dtype=torch.uint8, device=self.device)
            with torch.no_grad():
                quantize_into(self.shard, self.qfmt, send)
            return send
        if not collective and out is not None:
            if out.data_ptr() != self.shard.data_ptr() or out.dtype != self.shard.dtype:
                # (neither tensor requires grad: the copy records nothing, no no_grad context needed)
                (out if out.numel() == self.S else out[:self.S]).copy_(self.shard)
            return out
        if self.cdtype != self.dtype:
            return self.shard.to(self.cdtype)
        return self.shard.clone() if collective and self.bp.alias else self.shard

    def finish_gather(self) -> None:
        """After the all-gather completed: dequantize a quantized gather, copy interleaved pieces out into
        parameter layout."""
        if self.wire is not None:
            self._dequantize()
        if self.packed is None:
            return
        packed = self.packed.view(self.bp.group_size, self.S) if self.sharded else self.packed.view(1, -1)
        with torch.no_grad():
            for m in self.members:
                p, off = m.info, m.piece.full_offset
                target = self.full[off:off + p.numel].view(p.shape)
                n = m.even if self.sharded else 0
                if n:
                    target.view(self.bp.group_size, n).copy_(packed[:, p.offset:p.offset + n])
                    continue
                for seg, box, n in m.copy_plan:
                    target[box].copy_(packed[seg, p.offset:p.offset + n].view([s.stop - s.start for s in box]))
        free_storage(self.packed)

    def _dequantize(self) -> None:
        segments = self.bp.group_size if self.sharded else 1
        self._check_blocks(segments)
        with torch.no_grad():
            dequantize_into(self.wire, self.qfmt, self.S, segments,
                            self.packed if self.packed is not None else self.full)
        self.wire = None

    def release_full(self) -> None:
        if not self.bp.persistent:
            free_storage(self.full)
        if self.packed is not None:
            free_storage(self.packed)

    @staticmethod
    def _wrap(m: Member, t: torch.Tensor) -> torch.Tensor:
        return m.wrap(t) if m.wrap is not None else t

    def local_grad_by_index(self) -> dict[int, nn.Parameter]:
        return {m.index: m.local for m in self.members}

    def tensors(self) -> list[Optional[torch.Tensor]]:
        """Every tensor this buffer holds now (for the runtime's memory accounting)."""
        return [self.shard, self.full, self.packed, self.flat, self.wire] + [plain(m.local.grad) for m in self.members]
