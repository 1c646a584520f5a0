"""The rules of :mod:`shardplan.flow`'s check, one family of operations each: how a split dimension's mark
moves from an operation's inputs to its outputs (views, permutations, indexing, reductions, normalisations,
attention, matrix products, einsum, convolutions, losses, pads, splits, joins, repeats, elementwise), and which
operations are refused because they mix it. ``Mark``, the operation tables and ``_Call`` are in
``flow_marks.py``; contractions and attention in ``flow_products.py``; indexing and head splits in
``flow_index.py``. The mode that calls :func:`rule` for each marked argument (and the messages) is ``flow.py``'s
``FlowCheck``, passed in as ``chk`` (its ``mark``, ``refuse``, ``rowwise``, ``stack`` and ``through_attention``)."""

from __future__ import annotations

import torch

from .flow_index import _heads_check, _index
from .flow_marks import (_ALONG, _ALONG_DEFAULT, _BEFORE, _CARRY, _JOIN, _LOSS, _MATMUL, _NORM, _PERMUTE,  # noqa: F401
                         _REDUCE, _SPLIT, _TOKEN_REDUCE, ATTENTION_FIX, SEQUENCE, SHIFT_FIX, Mark, _Call, _dim,
                         regrouped, reshaped)
from .flow_products import _contract, _multi_head_attention
from .flow_tokens import COUNT


def rule(chk, name: str, args, kwargs, out, marked) -> None:
    """Where the mark of ``marked[0]`` (a (tensor, Mark) pair of this call's arguments) goes in ``out``, or
    ``chk.refuse`` when the operation mixes it. The families are tried in this order (a name in two tables
    takes the first); an operation none of them knows is elementwise."""
    c = _Call(chk, name, args, kwargs, out, marked)
    if name in ("unsqueeze", "squeeze"):
        return _squeeze(c)
    if name in _CARRY:
        return _carry(c)
    if name in _PERMUTE:
        return _permute(c)
    if name == "__getitem__":
        return _index(chk, args[1], c.x, c.m, c.outs)
    if name in _ALONG or name == "msort":
        return _along(c)
    if name in _REDUCE and not (name in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor)):
        return _reduce(c)
    if name in _NORM:
        return _norm(c)
    if name == "multi_head_attention_forward":  # nn.MultiheadAttention: [seq, batch, embed] (or unbatched)
        return _multi_head_attention(c)
    if name in _MATMUL or name in ("linear", "einsum", "scaled_dot_product_attention", "bilinear"):
        return _contract(chk, name, args, kwargs, c.outs, marked)
    if name.startswith("conv") or "pool" in name or name in ("interpolate", "upsample"):
        return _conv(c)
    if name in ("embedding", "one_hot", "embedding_bag"):
        return _embedding(c)
    if name in _LOSS:
        return _loss(c)
    if name in COUNT:
        return _count(c)
    if name == "pad":
        return _pad(c)
    if name in _SPLIT:
        return _split(c)
    if name in _JOIN:
        return _join(c)
    if name in ("expand", "expand_as", "broadcast_to", "repeat", "tile", "repeat_interleave"):
        return _repeat(c)
    return _elementwise(c)


def _squeeze(c: _Call) -> None:
    x, m = c.x, c.m
    for o in c.outs:
        if c.name == "unsqueeze":
            k = _dim(int(c.dim_arg(1)), o.ndim)
            c.carry(o, m.dim + (k <= m.dim))
        else:
            d = c.dim_arg(1)
            gone = [i for i in (c.dims_of(d, x.ndim) if d is not None else range(x.ndim)) if x.shape[i] == 1]
            c.carry(o, None if m.dim in gone else m.dim - sum(1 for i in gone if i < m.dim))


def _carry(c: _Call) -> None:
    for o in c.outs:
        if c.name in ("view", "reshape") and not c.seq:
            _heads_check(c.chk, c.args, c.m, c.x, o)
        if c.seq:
            c.chk.mark(o, regrouped(c.m, tuple(c.x.shape), tuple(o.shape)))
        else:
            c.carry(o, reshaped(c.m.dim, tuple(c.x.shape), tuple(o.shape)))


