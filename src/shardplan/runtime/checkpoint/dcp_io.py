"""Checkpoint directories: DCP save and load with atomic publish and a metadata check before loading.

>>> shardplan.checkpoint.save(path, model, opt, step=100)   # atomic: written aside, then published
>>> step = shardplan.checkpoint.load(path, model, opt)      # any world size, strategy, rules or units
>>> shardplan.checkpoint.save_tree(path, plan, {"params": local, "opt": state}, step=100)   # functional
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from ...errors import CheckpointError
from .. import collectives as C
from ..builder import engine_of
from .values import init_optimizer_state, local_of, quiet_sharded_tensor, state_dict, load_state_dict, tree_state_dict


# -- writing and reading a directory --------------------------------------------------------------------

def _dcp_save(sd: dict, path: str) -> None:
    with quiet_sharded_tensor():
        dcp.save(sd, checkpoint_id=path)


def _dcp_load(sd: dict, path: str) -> None:
    with quiet_sharded_tensor():
        dcp.load(sd, checkpoint_id=path)


def _metadata(path: str) -> dict:
    """``{flat key: metadata}`` of the checkpoint at ``path`` (raises if there is none)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path!r}")
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def publish_atomic(sd: dict, path: str, world, rank: int) -> None:
    """DCP writes into ``path`` + a unique suffix, then rank 0 renames it into place, so a run killed
    mid-save leaves the previous checkpoint at ``path`` loadable."""
    tmp = C.broadcast_str(f"{path.rstrip('/')}.tmp-{uuid.uuid4().hex[:8]}", world)
    _dcp_save(sd, tmp)
    C.barrier(world)
    if rank == 0:
        old = None
        if os.path.exists(path):
            old = f"{path.rstrip('/')}.old-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
        os.rename(tmp, path)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    C.barrier(world)


# -- modules --------------------------------------------------------------------------------------------

def save(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, step: int = 0) -> None:
    """Save atomically (written aside, then renamed into place); loads at any world size, strategy,
    rules or units with :func:`load`.

    >>> shardplan.checkpoint.save("ckpt/latest", model, opt, step=100)
    """
    eng = engine_of(model)
    sd = state_dict(model, optimizer)
    sd["extra"] = {"step": torch.tensor(step)}
    publish_atomic(sd, path, eng.groups.world, eng.rank)


def load(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, strict: bool = True) -> int:
    """Load a checkpoint written by :func:`save` (any world size, strategy, rules, units); returns its step.

    >>> step = shardplan.checkpoint.load("ckpt/latest", model, opt)

    Names and shapes are checked against the checkpoint first: a mismatch raises before anything is
    loaded, listing every difference (``strict=False`` loads what fits and warns about the rest).
    """
    meta = _metadata(path)
    if optimizer is not None:
        init_optimizer_state(optimizer)
    sd = state_dict(model, optimizer)
    sd["extra"] = {"step": torch.tensor(0)}
    with quiet_sharded_tensor():  # ShardedTensor.size() warns too
        problems, skip = _differences(_flatten(sd), meta)
    shown = "\n".join(problems[:40]) + (f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else "")
    if problems and strict:
        raise CheckpointError(f"checkpoint {path} does not fit the model ({len(problems)} differences, nothing loaded):\n"
                              + shown + "\npass strict=False to load what fits")
    if problems:
        warnings.warn(f"checkpoint {path}: skipped {len(skip)} entries:\n" + shown)
        sd = _drop(sd, set(skip))
    _dcp_load(sd, path)
    load_state_dict(model, sd, optimizer, strict=False)
    return int(sd["extra"]["step"])


def _differences(flat: dict, meta: dict) -> tuple[list[str], list[str]]:
    """(lines describing each name or global shape that differs, the keys to skip when loading)."""
    problems, skip = [], []
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue  # hyper-parameters: DCP stores them as objects, flattened by its own rules
        if key not in meta:
            problems.append(f"  {key}: not in the checkpoint")
            skip.append(key)
            continue
        want = tuple(value.size())  # a ShardedTensor's size() is the global shape
        have = getattr(meta[key], "size", None)
        if have is not None and want != tuple(have):
            problems.append(f"  {key}: checkpoint has shape {tuple(have)}, model has {want}")
            skip.append(key)
    problems += [f"  {k}: in the checkpoint, not in the model" for k in meta if k not in flat and k.startswith("model.")]
    return problems, skip


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _drop(d: dict, keys: set, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out[k] = _drop(v, keys, key + ".")
        elif key not in keys:
            out[k] = v
    return out


# -- functional trees: (local params, optimizer state), any pytree -----------------------------------------

def save_tree(path: str, plan, tree, *, step: int = 0, timeout_s: float = 300.0) -> None:
    """Save a pytree of local shards (``{"params": local, "opt": state}``, say) atomically; loads at any
    world size, strategy or rules with :func:`load_tree`.

    >>> sp.checkpoint.save_tree("ckpt", plan, {"params": local, "opt": state}, step=100)
    """
    import torch.distributed as dist
    rank = dist.get_rank()
    sd, _ = tree_state_dict(plan, tree, rank, timeout_s)
    publish_atomic({"tree": sd, "extra": {"step": torch.tensor(step)}}, path, C.world(), rank)


def load_tree(path: str, plan, template, *, timeout_s: float = 300.0):
    """``(tree, step)``: the saved tree resharded for ``plan`` on this rank. ``template`` has the tree's
    structure with this rank's local shapes (e.g. ``shard_tree`` of the model and ``opt.init`` of it);
    its tensors are filled in place and returned.

    >>> tree, step = sp.checkpoint.load_tree("ckpt", plan, {"params": local, "opt": state})
    """
    import optree
    import torch.distributed as dist
    from ...rules import leaves_with_paths
    meta = _metadata(path)
    rank = dist.get_rank()
    sd, (paths, spec) = tree_state_dict(plan, template, rank, timeout_s)
    missing = [p for p in paths if f"tree.{p}" not in meta]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no entry for {missing[:10]}; the template must have the "
                              f"saved tree's structure")
    full = {"tree": sd, "extra": {"step": torch.tensor(0)}}
    _dcp_load(full, path)
    leaves = []
    for p, t in zip(paths, leaves_with_paths(template)[1]):
        v = local_of(sd[p])  # the template's tensor, now loaded (None: this rank holds no piece of it)
        leaves.append(t if v is None else v)
    tree = dict(zip(paths, leaves)) if spec is None else optree.tree_unflatten(spec, leaves)
    return tree, int(full["extra"]["step"])
