"""Partition specs: which mesh axes shard which tensor dimension (JAX ``PartitionSpec`` semantics).

>>> P("dp", None) == P("dp")          # trailing Nones are implied
True
>>> P.parse("(replica shard) _")     # einops-style spelling of P(("replica", "shard"), None)
P(('replica', 'shard'))
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

from .errors import SpecError, did_you_mean

Entry = Union[None, str, tuple[str, ...]]


def _normalize_entry(e) -> Entry:
    if e is None:
        return None
    if isinstance(e, str):
        return e
    if isinstance(e, (tuple, list)):
        names = tuple(e)
        if not all(isinstance(n, str) for n in names):
            raise SpecError(f"spec entry {e!r}: a tuple entry must hold axis names (strings)")
        if len(names) == 0:
            return None
        return names[0] if len(names) == 1 else names
    raise SpecError(f"spec entry {e!r} must be None, an axis name or a tuple of axis names")


class P(tuple):
    """A partition spec: one entry per leading tensor dimension.

    An entry is ``None`` (not sharded), a mesh axis name, or a tuple of axis names (sharded over
    their product, major to minor). Mesh axes a spec does not name are replica axes.

    >>> P("dp")                 # dim 0 sharded over dp, the rest whole
    >>> P(None, ("dp", "tp"))   # dim 1 sharded over dp x tp
    >>> P()                     # replicated
    """

    __slots__ = ()

    def __new__(cls, *entries: Entry):
        norm = [_normalize_entry(e) for e in entries]
        while norm and norm[-1] is None:
            norm.pop()
        spec = super().__new__(cls, norm)
        seen: set[str] = set()
        for a in spec.axes:
            if a in seen:
                raise SpecError(f"spec {spec!r} uses mesh axis {a!r} twice; an axis may shard at most one dimension once")
            seen.add(a)
        return spec

    def __repr__(self) -> str:
        return "P(" + ", ".join(map(repr, self)) + ")"

    def __getnewargs__(self) -> tuple:  # pickle and copy rebuild P(*entries), not P(entries)
        return tuple(self)

    def __eq__(self, other) -> bool:  # P("dp") == P("dp", None) because both normalise alike
        return isinstance(other, P) and tuple.__eq__(self, other)

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(("P",) + tuple(self))

    def entry(self, dim: int) -> Entry:
        """Entry for ``dim`` (``None`` past the end)."""
        return self[dim] if dim < len(self) else None

    def dim_axes(self, dim: int) -> tuple[str, ...]:
        e = self.entry(dim)
        return () if e is None else ((e,) if isinstance(e, str) else e)

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec names, in order of appearance."""
        out: list[str] = []
        for i in range(len(self)):
            out.extend(self.dim_axes(i))
        return tuple(out)

    @property
    def sharded_dims(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self)) if self[i] is not None)

    # -- einops-style spelling -------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> "P":
        """Parse ``"(replica shard) _"`` with einops' own grammar; ``_`` or ``1`` means not sharded."""
        from einops import EinopsError
        from einops.parsing import ParsedExpression

        tokens = text.replace("(", " ( ").replace(")", " ) ").split()
        tokens = ["1" if t in ("_", "None") else t for t in tokens]
        try:
            expr = ParsedExpression(" ".join(tokens))
        except EinopsError as exc:
            raise SpecError(f"cannot parse spec {text!r}: {exc}. Write e.g. 'dp _' or '(replica shard) _'") from None
        if expr.has_ellipsis:
            raise SpecError(f"spec {text!r}: '...' is not allowed in a partition spec")
        return cls(*(tuple(group) if group else None for group in expr.composition))

    def to_einops(self) -> str:
        parts = []
        for e in self:
            parts.append("_" if e is None else e if isinstance(e, str) else "(" + " ".join(e) + ")")
        return " ".join(parts)

    def to_list(self) -> list:
        return [e if not isinstance(e, tuple) else list(e) for e in self]

    @classmethod
    def from_list(cls, entries: Iterable) -> "P":
        return cls(*(tuple(e) if isinstance(e, list) else e for e in entries))

    # -- validation ------------------------------------------------------------------------------
    def check(self, shape: tuple[int, ...], mesh_axes: Iterable[str], *, name: str, rule=None) -> None:
        """Raise :class:`SpecError` naming ``name``, its shape and ``rule`` if the spec does not fit."""
        if callable(rule):  # described only when there is an error to report
            rule = rule() if (len(self) > len(shape) or any(a not in tuple(mesh_axes) for a in self.axes)) else None
        where = f"parameter {name!r} (shape {tuple(shape)})" + (f", matched by rule {rule}" if rule else "")
        axes = tuple(mesh_axes)
        if len(self) > len(shape):
            raise SpecError(
                f"{where}: spec {self!r} has {len(self)} entries but the tensor has {len(shape)} dimensions; "
                f"shorten the spec (e.g. P() to replicate)")
        for a in self.axes:
            if a not in axes:
                raise SpecError(f"{where}: spec {self!r} names axis {a!r}{did_you_mean(a, axes)}, which the mesh lacks "
                                f"(mesh axes: {axes}); use one of {axes} or add the axis to the mesh")


def as_spec(value, *, where: str = "") -> P:
    """Accept a ``P``, an einops-style string, ``None`` (replicated) or a tuple/list of entries."""
    if isinstance(value, P):
        return value
    if value is None:
        return P()
    if isinstance(value, str):
        return P.parse(value)
    if isinstance(value, (tuple, list)):
        return P(*value)
    raise SpecError(f"{where}{value!r} is not a partition spec; use P(...), an einops string like 'dp _', or P() to replicate")