def _permute(c: _Call) -> None:
    name, args, kwargs = c.name, c.args, c.kwargs
    nd = c.x.ndim
    if name == "t":
        perm = [1, 0] if nd == 2 else list(range(nd))
    elif name in ("transpose", "swapaxes", "swapdims"):
        a, b = _dim(args[1], nd), _dim(args[2], nd)
        perm = list(range(nd))
        perm[a], perm[b] = perm[b], perm[a]
    elif name == "permute":
        perm = [_dim(int(i), nd) for i in (args[1] if len(args) == 2 and isinstance(args[1], (tuple, list))
                                           else args[1:] or kwargs.get("dims"))]
    else:
        src, dst = c.dims_of(args[1], nd), c.dims_of(args[2], nd)
        rest = [i for i in range(nd) if i not in src]
        perm = [None] * nd
        for s, d in zip(src, dst):
            perm[d] = s
        it = iter(rest)
        perm = [p if p is not None else next(it) for p in perm]
    for o in c.outs:
        c.carry(o, perm.index(c.m.dim))


def _along(c: _Call) -> None:
    name, args, x, m, seq = c.name, c.args, c.x, c.m, c.seq
    d = c.dim_arg(_ALONG.get(name, 1), _ALONG_DEFAULT.get(name))
    if name == "roll" and d is None or name == "flip" and d is None or m.dim in c.dims_of(d, x.ndim):
        if name in ("narrow",) and len(args) > 3 and args[2] == 0 and args[3] == x.shape[m.dim]:
            pass
        else:
            c.refuse("is mixed along its split dimension", f"{name}",
                     ATTENTION_FIX if name in ("softmax", "log_softmax", "_softmax", "softmin") and seq
                     else SHIFT_FIX if seq and name in ("roll", "narrow", "select", "diff") else "")
    e = m.dim - (name == "select" and _dim(c.dim_arg(1), x.ndim) < m.dim)
    for o in c.outs:
        if o.ndim > e and o.shape[e] == x.shape[m.dim]:
            c.carry(o, e)


def _reduce(c: _Call) -> None:
    name, args, kwargs, x, m = c.name, c.args, c.kwargs, c.x, c.m
    d = c.dim_arg(1)
    if name in ("norm", "linalg_vector_norm", "vector_norm", "quantile", "nanquantile") and "dim" not in kwargs:
        d = args[2] if len(args) > 2 else None
    if d is not None and not isinstance(d, (int, tuple, list, torch.Size)):
        d = None
    over = c.dims_of(d, x.ndim)
    if m.dim in over:
        if not (c.seq and name in _TOKEN_REDUCE):
            c.refuse("is reduced over its split dimension", name)
        for o in c.outs:  # this rank's part of the whole sequence's (flow_tokens.py: partial means)
            c.chk.mark_partial(o, m)
        return
    keep = kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
    e = m.dim if keep else m.dim - sum(1 for i in over if i < m.dim)
    for o in c.outs:
        if o.ndim > e and o.shape[e] == x.shape[m.dim]:
            c.carry(o, e)


def _norm(c: _Call) -> None:
    name, args, kwargs, x, m = c.name, c.args, c.kwargs, c.x, c.m
    if name in ("layer_norm", "rms_norm"):
        shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
        over = list(range(x.ndim - len(shape), x.ndim))
    elif name == "normalize":
        over = c.dims_of(c.dim_arg(2, 1, ("dim",)), x.ndim)
    elif name == "batch_norm":
        over = [i for i in range(x.ndim) if i != 1]
    elif name == "instance_norm":
        over = list(range(2, x.ndim))
    else:
        over = list(range(1, x.ndim))
    if m.dim in over and x is args[0]:
        c.refuse("is normalised over its split dimension", name)
    for o in c.outs:
        c.carry(o, m.dim if o.shape == x.shape else None)



