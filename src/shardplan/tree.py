"""Sharded pytrees: a rank's local shards of a tree of full tensors, and the full tensors back.

>>> local = shardplan.shard_tree(params, plan)          # this rank's boxes, same structure
>>> full = shardplan.unshard_tree(local, plan)          # all-gathered: full tensors on every rank

Any optree pytree the planner accepts works (dicts, lists, tuples, namedtuples, registered nodes); a
leaf's dotted path is its name in the plan. ``shard_tree`` and ``assemble`` are pure (no process
group): this module sits below the runtime. ``unshard_tree``, a collective, is the functional face's
(``shardplan.runtime.functional``), which checks trees with :func:`check_tree`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

import optree
import torch

from .errors import ShardingError
from .planner import Plan
from .planner import geometry as G
from .rules import leaves_with_paths


def _rank(rank: Optional[int]) -> int:
    if rank is not None:
        return rank
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _same_tensor(a, b) -> bool:
    """One tensor, or two views of the same memory with one shape (``state_dict()`` detaches each name)."""
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.device.type == "meta":
        return False
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


def check_tree(plan: Plan, paths, leaves, *, rank: Optional[int] = None, what: str = "tree") -> None:
    """Raise :class:`ShardingError` naming the first path whose name, shape or dtype does not fit the plan
    (``rank`` given: local shapes; else full shapes)."""
    names = set(paths)
    seen: dict[str, tuple] = {}  # plan name -> (the path that gave it, its leaf)
    for path, leaf in zip(paths, leaves):
        if path not in plan:
            close = [p.name for p in plan.params if path.split(".")[-1] in p.name][:3]
            raise ShardingError(f"{what} leaf {path!r} is not a parameter of the plan (close names: {close}); the tree "
                                f"must have the structure the plan was built from")
        p = plan.param(path)
        first = seen.get(p.name)
        # [Note: two different tensors for one tied parameter: one of them would be dropped silently. The same
        # tensor under both names (a tied model's state_dict()) is one parameter, as the plan says]
        if first is not None and not _same_tensor(first[1], leaf):
            raise ShardingError(f"{what} leaves {first[0]!r} and {path!r} are one tied parameter in the plan "
                                f"({p.name!r}, also {', '.join(p.aliases)}), but the {what} holds two different "
                                f"tensors for them; pass one leaf (or the same tensor) for it, or build the plan from "
                                f"an untied model")
        seen.setdefault(p.name, (path, leaf))
        want = plan.local_shape(p.name, rank) if rank is not None else p.global_shape
        if tuple(getattr(leaf, "shape", ())) != tuple(want):
            raise ShardingError(f"{what} leaf {path!r} has shape {tuple(leaf.shape)}, the plan says "
                                f"{tuple(want)}{' on rank %d' % rank if rank is not None else ''}")
        if str(leaf.dtype).replace("torch.", "") != p.dtype:
            raise ShardingError(f"{what} leaf {path!r} has dtype {leaf.dtype}, the plan says {p.dtype}")
    missing = [p.name for p in plan.params if p.name not in names and not any(a in names for a in p.aliases)]
    if missing:
        raise ShardingError(f"{what} lacks plan parameter(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def shard_tree(tree: Any, plan: Plan, *, rank: Optional[int] = None,
               init_fn: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None) -> Any:
    """This rank's local shards of ``tree`` (full tensors), same structure. Pure: no collectives.

    >>> local = shardplan.shard_tree({"w": torch.randn(8, 4)}, plan, rank=1)

    A leaf on the meta device is made full by ``init_fn(path, leaf)`` first, one leaf at a time.
    Every local leaf is a fresh contiguous tensor (an empty box where the rank holds none of it).
    """
    rank = _rank(rank)
    paths, leaves, spec = leaves_with_paths(tree)
    check_tree(plan, paths, leaves)
    out = []
    for path, leaf in zip(paths, leaves):
        if leaf.device.type == "meta":
            if init_fn is None:
                raise ShardingError(f"leaf {path!r} is on the meta device; pass shard_tree(..., init_fn=fn) with "
                                    f"fn(path, leaf) -> the full tensor")
            leaf = init_fn(path, leaf)
        leaf = leaf.detach()
        box = plan.local_slices(path, rank)
        out.append(leaf[box].clone() if box is not None else leaf.new_empty(plan.local_shape(path, rank)))
    return rebuild(tree, spec, paths, out)


def rebuild(tree, spec, paths, leaves):
    """``leaves`` in the structure ``leaves_with_paths`` read (``spec``), or a ``{path: leaf}`` dict for a module."""
    if spec is None:  # an nn.Module: a {name: tensor} dict
        return dict(zip(paths, leaves))
    return optree.tree_unflatten(spec, leaves)


def place(plan: Plan, name: str, piece_of: Callable[[int], Optional[torch.Tensor]], like: torch.Tensor,
          owners: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """The full tensor of ``name`` from the local pieces (``piece_of(rank)``) of one group of ranks that
    together hold all of it (``owners``; default: the one with rank 0)."""
    p = plan.param(name)
    full = torch.empty(p.global_shape, dtype=like.dtype, device=like.device)
    first = plan.mesh.rank_of([0] * len(plan.mesh.axis_names))
    for r in owners if owners is not None else plan.mesh.group_of(first, G.owner_axes(plan, name)):
        box = plan.local_slices(name, r)
        piece = piece_of(r)
        if box is not None and piece is not None and piece.numel():
            full[box] = piece.reshape([s.stop - s.start for s in box])
    return full


def assemble(plan: Plan, trees_by_rank: Mapping[int, Any]) -> Any:
    """Full tensors from every rank's local tree (a pure ``unshard_tree``: tests and offline tools)."""
    any_tree = next(iter(trees_by_rank.values()))
    paths, leaves, spec = leaves_with_paths(any_tree)
    flat = {r: dict(zip(*leaves_with_paths(t)[:2])) for r, t in trees_by_rank.items()}
    out = [place(plan, path, lambda r, _p=path: flat[r][_p] if r in flat else None, leaf)
           for path, leaf in zip(paths, leaves)]
    return rebuild(any_tree, spec, paths, out)
