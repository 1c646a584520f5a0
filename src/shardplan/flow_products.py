"""The rules of :mod:`shardplan.flow`'s check for contractions: matrix products, ``linear`` (a row-parallel
module's own contraction allowed), einsum, ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention``
(attention whose keys are this rank's chunks refused under cp, unless through ``sp.context_parallel.attention``)."""

from __future__ import annotations

from .flow_marks import ATTENTION_FIX, SEQUENCE, _Call



def _multi_head_attention(c: _Call) -> None:
    name, args, kwargs, x, m = c.name, c.args, c.kwargs, c.x, c.m
    key = args[1] if len(args) > 1 else kwargs.get("key")
    if x is key or x is (args[2] if len(args) > 2 else kwargs.get("value")):
        if m.dim == 0:
            c.refuse("holds the keys and values attended over", name, ATTENTION_FIX if c.seq else "")
        if m.dim == x.ndim - 1:
            c.refuse("is contracted (the embedding)", name)
    elif x is args[0] and m.dim == x.ndim - 1:
        c.refuse("is contracted (the embedding)", name)
    o = c.outs[0] if c.outs else None
    if o is not None and x is args[0] and m.dim < x.ndim - 1:
        c.carry(o, m.dim)



def _contract(chk, name, args, kwargs, outs, marked) -> None:
    if name == "scaled_dot_product_attention":
        q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")][len(args):])[:3]
        o = outs[0] if outs else None
        for t, m in marked:
            if t is q:
                if m.dim == q.ndim - 1:
                    chk.refuse(m, "is contracted (queries' head width)", "scaled_dot_product_attention")
                if o is not None:
                    chk.mark(o, m.at(m.dim + o.ndim - q.ndim))
            elif t is k or t is v:
                if m.dim == t.ndim - 2:
                    if m.source == SEQUENCE and chk.through_attention():
                        continue
                    chk.refuse(m, "holds the keys and values attended over", "scaled_dot_product_attention",
                               ATTENTION_FIX if m.source == SEQUENCE else "")
                if m.dim == t.ndim - 1 and t is k:
                    chk.refuse(m, "is contracted (keys' head width)", "scaled_dot_product_attention")
                if o is not None and m.dim < t.ndim - 2:
                    chk.mark(o, m.at(m.dim + o.ndim - t.ndim))
        return
    if name == "linear" or name == "bilinear":
        x = args[0] if args else kwargs.get("input")
        for t, m in marked:
            if t is x and m.dim == x.ndim - 1:
                inside = chk.rowwise.get(chk.stack[-1]) if chk.stack else None
                if m.source != SEQUENCE and inside == m.axis:
                    return  # a row-parallel module: its partial sums are all-reduced (the plan's own op)
                chk.refuse(m, "is contracted by a linear layer that is not its row-parallel sibling", name)
            if t is x:
                for o in outs:
                    chk.mark(o, m.at(m.dim))
        return
    if name == "einsum":
        return _einsum(chk, args, outs, marked)
    pairs = {"addmm": (1, 2), "baddbmm": (1, 2), "addbmm": (1, 2), "addmv": (1, 2)}
    ia, ib = pairs.get(name, (0, 1))
    a, b = args[ia], args[ib]
    o = outs[0] if outs else None
    for t, m in marked:
        if t is a:
            if m.dim == a.ndim - 1:
                chk.refuse(m, "is contracted by a matrix product", name,
                           ATTENTION_FIX if m.source == SEQUENCE else "")
            if o is not None and b.ndim >= 2:
                chk.mark(o, m.at(m.dim + o.ndim - a.ndim))
            elif o is not None:
                chk.mark(o, m.at(m.dim + o.ndim - (a.ndim - 1)))
        elif t is b:
            if b.ndim == 1 or m.dim == b.ndim - 2:
                chk.refuse(m, "is contracted by a matrix product", name,
                           ATTENTION_FIX if m.source == SEQUENCE else "")
            if o is not None:
                chk.mark(o, m.at(o.ndim - 1 if m.dim == b.ndim - 1 else m.dim + o.ndim - b.ndim))


def _einsum(chk, args, outs, marked) -> None:
    eq = args[0].replace(" ", "")
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    most = max((t.ndim - (len(s) - 3) if "..." in s else 0) for s, t in zip(terms, ops))
    ell = [chr(ord("A") + i) for i in range(most)]

    def expand(s, nd):
        if "..." not in s:
            return list(s)
        n = nd - (len(s) - 3)
        head, tail = s.split("...")
        return list(head) + ell[most - n:] + list(tail)

    letters = [expand(s, t.ndim) for s, t in zip(terms, ops)]
    if "->" in eq:
        out_letters = expand(rhs, len(rhs.replace("...", "")) + most) if "..." in rhs else list(rhs)
    else:
        flat = [c for ls in letters for c in ls if c not in ell]
        out_letters = ell + sorted(c for c in set(flat) if flat.count(c) == 1)
    o = outs[0] if outs else None
    for t, m in marked:
        i = next((j for j, u in enumerate(ops) if u is t), None)
        if i is None:
            continue
        c = letters[i][m.dim]
        if c not in out_letters:
            chk.refuse(m, "is contracted by einsum", f"einsum({eq!r})",
                       ATTENTION_FIX if m.source == SEQUENCE else "")
        elif o is not None:
            chk.mark(o, m.at(out_letters.index(c)))