def _conv(c: _Call) -> None:
    name, x, m = c.name, c.x, c.m
    if x is c.args[0] and m.dim >= 1 and not (name.startswith("conv") and m.dim == 1 and c.seq):
        c.refuse("is convolved or pooled along its split dimension", name)
    for o in c.outs:
        c.carry(o, m.dim if m.dim == 0 else None)


def _embedding(c: _Call) -> None:
    if c.x.dtype in (torch.long, torch.int, torch.int16, torch.int8, torch.uint8):
        for o in c.outs:
            c.carry(o, c.m.dim)


def _loss(c: _Call) -> None:
    name, x, m = c.name, c.x, c.m
    cls = 1 if x.ndim >= 2 and name in ("cross_entropy", "nll_loss") else None
    red = c.kwargs.get("reduction", "mean")
    if not c.seq or m.dim == cls:
        c.refuse("is reduced over its split dimension", name)
    for o in c.outs:
        if red == "none":
            c.carry(o, m.dim - (cls is not None and cls < m.dim))
        else:  # this rank's mean (or sum) over its tokens (flow_tokens.py: partial means)
            c.chk.mark_partial(o, m)


def _count(c: _Call) -> None:
    """``histc`` / ``bincount``: counts over every element, a sum over the split dimension."""
    if not c.seq:
        c.refuse("is counted over its split dimension", c.name)
    for o in c.outs:
        c.chk.mark_partial(o, c.m)


def _pad(c: _Call) -> None:
    x, m = c.x, c.m
    pad = c.args[1] if len(c.args) > 1 else c.kwargs.get("pad")
    for i in range(0, len(pad), 2):
        d = x.ndim - 1 - i // 2
        if d == m.dim and (pad[i] or pad[i + 1]):
            c.refuse("is padded along its split dimension (a shift?)", "pad", SHIFT_FIX if c.seq else "")
    for o in c.outs:
        c.carry(o, m.dim)


def _split(c: _Call) -> None:
    name, m = c.name, c.m
    d = _dim(c.dim_arg(_SPLIT[name], 0, ("dim",)), c.x.ndim)
    if d == m.dim and len(c.outs) > 1:
        c.refuse("is split into pieces along its split dimension", name)
    for o in c.outs:
        c.carry(o, m.dim - (name == "unbind" and d < m.dim))


def _join(c: _Call) -> None:
    name, x, m = c.name, c.x, c.m
    tensors = c.args[0] if c.args else c.kwargs.get("tensors")
    d = c.dim_arg(1, 0)
    ref = x
    if name == "stack":
        e = m.dim + (_dim(d, ref.ndim + 1) <= m.dim)
    else:
        if _dim(d, ref.ndim) == m.dim and any(t is not x and t.numel() for t in tensors):
            c.refuse("is concatenated along its split dimension", name)  # (an empty cache's cat: no)
        e = m.dim
    for o in c.outs:
        c.carry(o, e)


def _repeat(c: _Call) -> None:
    name, x, m = c.name, c.x, c.m
    for o in c.outs:
        e = m.dim + (o.ndim - x.ndim)
        if name == "repeat_interleave":
            d = c.dim_arg(2, None, ("dim",))
            if d is not None and _dim(d, x.ndim) == m.dim and c.seq:
                c.refuse("is repeated along its split dimension", name)
            c.carry(o, m.dim if d is not None else None)
        elif o.shape[e] != x.shape[m.dim]:
            c.refuse("is repeated along its split dimension", name)
        else:
            c.carry(o, e)


def _elementwise(c: _Call) -> None:
    """Elementwise (and unknown operations): the mark follows broadcasting, when the shapes say so."""
    for o in c.outs:
        for t, mm in c.marked:
            e = mm.dim + (o.ndim - t.ndim)
            if 0 <= e < o.ndim and o.shape[e] == t.shape[mm.dim]:
                c.carry(o, e, mm)
                break


