"""Checkpoint directories: DCP save and load with atomic publish and a metadata check before loading.

>>> shardplan.checkpoint.save(path, model, opt, step=100)   # atomic: written aside, then published
>>> step = shardplan.checkpoint.load(path, model, opt)      # any world size, strategy, rules or units
>>> shardplan.checkpoint.save_tree(path, plan, {"params": local, "opt": state}, step=100)   # functional
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
import warnings
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
import torch.nn as nn

from ...errors import CheckpointError
from .. import collectives as C
from ..builder import engine_of
from . import diagnose
from .diagnose import MARKER
from .run_state import RunState, report, requested, saved_entries
from .values import (init_optimizer_state, load_state_dict, local_of, model_buffers, quiet_sharded_tensor, state_dict,
                     tree_state_dict)
from ...rules import leaves_with_paths


# -- writing and reading a directory --------------------------------------------------------------------

def _dcp_failure(exc: BaseException, what: str, path: str) -> CheckpointError:
    """DCP's own ``CheckpointException`` (a ``BaseException``: ``except Exception`` misses it, and its message is
    a traceback per rank) as shardplan's error, naming the ranks and the first cause."""
    failures = getattr(exc, "failures", None) or {}
    first = next(iter(failures.values()), None)
    first = first[0] if isinstance(first, tuple) and first else first  # (exception, its stack)
    cause = f"{type(first).__name__}: {first}" if first is not None else str(exc)[:500]
    return CheckpointError(f"{what} {path} failed on rank(s) {sorted(failures) or '?'}: {cause}")


def _dcp_save(sd: dict, path: str) -> None:
    try:
        with quiet_sharded_tensor():
            dcp.save(sd, checkpoint_id=path)
    except CheckpointException as exc:
        raise _dcp_failure(exc, "writing checkpoint files into", path) from exc


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's load planner without its guess at checkpoints written by torch <= 2.3.

    [Note: when the checkpoint holds keys this load does not ask for (another rank's ``rng.rank_1``, parts
    left out), DCP re-flattens the state dict the 2.3 way, which keeps a dict of non-tensors (``{"rank_0":
    bytes}``) as one key ``rng`` that the checkpoint does not have. shardplan needs torch >= 2.6, so its
    checkpoints are never of that format]
    """

    def create_local_plan(self):
        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)


def _dcp_load(sd: dict, path: str) -> None:
    try:
        with quiet_sharded_tensor():
            dcp.load(sd, checkpoint_id=path, planner=_LoadPlanner())
    except CheckpointException as exc:
        raise _dcp_failure(exc, "loading checkpoint", path) from exc


def _metadata(path: str) -> dict:
    """``{flat key: metadata}`` of the checkpoint at ``path``; a path that holds no DCP checkpoint raises
    a :class:`CheckpointError` that says what is there instead and how to load it."""
    if not os.path.isdir(path):
        raise CheckpointError(diagnose.not_a_directory(path))
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise CheckpointError(diagnose.not_dcp(path))
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def publish_atomic(sd: dict, path: str, world, rank: int, marker: Optional[dict] = None) -> None:
    """DCP writes into ``path`` + a unique suffix, rank 0 writes the completion marker (``MARKER``: the
    step, the mesh, the strategy) into it and renames it into place, so a run killed mid-save leaves the
    previous checkpoint at ``path`` loadable, and a directory with the marker is a finished checkpoint."""
    _settle(raise_unobserved=True)
    tmp = C.broadcast_str(f"{path.rstrip('/')}.tmp-{uuid.uuid4().hex[:8]}", world)
    try:
        _dcp_save(sd, tmp)
    except CheckpointError as exc:  # every rank gets DCP's gathered failure: the same error everywhere
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{exc}; nothing was published: the previous checkpoint at {path}, if any, is "
                              f"intact") from exc.__cause__
    C.barrier(world)
    if rank == 0:
        publish_directory(tmp, path, {**(marker or {}), "world_size": world.size, "time": time.time()})
    C.barrier(world)


def publish_directory(tmp: str, path: str, info: dict) -> None:
    """Rank 0, once every rank's files are in ``tmp``: the completion marker into it, then ``tmp`` renamed to
    ``path`` (an older ``path`` is moved aside first and removed after)."""
    _write_marker(tmp, info)
    old = None
    if os.path.exists(path):
        old = f"{path.rstrip('/')}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, old)
    os.rename(tmp, path)
    if old:
        shutil.rmtree(old, ignore_errors=True)


SETTLERS: list = []
"""Callables that wait for this process's asynchronous saves in flight (:mod:`.async_io` registers its own
when imported: it imports this module, not the other way round)."""


def _settle(*, raise_unobserved: bool) -> None:
    """Wait for this process's asynchronous save in flight (see :mod:`.async_io`)."""
    for settle in SETTLERS:
        settle(raise_unobserved=raise_unobserved)


