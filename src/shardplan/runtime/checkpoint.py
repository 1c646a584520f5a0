"""Distributed checkpoints that reshard: DCP state dicts described by ``Plan.local_slices``.

>>> sd = shardplan.state_dict(model, opt)            # {"model": {fqn: ...}, "optimizer": {...}}
>>> torch.distributed.checkpoint.save(sd, checkpoint_id=path)
>>> shardplan.checkpoint.save(path, model, opt, step=100)   # atomic: written aside, then published
>>> step = shardplan.checkpoint.load(path, model, opt)      # any world size, strategy, rules or units

Each sharded value is a ``ShardedTensor`` whose shards are exactly the boxes the plan gives every
rank of the parameter's shard group (uneven and row-packed shards included); replicated values are
plain tensors, which DCP writes once. The local shard tensors *are* the parameters and optimizer
states, so DCP loads straight into them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
import warnings
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from .. import layout as L
from ..errors import CheckpointError
from . import collectives as C
from .api import engine_of
from .seams import unwrap_compiled

warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)


def _sharded(eng, name: str, local: torch.Tensor):
    """``local`` (this rank's box of ``name``) as a DCP value."""
    return sharded_value(eng.plan, eng.groups, eng.rank, name, local)


def sharded_value(plan, groups, rank: int, name: str, local: torch.Tensor):
    """``local`` (``rank``'s box of parameter ``name``, or a state tensor shaped like it) as a DCP value:
    a ``ShardedTensor`` whose shards are the boxes ``plan.local_slices`` gives each rank of the group."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    p = plan.param(name)
    axes = plan.owner_axes(name)  # the buffer's shard axes, and the compute axis sharding it
    group = groups.gather(axes) if axes else None
    if group is None or group.size == 1:
        return local
    members = plan.mesh.group_of(rank, axes)
    dev = local.device.type if local.device.type == "cpu" else f"cuda:{local.device.index}"
    mds, mine = [], None
    for r in members:
        box = plan.local_slices(name, r)
        if box is None:
            continue
        # placements name *global* ranks: under HSDP a shard group is a sub-group ([2, 3] say), and
        # torch maps the placement's global rank into the group
        md = ShardMetadata([s.start for s in box], [s.stop - s.start for s in box], f"rank:{r}/{dev}")
        mds.append(md)
        if r == rank:
            mine = md
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(mds, torch.Size(p.global_shape), props)
    shards = [Shard(local, mine)] if mine is not None else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta, process_group=group.pg)


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    raise TypeError(f"optimizer hyper-parameter {v!r} cannot be saved; use numbers, bools, strings or tuples")


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create a never-stepped optimizer's state without changing parameters or its future steps.

    As torch's ``get_optimizer_state_dict`` does: one step with zero gradients and a zero learning rate.
    Unlike it, the step counters that this step advanced are put back to 0, so the state equals a fresh
    optimizer's (AdamW's first real step is still step 1), whether it is then saved or loaded into.
    """
    if opt.state or any(p.grad is not None for g in opt.param_groups for p in g["params"]):
        return
    lrs = []
    for group in opt.param_groups:
        lrs.append(group["lr"])
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    opt.step()
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    for st in opt.state.values():
        step = st.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif isinstance(step, (int, float)):
            st["step"] = type(step)(0)


def state_dict(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, init_optimizer: bool = True) -> dict:
    """``{"model": {fqn: value}, "optimizer": {"state": {fqn: {...}}, "param_groups": [...]}}`` for DCP.

    >>> sd = shardplan.state_dict(model, opt)
    >>> torch.distributed.checkpoint.load(sd, checkpoint_id=path); shardplan.load_state_dict(model, sd, opt)

    A never-stepped optimizer gets its state created first (``init_optimizer``, on by default), so that
    a state dict built to *load into* has tensors for DCP to fill: without them the optimizer's saved
    moments would be silently dropped.
    """
    eng = engine_of(model)
    locals_ = eng.local_params()
    sd: dict[str, Any] = {"model": {n: _sharded(eng, n, lp.detach()) for n, lp in locals_.items()}}
    if optimizer is not None:
        if init_optimizer:
            _init_optimizer_state(optimizer)
        fqn_of = {id(lp): n for n, lp in locals_.items()}
        state, groups = {}, []
        for group in optimizer.param_groups:
            names = []
            for p in group["params"]:
                if id(p) not in fqn_of:
                    raise CheckpointError("the optimizer holds a parameter that is not one of the sharded model's; "
                                          "build it on model.parameters() after shardplan.shard")
                n = fqn_of[id(p)]
                names.append(n)
                st = optimizer.state.get(p)
                if st:
                    state[n] = {k: (_sharded(eng, n, v) if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0
                                    else v) for k, v in st.items()}
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
        # one JSON string: DCP's save and load traversals flatten nested hyper-parameters differently
        sd["optimizer"] = {"state": state, "param_groups": json.dumps(groups, default=_jsonable)}
    return sd


def _local_value(v):
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    if isinstance(v, ShardedTensor):
        shards = v.local_shards()
        return shards[0].tensor if shards else None
    return v


def load_state_dict(model: nn.Module, state: dict, optimizer: Optional[torch.optim.Optimizer] = None,
                    *, strict: bool = True) -> dict[str, list[str]]:
    """Copy a (DCP-loaded) state dict from :func:`state_dict` into the local shards; returns what was skipped."""
    eng = engine_of(model)
    locals_ = eng.local_params()
    msd = state.get("model", {})
    missing = [n for n in locals_ if n not in msd]
    unexpected = [n for n in msd if n not in locals_]
    if strict and (missing or unexpected):
        raise CheckpointError(f"state dict does not fit the model: missing {missing[:20]}, unexpected {unexpected[:20]}; "
                              f"pass strict=False to load the rest")
    with torch.no_grad():
        for n, lp in locals_.items():
            if n in msd:
                v = _local_value(msd[n])
                if v is not None and v.data_ptr() != lp.data_ptr():
                    lp.copy_(v)
        if optimizer is not None and "optimizer" in state:
            osd = state["optimizer"]
            saved_groups = osd["param_groups"]
            if isinstance(saved_groups, str):
                saved_groups = json.loads(saved_groups)
            for group, saved in zip(optimizer.param_groups, saved_groups):
                for k, v in saved.items():
                    if k != "params":
                        group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
            by_name = {n: lp for n, lp in locals_.items()}
            for n, st in osd["state"].items():
                if n not in by_name:
                    continue
                p = by_name[n]
                cur = optimizer.state.setdefault(p, {})
                for k, v in st.items():
                    v = _local_value(v)
                    if v is None:  # this rank holds no piece of the parameter: its state tensor is empty
                        continue
                    if isinstance(v, torch.Tensor) and k in cur and isinstance(cur[k], torch.Tensor):
                        if v.data_ptr() != cur[k].data_ptr():
                            cur[k].copy_(v)
                    elif isinstance(v, torch.Tensor):
                        cur[k] = v.clone()
                    else:
                        cur[k] = v
    eng.mark_shards_changed()
    return {"missing": missing, "unexpected": unexpected}


# -- files -----------------------------------------------------------------------------------------

def _save_atomic(sd: dict, path: str, world, rank: int) -> None:
    """DCP writes into ``path`` + a unique suffix, then rank 0 renames it into place, so a run killed
    mid-save leaves the previous checkpoint at ``path`` loadable."""
    tmp = C.broadcast_str(f"{path.rstrip('/')}.tmp-{uuid.uuid4().hex[:8]}", world)
    dcp.save(sd, checkpoint_id=tmp)
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


def save(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, step: int = 0) -> None:
    """Save atomically (written aside, then renamed into place); loads at any world size, strategy,
    rules or units with :func:`load`."""
    eng = engine_of(model)
    sd = state_dict(model, optimizer)
    sd["extra"] = {"step": torch.tensor(step)}
    _save_atomic(sd, path, eng.groups.world, eng.rank)


# -- functional trees: (local params, optimizer state), any pytree -----------------------------------------

def _tree_state_dict(plan, tree, rank: int, timeout_s: float):
    """{dotted path: value} for DCP: a leaf whose path ends in a plan parameter's name and which has that
    parameter's local shape on this rank is sharded like it; any other leaf (a step count) is plain."""
    from ..rules import leaves_with_paths
    from .functional import groups_for
    groups = groups_for(plan, timeout_s)
    paths, leaves, spec = leaves_with_paths(tree)
    out = {}
    for path, leaf in zip(paths, leaves):
        parts = path.split(".")
        name = next((".".join(parts[k:]) for k in range(len(parts)) if ".".join(parts[k:]) in plan), None)
        if isinstance(leaf, torch.Tensor) and name is not None and tuple(leaf.shape) == plan.local_shape(name, rank):
            out[path] = sharded_value(plan, groups, rank, plan.param(name).name, leaf.detach())
        else:
            out[path] = leaf
    return out, (paths, spec)


def save_tree(path: str, plan, tree, *, step: int = 0, timeout_s: float = 300.0) -> None:
    """Save a pytree of local shards (``{"params": local, "opt": state}``, say) atomically; loads at any
    world size, strategy or rules with :func:`load_tree`.

    >>> sp.checkpoint.save_tree("ckpt", plan, {"params": local, "opt": state}, step=100)
    """
    import torch.distributed as dist
    rank = dist.get_rank()
    sd, _ = _tree_state_dict(plan, tree, rank, timeout_s)
    _save_atomic({"tree": sd, "extra": {"step": torch.tensor(step)}}, path, C.world(), rank)


def load_tree(path: str, plan, template, *, timeout_s: float = 300.0):
    """``(tree, step)``: the saved tree resharded for ``plan`` on this rank. ``template`` has the tree's
    structure with this rank's local shapes (e.g. ``shard_tree`` of the model and ``opt.init`` of it);
    its tensors are filled in place and returned.

    >>> tree, step = sp.checkpoint.load_tree("ckpt", plan, {"params": local, "opt": state})
    """
    import optree
    import torch.distributed as dist
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path!r}")
    rank = dist.get_rank()
    sd, (paths, spec) = _tree_state_dict(plan, template, rank, timeout_s)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    missing = [p for p in paths if f"tree.{p}" not in meta]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no entry for {missing[:10]}; the template must have the "
                              f"saved tree's structure")
    full = {"tree": sd, "extra": {"step": torch.tensor(0)}}
    dcp.load(full, checkpoint_id=path)
    from ..rules import leaves_with_paths
    leaves = []
    for p, t in zip(paths, leaves_with_paths(template)[1]):
        v = _local_value(sd[p])  # the template's tensor, now loaded (an empty box: this rank holds none)
        leaves.append(t if v is None else v)
    tree = dict(zip(paths, leaves)) if spec is None else optree.tree_unflatten(spec, leaves)
    return tree, int(full["extra"]["step"])


