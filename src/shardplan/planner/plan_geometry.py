"""Per-rank geometry of a :class:`~shardplan.planner.facade.Plan`: each rank's piece of each parameter (computed
lazily by :mod:`~shardplan.planner.geometry`, the last :data:`PIECE_CACHE_RANKS` ranks' cached), and the boxes,
shapes, offsets and owners read from them. A mixin of ``Plan``, over its fields.
"""

from __future__ import annotations

import operator
from functools import cached_property
from typing import Optional

from ..errors import PlanError
from . import geometry
from .values import BufferPlan, Piece

PIECE_CACHE_RANKS = 64  # ranks whose pieces a plan keeps (a 70B plan at dp=1024 holds ~700 pieces per rank)


class PlanGeometry:
    """``Plan``'s pieces per rank: ``pieces``, ``piece``, ``local_slices``, ``owner_axes``, ``replicas``, ..."""

    # -- per-rank geometry: pieces -------------------------------------------------------------------
    @cached_property
    def full_offsets(self) -> tuple[int, ...]:
        """Per parameter (``plan.params`` order) where it starts in its buffer's full parameters (parameter
        layout: packed back to back for copy-out buffers, in place otherwise)."""
        return geometry.full_offsets(self.params, self.buffers)

    @cached_property
    def _piece_cache(self) -> dict[int, tuple[Piece, ...]]:
        return {}

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """Every parameter's piece on ``rank``, in ``plan.params`` order; computed on first use and cached
        (for the last :data:`PIECE_CACHE_RANKS` ranks asked).

        >>> [p.box for p in plan.pieces(rank=1)]
        """
        rank = self._check_rank(rank)
        cache = self._piece_cache
        out = cache.get(rank)
        if out is None:
            out = cache[rank] = geometry.pieces(self.mesh, self.params, self.buffers, self.full_offsets, rank)
            if len(cache) > PIECE_CACHE_RANKS:  # [Note: dicts keep insertion order: the oldest rank goes first]
                cache.pop(next(iter(cache)), None)
        return out

    def piece(self, name: str, rank: int) -> Piece:
        """``rank``'s piece of parameter ``name``: its global box, its box in the tensor-parallel-local tensor,
        its offset in the rank's shard and in the gathered parameters, its shape.

        >>> plan.piece("layers.0.w", rank=1).box      # e.g. (slice(64, 128), slice(0, 256))
        """
        i = self.index(name)
        rank = self._check_rank(rank)
        cached = self._piece_cache.get(rank)
        if cached is not None:
            return cached[i]
        # [Note: one piece is O(dims); computing the rank's whole tuple for it would make per-name loops
        # over many ranks (checkpoints, copy plans) cost O(params x ranks) in memory]
        p = self.params[i]
        return geometry.piece(self.mesh, p, index=i, b=self.buffers[p.buffer], rank=rank, full_offset=self.full_offsets[i])

    def buffer_pieces(self, buffer: int, rank: int) -> tuple[Piece, ...]:
        """``rank``'s pieces of the parameters of ``plan.buffers[buffer]``, in the buffer's order (``bp.params``)."""
        return tuple(self.piece(n, rank) for n in self.buffers[buffer].params)

    def _check_rank(self, rank: int) -> int:
        try:
            r = operator.index(rank)
        except TypeError:
            r = -1
        if not 0 <= r < self.mesh.size:
            raise PlanError(f"rank {rank!r} is not a rank of {self.mesh!r} (0..{self.mesh.size - 1})")
        return r

    def segment(self, buffer: BufferPlan, rank: int) -> int:
        """Index of ``rank``'s segment in ``buffer``'s gathered layout (its rank in the shard group)."""
        return geometry.segment(self.mesh, buffer, rank)

    def local_slices(self, name: str, rank: int) -> Optional[tuple[slice, ...]]:
        """Global index box of parameter ``name`` that ``rank`` owns (``None`` if it owns nothing).

        >>> plan.local_slices("layers.0.w", rank=1)     # e.g. (slice(64, 128), slice(0, 256))

        Under ``optim``/``optim_grads`` this is the shard whose optimizer state the rank owns; under
        ``no_shard`` every rank owns the whole tensor.
        """
        return self.piece(name, rank).box

    def local_shape(self, name: str, rank: int) -> tuple[int, ...]:
        return self.piece(name, rank).shape

    def storage_slices(self, name: str, rank: int) -> Optional[tuple[slice, ...]]:
        """The box of ``rank``'s shard inside the tensor-parallel-local tensor it computes with (equal
        to :meth:`local_slices` where no compute axis shards ``name``)."""
        return self.piece(name, rank).storage_box

    def local_offset(self, name: str, rank: int) -> int:
        """Offset of ``rank``'s piece of ``name`` inside its own shard of the buffer (elements)."""
        return self.piece(name, rank).shard_offset

    def owner_axes(self, name: str) -> tuple[str, ...]:
        """Mesh axes along which ranks hold different pieces of ``name`` (storage and compute), mesh order."""
        p = self.param(name)
        b = self.buffers[p.buffer]
        axes = set(b.axes if b.sharded else ()) | ({p.tp_axis} if p.tp_axis else set())
        return tuple(a for a in self.mesh.axis_names if a in axes)

    def replicas(self, name: str) -> int:
        """How many ranks hold each element of ``name`` (copies over the axes that do not shard it)."""
        return self.mesh.size // self.mesh.axis_size(self.owner_axes(name))
