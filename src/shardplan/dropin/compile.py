"""The plan of a ``fully_shard`` model compiles at its first use (see [Note: the plan compiles at first use] in
``fsdp2.py``): the outermost marked module is the root; the calls' options become one plan, sharded with
``shard``; ``plan_of`` gives it."""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.nn as nn

from ..errors import RuntimeShardingError, ShardingError
from ..planner import Plan, plan as make_plan
from ..runtime.api import engine_of, shard
from ..runtime.builder import FIRST_USE
from .common import _dim0_rules, _mesh_from
from .init_view import _check_empty_device, _close_init_view, _empty_buffers, _leave_uninitialised, _open_init_view
from .marks import _COMPILING, _INIT_VIEWS, _MARK, _marked
from .optimizer_state import _watch_optimizers


def plan_of(module: nn.Module) -> Plan:
    """The plan a sharded module runs (whichever entry point sharded it).

    >>> fully_shard(model); print(sp.plan_of(model))           # the schedule FSDP2's calls compiled into
    """
    _ensure_compiled(module)
    return engine_of(module).plan


def _ensure_compiled(module: nn.Module) -> None:
    opts = module.__dict__.get(_MARK)
    if _INIT_VIEWS[0] and opts is not None and not _COMPILING[0]:  # the first use after to_empty: the modules
        root = opts.get("root")                                    # get their shards back
        if root is not None and "init_views" in root.__dict__[_MARK]:
            _close_init_view(root)
    if _COMPILING[0] or opts is None or opts.get("root") is not None or "_shardplan" in module.__dict__:
        return
    while opts.get("owner") is not None:  # see [Note: the plan compiles at first use]
        module = opts["owner"]
        opts = module.__dict__[_MARK]
    if opts.get("root") is None and "_shardplan" not in module.__dict__:
        _compile_root(module)


FIRST_USE.append(_ensure_compiled)  # shardplan's functions (engine_of) on a fully_shard model are a first use


def _compile_root(root: nn.Module, empty_on: Optional[torch.device] = None) -> None:
    """Compile and shard ``root``'s plan. ``empty_on`` (``to_empty(device=...)`` before the first use): a meta
    model's shards get storage on that device, uninitialised, and the init view opens."""
    opts = root.__dict__[_MARK]
    marked = [(name, m) for name, m in root.named_modules() if name and _MARK in m.__dict__]
    # a call without mp_policy has FSDP2's default policy (no mixed precision): its module computes in fp32
    by_policy: dict = {}
    for name, o in [("<root>", opts["mp_policy"])] + [(n, m.__dict__[_MARK]["mp_policy"]) for n, m in marked]:
        key = (getattr(o, "param_dtype", None), getattr(o, "reduce_dtype", None))
        by_policy.setdefault(key, []).append(name)
    if len(by_policy) > 1:
        said = "; ".join(f"param_dtype={k[0]}, reduce_dtype={k[1]} for {v[:3]}{' ...' if len(v) > 3 else ''}"
                         for k, v in by_policy.items())
        raise ShardingError(f"fully_shard: shardplan runs one mixed-precision policy per plan, but the calls under this "
                            f"root differ ({said}; a call without mp_policy is FSDP2's default, no mixed precision). "
                            f"Give every fully_shard call the same mp_policy")
    compute, reduce = next(iter(by_policy))
    for arg in ("mesh", "shard_placement_fn"):  # the root's is the plan's: another on an inner call would be ignored
        same = (lambda a, b: _mesh_from(a, "dp") == _mesh_from(b, "dp")) if arg == "mesh" else (lambda a, b: a is b)
        other = [n for n, m in marked if not same(m.__dict__[_MARK][arg], opts[arg])]
        if other:
            raise ShardingError(f"fully_shard: {arg} of the calls on {other[:3]} differs from the root's; shardplan "
                                f"compiles one plan over one mesh with one placement function. Pass the same {arg} "
                                f"to every fully_shard call")
    orders = {o for o in [opts.get("order")] + [m.__dict__[_MARK].get("order") for _, m in marked] if o is not None}
    if len(orders) > 1:
        raise ShardingError(f"fully_shard: the calls under this root ask for order={sorted(orders)}; a plan has one "
                            f"order: give every call the same (or only the root's call)")
    order = orders.pop() if orders else "static"
    mesh = _mesh_from(opts["mesh"], "dp")
    axis = "shard" if "shard" in mesh.axis_names else mesh.axis_names[-1]
    _COMPILING[0] = True
    try:
        p = make_plan(root, _dim0_rules(axis, opts["shard_placement_fn"]), mesh, strategy="optim_grads_params",
                      units=[re.escape(name) for name, _ in marked], compute_dtype=compute, reduce_dtype=reduce,
                      min_unit_bytes=0, layout="chunked", order=order)  # torch.chunk shards: DTensor state dicts
        flags = {u.name: root.get_submodule(u.name).__dict__[_MARK]["reshard_after_forward"]
                 for u in p.units[1:] if u.name in dict(marked)}
        if any(f is False for f in flags.values()):
            p = p.with_reshard_after_forward(flags)
        if empty_on is not None:
            _check_empty_device(root, empty_on)
        sync = any(o.get("sync_module_states") for o in [opts] + [m.__dict__[_MARK] for _, m in marked])
        try:
            shard(root, p, init_fn=_leave_uninitialised if empty_on is not None else None, sync_module_states=sync,
                  dtensor_params=True)  # FSDP2's DTensor parameters (chunked: every parameter describable)
        except RuntimeShardingError as exc:
            if getattr(exc, "uninitialised", None) is None:
                raise
            kind, names = exc.uninitialised
            raise ShardingError(
                f"fully_shard: the model is on the meta device and {kind} (owning {names[:3]}) has no "
                f"reset_parameters(), so its first use cannot initialise it. Use FSDP2's (torchtitan's) order: after "
                f"the fully_shard calls, model.to_empty(device=...), then the model's own init (e.g. "
                f"model.init_weights()), before the first use; or load weights with set_model_state_dict") from None
    finally:
        _COMPILING[0] = False
    eng = engine_of(root)
    if empty_on is not None:
        _empty_buffers(root, eng.device)
    eng.fsdp2_optimizer_state = True  # optimizers over it give DTensor states, as FSDP2's do
    eng.fsdp2_inputs = True  # inputs cast at every marked module, through dataclasses etc., as FSDP2 casts them
    eng.shard_used_hint = ("Use it inside its module's forward, or keep that module gathered from its forward to "
                           "its backward: fully_shard(<the module holding it>, reshard_after_forward=False), then "
                           "read it after that module's forward (or do not fully_shard that module: its parameters "
                           "join the enclosing one's)")
    eng.cursor.fix_hint = ("A unit that runs more than once per step (two forwards then one backward, a generate "
                           "loop with gradients) or in a data-dependent order needs fully_shard(model, "
                           "order='dynamic') (shardplan's argument, on the root's call: units stay gathered until "
                           "the forward ends); FSDP2 re-gathers such units instead")
    _watch_optimizers()
    opts["root"] = root
    for _, m in marked:
        m.__dict__[_MARK]["root"] = root
    flags = {m.__dict__[_MARK].get("sync", True) for m in _marked(root, True)}
    if len(flags) == 1:  # set_requires_gradient_sync called before the plan compiled
        eng.sync = flags.pop()
    if empty_on is not None:
        _open_init_view(root, eng)