def _shape_of(md) -> Optional[tuple]:
    size = getattr(md, "size", None)
    return tuple(size) if size is not None else None


def load(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, strict: bool = True) -> int:
    """Load a checkpoint written by :func:`save` (any world size, strategy, rules, units); returns its step.

    Names and shapes are checked against the checkpoint first: a mismatch raises before anything is
    loaded, listing every difference (``strict=False`` loads what fits and warns about the rest).
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path!r}")
    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    if optimizer is not None:
        _init_optimizer_state(optimizer)
    sd = state_dict(model, optimizer)
    sd["extra"] = {"step": torch.tensor(0)}
    flat = _flatten(sd)
    problems, skip = [], []
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue  # hyper-parameters: DCP stores them as objects, flattened by its own rules
        if key not in meta:
            problems.append(f"  {key}: not in the checkpoint")
            skip.append(key)
            continue
        want = tuple(value.size()) if hasattr(value, "size") and callable(value.size) else None
        have = _shape_of(meta[key])
        if want is not None and have is not None and want != have:
            problems.append(f"  {key}: checkpoint has shape {have}, model has {want}")
            skip.append(key)
    extra = [k for k in meta if k not in flat and k.startswith("model.")]
    problems += [f"  {k}: in the checkpoint, not in the model" for k in extra]
    shown = "\n".join(problems[:40]) + (f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else "")
    if problems and strict:
        raise CheckpointError(f"checkpoint {path} does not fit the model ({len(problems)} differences, nothing loaded):\n"
                              + shown + "\npass strict=False to load what fits")
    if problems:
        warnings.warn(f"checkpoint {path}: skipped {len(skip)} entries:\n" + shown)
        sd = _drop(sd, set(skip))
    dcp.load(sd, checkpoint_id=path)
    load_state_dict(model, sd, optimizer, strict=False)
    return int(sd["extra"]["step"])


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


# -- full (unsharded) export and import -----------------------------------------------------------------

def full_state_dict(model: nn.Module, *, cpu: bool = True) -> dict[str, torch.Tensor]:
    """Rank 0 gets ordinary full tensors (fp32 masters); other ranks get ``{}``. One buffer at a time."""
    eng = engine_of(model)
    plan = eng.plan
    locals_ = eng.local_params()
    out: dict[str, torch.Tensor] = {}
    if plan.compute_axes:
        out = _full_by_boxes(eng, locals_, cpu)
        bufs = ()
    else:
        bufs = plan.buffers
    for bp in bufs:
        if not bp.sharded:
            if eng.rank == 0:
                for name in bp.params:
                    out[name] = locals_[name].detach().clone().cpu() if cpu else locals_[name].detach().clone()
            continue
        shard = eng.shard_of(bp.index)
        gathered = torch.empty(bp.gathered_numel, dtype=shard.dtype, device=shard.device)
        C.all_gather(gathered, shard.contiguous(), eng.groups.gather(bp.axes), async_op=False)
        if eng.rank == 0:
            packed = gathered.view(bp.group_size, bp.shard_numel)
            members = plan.mesh.group_of(0, bp.axes)
            for name in bp.params:
                pp = plan.param(name)
                full = torch.empty(pp.shape, dtype=shard.dtype, device=shard.device)
                if bp.layout == L.CONTIGUOUS:
                    full.copy_(gathered[pp.offset:pp.offset + pp.numel].view(pp.shape))
                else:
                    for seg, r in enumerate(members):
                        box = plan.local_slices(name, r)
                        if box is not None:
                            n = math.prod(s.stop - s.start for s in box)
                            full[box].copy_(packed[seg, pp.offset:pp.offset + n].view([s.stop - s.start for s in box]))
                out[name] = full.cpu() if cpu else full
        del gathered
    if eng.rank == 0:
        for pp in plan.params:
            for a in pp.aliases:
                out[a] = out[pp.name]
        for name, buf in _persistent_buffers(model).items():
            out[name] = buf.detach().clone().cpu() if cpu else buf.detach().clone()
    return out


def _full_by_boxes(eng, locals_, cpu: bool) -> dict[str, torch.Tensor]:
    """Full tensors on rank 0 from every rank's box, one parameter at a time (any plan, compute axes too):
    each box is written by one of its replicas and summed over the world."""
    plan, out = eng.plan, {}
    for pp in plan.params:
        lp = locals_[pp.name].detach()
        full = torch.zeros(pp.global_shape, dtype=lp.dtype, device=lp.device)
        box = plan.local_slices(pp.name, eng.rank)
        others = [a for a in plan.mesh.axis_names if a not in plan.owner_axes(pp.name)]
        if box is not None and plan.mesh.axis_index(eng.rank, others) == 0:
            full[box] = lp.reshape([s.stop - s.start for s in box])
        C.all_reduce(full, eng.groups.world, async_op=False, op=torch.distributed.ReduceOp.SUM)
        if eng.rank == 0:
            out[pp.name] = full.cpu() if cpu else full
    return out


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers that ``model.state_dict()`` holds (non-persistent ones are rebuilt by the module). Read from
    the modules, not from ``model.state_dict()``, whose parameters are DTensors or refused (runtime/state_dict.py)."""
    model = unwrap_compiled(model)  # torch.compile(model) names them "_orig_mod.<name>"
    out = {}
    for path, m in model.named_modules(remove_duplicate=False):
        for name, buf in m._buffers.items():
            if buf is not None and name not in m._non_persistent_buffers_set:
                out[f"{path}.{name}" if path else name] = buf
    return out


