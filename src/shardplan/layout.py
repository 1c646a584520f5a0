"""Per-rank flat buffer layouts: where each parameter's shard lives in its unit's buffer.

Pure arithmetic over shapes; no tensors. Two placements exist:

* ``contiguous``: the parameter occupies one range of the *gathered* buffer and rank boundaries
  (multiples of the shard size ``S``) fall on its row boundaries, so each rank owns whole rows and,
  after the all-gather, the parameter is a plain view of the buffer (zero copy-out). Used for specs
  that shard dim 0 only, when the padding this costs is small.
* ``interleaved``: every rank's segment holds that rank's chunk of the parameter at the same offset
  (``torch.chunk`` semantics per sharded dimension, as FSDP2 and DTensor do). Works for any spec;
  the gathered parameter needs a copy-out, which the plan counts.

``replicated`` buffers hold parameters sharded over no axis: every rank holds all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

CONTIGUOUS, INTERLEAVED, REPLICATED = "contiguous", "interleaved", "replicated"
ALIGN_BYTES = 128  # segment and chunk alignment: vectorised casts and NCCL like 128-byte boundaries


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def align_elems(*itemsizes: int) -> int:
    return max(1, ALIGN_BYTES // max(1, min(itemsizes)))


@dataclass(frozen=True)
class Placement:
    """Result of laying out one buffer: segment size and one offset per parameter."""

    layout: str
    shard_numel: int  # S: elements per rank segment (replicated: the whole buffer)
    offsets: tuple[int, ...]


# -- contiguous ---------------------------------------------------------------------------------

def _greedy(items: Sequence[tuple[int, int]], S: int, A: int) -> tuple[Optional[tuple[int, ...]], int, int]:
    """Place (numel, row) items in order; return (offsets, end, 0) or (None, 0, row that failed)."""
    c, offs = 0, []
    for n, r in items:
        c = round_up(c, A) if r % A == 0 or n <= S else c
        seg_end = (c // S + 1) * S
        if n == 0 or c + n <= seg_end:
            o = c
        else:
            o = c + (seg_end - c) % r  # first start >= c at which seg_end is a row boundary
            if o + n > seg_end + S and S % r:
                # crosses two or more boundaries but S is no multiple of the row: start on a
                # boundary if it fits in one segment, else this S cannot work
                if n > S:
                    return None, 0, r
                o = seg_end
        offs.append(o)
        c = o + n
    return tuple(offs), c, 0


@lru_cache(maxsize=4096)
def place_contiguous(items: tuple[tuple[int, int], ...], W: int, A: int) -> Optional[Placement]:
    """Smallest segment size S (multiple of A) at which items fit with rows never straddling ranks."""
    total = sum(n for n, _ in items)
    if total == 0:
        return Placement(CONTIGUOUS, A, tuple(0 for _ in items))
    L = A
    for n, r in items:
        if n > 2 * round_up(-(-total // W), A):
            L = math.lcm(L, r)
    S = round_up(round_up(-(-total // W), A), L)
    for _ in range(256):
        if W * S > 2 * total + W * A * len(items):
            return None  # padding would exceed the data: not worth it
        offs, end, bad = _greedy(items, S, A)
        if offs is None:
            L = math.lcm(L, bad)
            S = round_up(S, L)
        elif end > W * S:
            S = round_up(max(S + L, -(-end // W)), L)
        else:
            return Placement(CONTIGUOUS, S, offs)
    return None


# -- interleaved --------------------------------------------------------------------------------

def chunk_shape(shape: Sequence[int], parts: Sequence[int]) -> tuple[int, ...]:
    """Shape of the largest chunk when dim d is split in parts[d] (``torch.chunk`` sizes)."""
    return tuple(-(-d // p) if p > 1 else d for d, p in zip(shape, parts))


def place_interleaved(chunk_numels: Sequence[int], A: int) -> Placement:
    offs, c = [], 0
    for n in chunk_numels:
        offs.append(c)
        c = round_up(c + n, A)
    return Placement(INTERLEAVED, max(round_up(c, A), A), tuple(offs))


def place_replicated(numels: Sequence[int], A: int) -> Placement:
    offs, c = [], 0
    for n in numels:
        c = round_up(c, A)
        offs.append(c)
        c += n
    return Placement(REPLICATED, max(c, 1), tuple(offs))


# -- per-rank boxes -----------------------------------------------------------------------------

def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk ``index`` when ``size`` is split in ``parts`` ``torch.chunk`` chunks."""
    c = -(-size // parts) if parts > 0 else size
    start = min(index * c, size)
    return start, min(start + c, size)


def contiguous_rows(offset: int, numel: int, row: int, S: int, segment: int) -> tuple[int, int]:
    """Rows [r0, r1) of a contiguously placed parameter held in ``segment``."""
    lo, hi = max(offset, segment * S), min(offset + numel, (segment + 1) * S)
    if hi <= lo or row == 0:
        return 0, 0
    return (lo - offset) // row, (hi - offset) // row
