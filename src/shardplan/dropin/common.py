"""What both drop-in faces share: a :class:`~shardplan.Mesh` from a ``DeviceMesh`` (or the world), the
dim-0 rules both FSDP2 and Megatron-FSDP shard by, and the refusal of an argument shardplan would ignore."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..errors import ShardingError
from ..mesh import Mesh
from ..spec import P


def _brief(value) -> str:
    if isinstance(value, (set, list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return f"<{len(value)} parameters>"
    return repr(value)


def _unsupported(where: str, **given) -> None:
    for name, (value, ok) in given.items():
        if not ok(value):
            raise ShardingError(f"{where}: {name}={_brief(value)} is not supported by shardplan (it would be ignored); "
                                f"leave it at its default or remove it")


def _mesh_from(device_mesh, default_axis: str) -> Mesh:
    if device_mesh is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        return Mesh(**{default_axis: world})
    if device_mesh.mesh_dim_names is None:
        if device_mesh.ndim == 1:
            return Mesh(**{default_axis: device_mesh.size()})
        if device_mesh.ndim == 2:  # FSDP2's HSDP convention: (replicate, shard)
            return Mesh(replicate=device_mesh.size(0), shard=device_mesh.size(1))
        raise ShardingError("a DeviceMesh of more than two dimensions needs mesh_dim_names")
    return Mesh.from_device_mesh(device_mesh)


def _dim0_rules(axis: str, placement_fn: Optional[Callable] = None):
    """Every parameter sharded on dim 0 over ``axis`` (FSDP2's and Megatron-FSDP's default); scalars
    replicated; ``placement_fn(param) -> Shard(d) | None`` (FSDP2's ``shard_placement_fn``) picks another dim."""
    def spec(path, leaf):
        if leaf.dim() == 0:
            return P()
        d = 0
        if placement_fn is not None:
            placement = placement_fn(leaf)
            if placement is not None:
                d = getattr(placement, "dim", 0)
        return P(*([None] * d + [axis]))
    return [(r".*", spec)]