def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load ordinary full tensors held by rank 0 (others may pass ``{}``), broadcast one parameter at a time."""
    eng = engine_of(model)
    plan = eng.plan
    if eng.rank == 0:
        missing = [p.name for p in plan.params if p.name not in full and not any(a in full for a in p.aliases)]
        names = {p.name for p in plan.params} | {a for p in plan.params for a in p.aliases} | set(_persistent_buffers(model))
        unexpected = [k for k in full if k not in names]
        bad = [f"{p.name}: {tuple(full[p.name].shape)} vs {p.global_shape}" for p in plan.params
               if p.name in full and tuple(full[p.name].shape) != p.global_shape]
        msg = ""
        if (missing or unexpected) and strict or bad:
            msg = f"full state dict does not fit: missing {missing[:20]}, unexpected {unexpected[:20]}, shapes {bad[:20]}"
    else:
        msg = ""
    world = eng.groups.world
    msg = C.broadcast_str(msg, world)
    if msg:
        raise CheckpointError(msg)
    locals_ = eng.local_params()
    with torch.no_grad():
        for pp in plan.params:
            lp = locals_[pp.name]
            t = torch.empty(pp.global_shape, dtype=lp.dtype, device=lp.device)
            if eng.rank == 0:
                v = full.get(pp.name)
                if v is None:
                    v = next((full[a] for a in pp.aliases if a in full), None)
                if v is not None:
                    t.copy_(v)
            C.broadcast(t, 0, world)
            box = plan.local_slices(pp.name, eng.rank)
            if box is not None:
                lp.copy_(t[box])
        for name, buf in _persistent_buffers(model).items():
            if eng.rank == 0 and name in full:
                buf.copy_(full[name])
            C.broadcast(buf, 0, world)
    eng.mark_shards_changed()