def _write_marker(directory: str, info: dict) -> None:
    part = os.path.join(directory, MARKER + ".part")
    with open(part, "w") as f:
        json.dump(info, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, os.path.join(directory, MARKER))


def checkpoint_info(path: str) -> Optional[dict]:
    """What the completion marker of the checkpoint at ``path`` says (step, mesh, strategy, world size,
    ``"form"``: ``"module"`` or ``"tree"``); ``None``: no marker (unfinished, or not written by shardplan)."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# -- modules --------------------------------------------------------------------------------------------

def save(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, step: int = 0,
         lr_scheduler=None, dataloader=None, rng: bool = False, extra: Optional[dict] = None) -> None:
    """Save atomically (written aside, then renamed into place); loads at any world size, strategy,
    rules or units with :func:`load`.

    >>> shardplan.checkpoint.save("ckpt/latest", model, opt, step=100)
    >>> shardplan.checkpoint.save("ckpt/latest", model, opt, step=100, lr_scheduler=sched, dataloader=loader,
    ...                           rng=True, extra={"train_state": state})     # the whole run

    ``lr_scheduler``, ``dataloader`` (a stateful loader, e.g. torchdata's ``StatefulDataLoader``; one per
    data-parallel slice), ``rng`` (every rank's generators) and ``extra`` (named tensors, objects with
    ``state_dict()``, or picklable values) are saved beside the model: see :mod:`.run_state`.
    """
    eng = engine_of(model)
    run = RunState(lr_scheduler, dataloader, rng, extra)
    sd = state_dict(model, optimizer)
    sd["extra"] = {"step": torch.tensor(step)}
    sd.update(saved_entries(run, eng.plan, eng.groups.world, eng.rank))
    publish_atomic(sd, path, eng.groups.world, eng.rank, marker=_about(eng.plan, step, "module", optimizer, run))


def load(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, strict: bool = True,
         lr_scheduler=None, dataloader=None, rng: bool = False, extra: Optional[dict] = None) -> int:
    """Load a checkpoint written by :func:`save` (any world size, strategy, rules, units); returns its step.

    >>> step = shardplan.checkpoint.load("ckpt/latest", model, opt)
    >>> step = shardplan.checkpoint.load("ckpt/latest", model, opt, lr_scheduler=sched, dataloader=loader,
    ...                                  rng=True, extra=extra)   # extra: a dict, filled in place

    ``lr_scheduler``, ``dataloader``, ``rng`` and ``extra`` restore what :func:`save` stored of them (the
    loader's position needs the same number of data-parallel slices, the generators the same world size).

    Names and shapes are checked against the checkpoint first: a mismatch raises before anything is
    loaded, listing every difference (``strict=False`` loads what fits and warns about the rest).
    """
    run = RunState(lr_scheduler, dataloader, rng, extra)
    _settle(raise_unobserved=False)  # an asynchronous save in flight still reads the tensors
    meta = _metadata(path)
    eng = engine_of(model)
    wanted = requested(run, eng.plan, eng.groups.world.size, eng.rank, meta, path)
    if optimizer is not None:
        init_optimizer_state(optimizer)
    sd = state_dict(model, optimizer)
    sd["extra"] = {"step": torch.tensor(0)}
    old = [n for n in model_buffers(model) if f"model.{n}" not in meta]
    if old:  # saved before checkpoints held buffers: those keep their values, said once
        warnings.warn(f"checkpoint {path} has no entry for {len(old)} buffers of the model ({', '.join(old[:5])}"
                      f"{', ...' if len(old) > 5 else ''}): written by an older shardplan; they keep their current values")
        old_set = set(old)
        sd["model"] = {k: v for k, v in sd["model"].items() if k not in old_set}
    with quiet_sharded_tensor():  # ShardedTensor.size() warns too
        found = diagnose.differences(_flatten(sd), meta, _aliases(model))
    if found.problems and strict:
        raise CheckpointError(found.message(path, checkpoint_info(path), optimizer is not None))
    report(wanted.problems, path, strict)  # the run's state: raises (strict) before anything loaded
    if found.problems:
        warnings.warn(f"checkpoint {path}: skipped {len(found.skip)} entries:\n" + found.listing())
        sd = _drop(sd, set(found.skip))
    sd.update(wanted.entries)
    _dcp_load(sd, path)
    load_state_dict(model, sd, optimizer, strict=False)
    wanted.apply(sd)  # DCP filled the entries (opaque ones replaced in the dict): hand them to their owners
    return int(sd["extra"]["step"])


def _about(plan, step: int, form: str, optimizer, run: Optional[RunState] = None) -> dict:
    about = {"step": int(step), "form": form, "mesh": repr(plan.mesh), "strategy": str(plan.strategy),
             "optimizer": type(optimizer).__name__ if optimizer is not None else None,
             "params": len(plan.params)}
    if run is not None and not run.empty:  # what else the checkpoint holds (for people and tools reading it)
        about["run"] = {"lr_scheduler": type(run.lr_scheduler).__name__ if run.lr_scheduler is not None else None,
                        "dataloader": type(run.dataloader).__name__ if run.dataloader is not None else None,
                        "data_slices": plan.data_size if run.dataloader is not None else None,
                        "rng": bool(run.rng), "extra": sorted(run.extra or {})}
    return about


def _aliases(model) -> dict[str, str]:
    """``{alias: parameter}`` of tied parameters (names a checkpoint of this model never holds)."""
    plan = engine_of(model).plan
    return {a: p.name for p in plan.params for a in p.aliases}


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
    publish_atomic({"tree": sd, "extra": {"step": torch.tensor(step)}}, path, C.world(), rank,
                   marker=_about(plan, step, "tree", None))


def load_tree(path: str, plan, template, *, timeout_s: float = 300.0):
    """``(tree, step)``: the saved tree resharded for ``plan`` on this rank. ``template`` has the tree's
    structure with this rank's local shapes (e.g. ``shard_tree`` of the model and ``opt.init`` of it);
    its tensors are filled in place and returned.

    >>> tree, step = sp.checkpoint.load_tree("ckpt", plan, {"params": local, "opt": state})
    """
    import optree
    import torch.distributed as dist
    _settle(raise_unobserved=False)
    meta = _metadata(path)
    rank = dist.get_rank()
    sd, (paths, spec) = tree_state_dict(plan, template, rank, timeout_s)
    missing = [p for p in paths if f"tree.{p}" not in meta]
    if missing:
        raise CheckpointError(diagnose.tree_misfit(path, missing, meta, checkpoint_info(path)))
    with quiet_sharded_tensor():  # ShardedTensor.size() warns too
        shapes = diagnose.differences({f"tree.{k}": v for k, v in sd.items()}, meta).shapes
    if shapes:  # DCP would raise its own CheckpointException (a BaseException) from inside the load
        raise CheckpointError(diagnose.tree_shapes(path, shapes, checkpoint_info(path)))
    full = {"tree": sd, "extra": {"step": torch.tensor(0)}}
    _dcp_load(full, path)
    leaves = []
    for p, t in zip(paths, leaves_with_paths(template)[1]):
        v = local_of(sd[p])  # the template's memory, now loaded (None: this rank holds no piece of it)
        if v is not None and isinstance(t, torch.Tensor) and v is not t and v.data_ptr() == t.data_ptr():
            v = t.detach()  # values.own_storage gave DCP an alias of it: hand back the tensor itself
        leaves.append(t if v is None else v)
    tree = dict(zip(paths, leaves)) if spec is None else optree.tree_unflatten(spec, leaves)
    return tree, int(full["extra"]["step"])
