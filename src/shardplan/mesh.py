"""Named device meshes: axes with sizes, ranks laid out row-major.

>>> m = Mesh(replica=2, shard=4)
>>> m.size, m.coords(5), m.rank_of(replica=1, shard=1)
(8, (1, 1), 5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from .errors import MeshError, did_you_mean


@dataclass(frozen=True, init=False)
class Mesh:
    """A logical grid of ranks with named axes, row-major (the last axis varies fastest).

    Building one needs no process group: ``Mesh(dp=1024)`` plans for 1024 ranks on a laptop.

    >>> mesh = Mesh(replica=2, shard=4)        # 8 ranks: rank 5 is replica 1, shard 1
    >>> mesh.size, mesh.axis_names, mesh.axis_size("shard")
    (8, ('replica', 'shard'), 4)
    """

    axes: tuple[tuple[str, int], ...]

    def __init__(self, **axes: int):
        if not axes:
            raise MeshError("Mesh() needs at least one axis, e.g. Mesh(dp=8)")
        for name, size in axes.items():
            if not name.isidentifier():
                raise MeshError(f"mesh axis name {name!r} is not an identifier; use e.g. 'dp' or 'shard'")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise MeshError(f"mesh axis {name!r} has size {size!r}; sizes must be positive integers")
        object.__setattr__(self, "axes", tuple(axes.items()))

    # -- shape -------------------------------------------------------------------------------
    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def size(self) -> int:
        return math.prod(s for _, s in self.axes)

    def axis_size(self, axes: str | Iterable[str]) -> int:
        """Product of the sizes of ``axes`` (one name or several)."""
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        shape = self.shape
        for a in names:
            if a not in shape:
                raise MeshError(f"mesh has no axis {a!r}{did_you_mean(a, self.axis_names)}; its axes are {self.axis_names}")
        return math.prod(shape[a] for a in names)

    # -- ranks <-> coordinates ------------------------------------------------------------------
    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of ``rank`` along each axis, in axis order."""
        if not 0 <= rank < self.size:
            raise MeshError(f"rank {rank} is outside a mesh of size {self.size} {self.shape}")
        out = []
        for _, s in reversed(self.axes):
            out.append(rank % s)
            rank //= s
        return tuple(reversed(out))

    def rank_of(self, coords: Iterable[int] | None = None, **by_axis: int) -> int:
        """The rank at ``coords`` (a tuple in axis order, or one keyword per axis)."""
        c = tuple(coords) if coords is not None else tuple(by_axis[n] for n in self.axis_names)
        if len(c) != len(self.axes):
            raise MeshError(f"{c} has {len(c)} coordinates; mesh {self.shape} has {len(self.axes)} axes")
        rank = 0
        for (name, s), i in zip(self.axes, c):
            if not 0 <= i < s:
                raise MeshError(f"coordinate {i} is outside axis {name!r} of size {s}")
            rank = rank * s + i
        return rank

    def axis_index(self, rank: int, axes: Iterable[str]) -> int:
        """Row-major index of ``rank`` over ``axes`` taken in the order given (major to minor)."""
        coord = dict(zip(self.axis_names, self.coords(rank)))
        shape = self.shape
        idx = 0
        for a in axes:
            idx = idx * shape[a] + coord[a]
        return idx

    def groups(self, axes: Iterable[str]) -> tuple[tuple[int, ...], ...]:
        """Partition of all ranks into the groups that vary only along ``axes``.

        Each group lists its ranks in ascending order, which is also the order torch.distributed
        gives them inside a group made with ``new_group(ranks)``.
        """
        axes = tuple(axes)
        self.axis_size(axes)  # validates names
        buckets: dict[tuple[int, ...], list[int]] = {}
        keep = [i for i, n in enumerate(self.axis_names) if n not in axes]
        for r in range(self.size):
            c = self.coords(r)
            buckets.setdefault(tuple(c[i] for i in keep), []).append(r)
        return tuple(tuple(g) for g in buckets.values())

    def group_of(self, rank: int, axes: Iterable[str]) -> tuple[int, ...]:
        """The ranks that share every coordinate of ``rank`` except those along ``axes``."""
        axes = tuple(axes)
        c = self.coords(rank)
        names = self.axis_names
        free = [i for i, n in enumerate(names) if n in axes]
        out = []
        for r in range(self.size):
            rc = self.coords(r)
            if all(rc[i] == c[i] for i in range(len(names)) if i not in free):
                out.append(r)
        return tuple(out)

    # -- interop -----------------------------------------------------------------------------
    @classmethod
    def from_device_mesh(cls, device_mesh) -> "Mesh":
        """Build from a ``torch.distributed.device_mesh.DeviceMesh`` with named dimensions."""
        names = device_mesh.mesh_dim_names
        if names is None:
            raise MeshError("the DeviceMesh has no mesh_dim_names; build it with init_device_mesh(..., mesh_dim_names=(...))")
        mesh = cls(**dict(zip(names, (int(s) for s in device_mesh.mesh.shape))))
        flat = device_mesh.mesh.flatten().tolist()
        if flat != list(range(mesh.size)):
            raise MeshError(f"DeviceMesh ranks {flat} are not row-major 0..{mesh.size - 1}; shardplan meshes are row-major")
        return mesh

    def to_dict(self) -> dict[str, int]:
        return dict(self.axes)

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in self.axes) + ")"

    @classmethod
    def parse(cls, text: str) -> "Mesh":
        """Parse the CLI spelling ``dp=8`` or ``replica=2,shard=4``."""
        axes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, eq, size = part.partition("=")
            if not eq or not size.strip().isdigit():
                raise MeshError(f"bad mesh {text!r}: write axes as name=size, e.g. dp=8 or replica=2,shard=4")
            if name.strip() in axes:
                raise MeshError(f"bad mesh {text!r}: axis {name.strip()!r} is given twice; name each axis once")
            axes[name.strip()] = int(size)
        return cls(**axes)
