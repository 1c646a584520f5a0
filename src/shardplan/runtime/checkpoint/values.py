"""State-dict conversion: local shards and optimizer states <-> DCP values.

>>> sd = shardplan.checkpoint.state_dict(model, opt)      # {"model": {fqn: value}, "optimizer": {...}}
>>> shardplan.checkpoint.load_state_dict(model, sd, opt)  # after torch.distributed.checkpoint.load(sd, ...)

A sharded value is a ``ShardedTensor`` whose shards are the boxes ``plan.local_slices`` gives every
rank of the parameter's shard group; a replicated one is the plain local tensor. The local shard
tensors *are* the parameters and optimizer states, so DCP loads straight into them. The conversion both
ways is :mod:`shardplan.runtime.dcp_values`'s (``sharded_value``, ``local_of``), the one converter that
``model.state_dict()``'s DTensors come from too; this module walks the model and optimizer.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch
import torch.nn as nn

from ...errors import CheckpointError
from ..builder import engine_of, groups_for
from ..dcp_values import local_of, own_storage, quiet_sharded_tensor, sharded_value  # noqa: F401 (re-exported)
from ..dtensor_params import plain
from .full import _persistent_buffers
from .. import collectives as C
from ...rules import leaves_with_paths


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    raise TypeError(f"optimizer hyper-parameter {v!r} cannot be saved; use numbers, bools, strings or tuples")


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
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


def model_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers ``model.state_dict()`` holds (not on the meta device), by name."""
    return {n: b for n, b in _persistent_buffers(model).items() if b.device.type != "meta"}


def _rank0_copies(bufs: dict, world) -> dict:
    out = {}
    for n, b in bufs.items():
        t = b.detach().clone()
        if world is not None and world.size > 1:
            C.broadcast(t, 0, world)
        out[n] = t
    return out


def state_dict(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, init_optimizer: bool = True) -> dict:
    """``{"model": {fqn: value}, "optimizer": {"state": {fqn: {...}}, "param_groups": [...]}}`` for DCP.

    >>> sd = shardplan.checkpoint.state_dict(model, opt)
    >>> torch.distributed.checkpoint.load(sd, checkpoint_id=path); shardplan.checkpoint.load_state_dict(model, sd, opt)

    A never-stepped optimizer gets its state created first (``init_optimizer``, on by default), so that
    a state dict built to *load into* has tensors for DCP to fill: without them the optimizer's saved
    moments would be silently dropped.
    """
    eng = engine_of(model)
    locals_ = eng.local_params()

    def value(n, t):
        return sharded_value(eng.plan, eng.groups, eng.rank, n, t)

    sd: dict[str, Any] = {"model": {n: value(n, eng.local_value(n, plain(lp))) for n, lp in locals_.items()}}
    # persistent buffers (BatchNorm's running statistics): plain tensors, replicated, so rank 0's values (what
    # shard() broadcast at start-up and full_state_dict exports; DCP saves one rank's copy of a plain tensor,
    # so every rank hands it the same one); load_state_dict copies what DCP loads into every rank's buffers
    sd["model"].update(_rank0_copies(model_buffers(model), eng.groups.world))
    if optimizer is not None:
        if init_optimizer:
            init_optimizer_state(optimizer)
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
                    state[n] = {k: (value(n, plain(v)) if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0
                                    else v) for k, v in st.items()}
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
        # [Note: one JSON string: DCP's save and load traversals flatten nested hyper-parameters differently]
        sd["optimizer"] = {"state": state, "param_groups": json.dumps(groups, default=_jsonable)}
    return sd


def load_state_dict(model: nn.Module, state: dict, optimizer: Optional[torch.optim.Optimizer] = None,
                    *, strict: bool = True) -> dict[str, list[str]]:
    """Copy a (DCP-loaded) state dict from :func:`state_dict` into the local shards; returns what was skipped.

    >>> shardplan.checkpoint.load_state_dict(model, sd, opt)    # {"missing": [...], "unexpected": [...]}
    """
    eng = engine_of(model)
    locals_ = eng.local_params()
    msd = state.get("model", {})
    bufs = model_buffers(model)
    missing = [n for n in locals_ if n not in msd]
    unexpected = [n for n in msd if n not in locals_ and n not in bufs]
    if strict and (missing or unexpected):
        raise CheckpointError(f"state dict does not fit the model: missing {missing[:20]}, unexpected {unexpected[:20]}; "
                              f"pass strict=False to load the rest")
    with torch.no_grad():
        for n, lp in locals_.items():
            if n in msd:
                lp = eng.local_value(n, plain(lp))  # (offload="params": a view of the host master)
                v = local_of(msd[n])
                if v is not None and v.data_ptr() != lp.data_ptr():
                    lp.copy_(v)
        for n, buf in bufs.items():
            v = local_of(msd.get(n))
            if isinstance(v, torch.Tensor) and v.data_ptr() != buf.data_ptr():
                buf.copy_(v)
        if optimizer is not None and "optimizer" in state:
            _load_optimizer(optimizer, state["optimizer"], locals_)
    eng.mark_shards_changed()
    return {"missing": missing, "unexpected": unexpected}


def _load_optimizer(optimizer: torch.optim.Optimizer, osd: dict, locals_: dict) -> None:
    saved_groups = osd["param_groups"]
    if isinstance(saved_groups, str):
        saved_groups = json.loads(saved_groups)
    for group, saved in zip(optimizer.param_groups, saved_groups):
        for k, v in saved.items():
            if k == "params":
                continue
            cur = group.get(k)
            if isinstance(cur, torch.Tensor) and isinstance(v, (int, float)) and cur.numel() == 1:
                # a tensor hyper-parameter (lr=torch.tensor(...)) stays that tensor: a captured step reads it, and
                # torch's optimizers compute with a tensor lr otherwise than with a float
                with torch.no_grad():
                    cur.fill_(v)
            else:
                group[k] = tuple(v) if isinstance(cur, tuple) else v
    for n, st in osd["state"].items():
        if n not in locals_:
            continue
        p = locals_[n]
        cur = optimizer.state.setdefault(p, {})
        for k, v in st.items():
            v = local_of(v)
            if v is None:  # this rank holds no piece of the parameter: its state tensor is empty
                continue
            if isinstance(v, torch.Tensor) and k in cur and isinstance(cur[k], torch.Tensor):
                have = plain(cur[k])  # (a DTensor state of a DTensor parameter: its local tensor)
                if v.data_ptr() != have.data_ptr():
                    have.copy_(v)
            elif isinstance(v, torch.Tensor) and p is not plain(p) and v.dim() > 0 and v.shape == plain(p).shape:
                from torch.distributed.tensor import DTensor  # a DTensor parameter's state is a DTensor like it
                cur[k] = DTensor(v.clone(), p._spec, requires_grad=False)
            elif isinstance(v, torch.Tensor):
                cur[k] = v.clone()
            else:
                cur[k] = v


def tree_state_dict(plan, tree, rank: int, timeout_s: float):
    """``({dotted path: value}, (paths, spec))`` for DCP: a leaf whose path ends in a plan parameter's name
    and which has that parameter's local shape on this rank (``plan.local_shape``) is sharded like it;
    any other leaf (a step count) is plain."""
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
