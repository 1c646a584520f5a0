"""The rules of :mod:`shardplan.flow`'s check for indexing and head splits: ``x[...]`` (slicing or indexing a
split dimension refused: a shift of the labels under cp, a slice of a column-parallel output's features under tp)
and ``view(b, t, heads, -1)`` of a column-parallel output (every head spread over the ranks)."""

from __future__ import annotations

import math

import torch

from .flow_marks import HEADS_FIX, SEQUENCE, SHIFT_FIX, Mark, reshaped


def _heads_check(chk, args, m: Mark, x, o) -> None:
    """``view(b, t, heads, -1)`` of a column-parallel output: the head count fixed, the width inferred,
    so every head is spread over the ranks (``view(b, t, -1, head_dim)`` keeps whole heads on each); and
    ``view(b, t, heads, head_dim)``, every size given: the global head count, which fails on a rank's features."""
    shape = args[1:] if len(args) > 1 and not isinstance(args[1], (tuple, list, torch.Size)) else \
        (args[1] if len(args) > 1 else ())
    shape = list(shape)
    if len(shape) != o.ndim:
        return
    e = reshaped(m.dim, tuple(x.shape), tuple(o.shape))
    if -1 not in shape:  # every size given: the global ones, which the rank's 1/size of the features cannot fill
        if e is not None and o.shape[e] != x.shape[m.dim] and any(
                math.prod(o.shape[e:k]) == x.shape[m.dim] for k in range(e + 2, o.ndim + 1)):
            chk.refuse(m, f"is split into {o.shape[e]} heads with the global sizes {tuple(o.shape)} (each rank holds "
                       f"1/{m.size} of the features: the view fails there)", "view",
                       HEADS_FIX.format(axis=m.axis))
        return
    inferred = shape.index(-1)
    if e is not None and inferred > e and o.shape[e] != x.shape[m.dim] and \
            math.prod(o.shape[e:]) == math.prod(x.shape[m.dim:]):
        chk.refuse(m, f"is split into {o.shape[e]} groups of an inferred width", f"{tuple(shape)}: a fixed count "
                   f"before -1", "")


def _index(chk, idx, x, m: Mark, outs) -> None:
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(isinstance(i, torch.Tensor) or isinstance(i, (list,)) for i in idx):
        # advanced indexing: refused on the split dimension, elsewhere the mark is dropped
        pos = _positions(idx, x.ndim)
        if pos.get(m.dim) is not None and not (isinstance(pos[m.dim], slice) and pos[m.dim] == slice(None)):
            chk.refuse(m, "is indexed along its split dimension", "indexing", SHIFT_FIX if m.source == SEQUENCE else "")
        return
    pos = _positions(idx, x.ndim)
    entry = pos.get(m.dim, slice(None))
    if isinstance(entry, slice):
        n = x.shape[m.dim]
        full = entry.step in (None, 1) and entry.start in (None, 0) and (entry.stop is None or entry.stop >= n)
        if not full and tuple(range(n)[entry]) != tuple(range(n)):
            chk.refuse(m, "is sliced along its split dimension", "indexing",
                       SHIFT_FIX if m.source == SEQUENCE else "")
    else:
        chk.refuse(m, "is indexed along its split dimension", "indexing", SHIFT_FIX if m.source == SEQUENCE else "")
    # the output dimension: count the entries before the split one that keep or add a dimension
    e = 0
    d_in = 0
    for i in _expanded(idx, x.ndim):
        if i is None:
            e += 1
            continue
        if d_in == m.dim:
            break
        if isinstance(i, slice):
            e += 1
        d_in += 1
    for o in outs:
        if o.ndim > e and o.shape[e] == x.shape[m.dim]:
            chk.mark(o, m.at(e))


def _expanded(idx, ndim: int) -> list:
    used = sum(1 for i in idx if i is not None and i is not Ellipsis)
    out = []
    for i in idx:
        if i is Ellipsis:
            out += [slice(None)] * (ndim - used)
        else:
            out.append(i)
    real = sum(1 for i in out if i is not None)
    return out + [slice(None)] * (ndim - real)


def _positions(idx, ndim: int) -> dict:
    pos, d = {}, 0
    for i in _expanded(idx, ndim):
        if i is None:
            continue
        pos[d] = i
        d += 1
    return pos

