"""The runtime's public functions: ``shard``, ``no_sync``, ``clip_grad_norm_``, ``record_ops``."""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import RuntimeShardingError
from ..plan import Plan
from ..units import ROOT
from .buffers import BufferState
from .engine import Engine, UnitState, build_groups

_ATTR = "_shardplan"


def engine_of(module: nn.Module) -> Engine:
    eng = module.__dict__.get(_ATTR)
    if eng is None:
        raise RuntimeShardingError("this module is not sharded; call shardplan.shard(module, plan) first")
    return eng


def _check_world(plan: Plan) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeShardingError(
            "shardplan.shard() needs an initialised torch.distributed process group: run under torchrun and call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first (world size 1 works too)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != plan.mesh.size:
        raise RuntimeShardingError(
            f"the plan's mesh {plan.mesh!r} has {plan.mesh.size} ranks but the world size is {world}; "
            f"plan again with a mesh whose axis sizes multiply to {world}")
    return world, rank


def _check_module(module: nn.Module, plan: Plan) -> dict[str, list[tuple[nn.Module, str]]]:
    """{canonical name: [(owner module, attribute)]}; raises listing every mismatch."""
    slots: dict[str, list] = {}
    problems = []
    by_id: dict[int, str] = {}
    mods = dict(module.named_modules())
    for name, p in module.named_parameters(remove_duplicate=False):
        canonical = by_id.setdefault(id(p), name)
        owner, _, attr = name.rpartition(".")
        try:
            pp = plan.param(canonical)
        except Exception:  # noqa: BLE001
            problems.append(f"  {name} {tuple(p.shape)}: not in the plan")
            continue
        if tuple(p.shape) != pp.shape:
            problems.append(f"  {name}: module has shape {tuple(p.shape)}, plan has {pp.shape}")
        if str(p.dtype).replace("torch.", "") != pp.dtype:
            problems.append(f"  {name}: module has dtype {p.dtype}, plan has {pp.dtype}")
        slots.setdefault(pp.name, []).append((mods[owner], attr))
    missing = [p.name for p in plan.params if p.name not in slots]
    problems += [f"  {n}: in the plan, not in the module" for n in missing]
    if problems:
        raise RuntimeShardingError("the module does not match the plan:\n" + "\n".join(problems[:40]) +
                                   "\nbuild the plan from this module (shardplan.plan(module, ...))")
    return slots


def _check_fingerprint(plan: Plan, rank: int, world: int) -> None:
    mine = plan.fingerprint()
    if world == 1:
        return
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if len(set(everyone)) > 1:
        groups: dict[str, list[int]] = {}
        for r, fp in enumerate(everyone):
            groups.setdefault(fp, []).append(r)
        detail = "; ".join(f"ranks {rs} have {fp}" for fp, rs in groups.items())
        raise RuntimeShardingError(f"ranks hold different plans ({detail}); build the plan the same way on every "
                                   f"rank (same model, rules, mesh and options)")


def _device_for(module: nn.Module, backend: str) -> tuple[torch.device, bool]:
    devs = {p.device for p in module.parameters()}
    meta = all(d.type == "meta" for d in devs)
    if meta or backend == "nccl":
        if torch.cuda.is_available() and backend != "gloo":
            return torch.device("cuda", torch.cuda.current_device()), meta
        return torch.device("cpu"), meta
    real = [d for d in devs if d.type != "meta"]
    if len(set(real)) > 1:
        raise RuntimeShardingError(f"parameters are on several devices {sorted(map(str, real))}; move the module to one")
    return real[0], meta


def shard(module: nn.Module, plan: Plan, *, init_fn: Optional[Callable[[nn.Module], None]] = None,
          timeout_s: float = 300.0, sync_buffers: bool = True) -> nn.Module:
    """Shard ``module`` in place by ``plan`` and return it: its parameters become this rank's shards.

    >>> model = shardplan.shard(model, plan)        # inside torchrun, after init_process_group
    >>> opt = torch.optim.AdamW(model.parameters())  # steps the local shards
    """
    if _ATTR in module.__dict__:
        raise RuntimeShardingError("this module is already sharded; build a fresh module to shard it again")
    world, rank = _check_world(plan)
    slots = _check_module(module, plan)
    _check_fingerprint(plan, rank, world)
    backend = dist.get_backend()
    device, meta = _device_for(module, backend)
    groups = build_groups(plan, rank, backend)
    eng = Engine(module, plan, rank, device, groups, timeout_s)
    originals = {n: p for n, p in module.named_parameters()}
    modules = dict(module.named_modules())
    for up in plan.units:
        unit_modules = [module] if up.name == ROOT else [modules[m] for m in up.module_paths]
        bufs = [BufferState(plan, plan.buffers[i], rank, device, plan.level) for i in up.buffers]
        names = [n for b in bufs for n in b.bp.params]
        if meta:  # one unit at a time: the full unit exists only while its shards are cut out
            from .init import materialize_unit
            owners = [m for n in names for m, _ in slots[n][:1]]
            attr_of = {n: (lambda _n=n: getattr(slots[_n][0][0], slots[_n][0][1]).detach()) for n in names}
            unit_full = materialize_unit(owners, names, attr_of, init_fn, device)
        else:
            unit_full = {n: originals[n].detach() for n in names}
        for b in bufs:
            b.fill_local([unit_full[n] for n in b.bp.params])
            b.make_params()
        del unit_full
        u = UnitState(up.name, unit_modules[0], bufs, up.reshard_after_forward, up.name == ROOT, modules=unit_modules)
        for b in bufs:
            for pp, lp, fp in zip(b.infos, b.local, b.full_params):
                for m, attr in slots[pp.name]:
                    u.slots.append((m, attr, lp, fp))
                if fp.requires_grad:
                    u.expected += 1
                    # weak references: a hook lives in C++, where the garbage collector cannot see the
                    # cycle parameter -> hook -> engine -> parameter, so strong ones would leak the model
                    fp.register_post_accumulate_grad_hook(
                        lambda _p, _e=weakref.ref(eng), _u=weakref.ref(u): _e().on_grad(_u()))
        eng.units.append(u)
        eng.by_name[u.name] = u
        eng.swap_out(u)  # drops the module's full tensors (meta init: the only full copy of this unit)
    del originals
    eng.finalize()
    _install_hooks(module, eng)
    module.__dict__[_ATTR] = eng
    if sync_buffers and world > 1:
        _broadcast_buffers(module, eng)
    eng._account()
    return module


def _timed(eng: Engine, fn):
    """Wrap a hook to add its CPU time to ``eng.hook_seconds`` (the runtime's own work)."""
    clock = time.perf_counter

    def run(*args):
        t = clock()
        try:
            return fn(*args)
        finally:
            eng.hook_seconds += clock() - t
    return run


def _install_hooks(module: nn.Module, eng: Engine) -> None:
    root = eng.units[0]
    for name in ("root_pre_forward", "pre_forward", "post_forward", "root_post_forward", "pre_backward",
                 "on_grad", "end_backward"):
        setattr(eng, name, _timed(eng, getattr(eng, name)))

    def root_pre(_m, args, kwargs):
        args, kwargs = eng.root_pre_forward(args, kwargs)
        eng.pre_forward(root)
        return args, kwargs

    def root_post(_m, _args, output):
        eng.root_post_forward(output)
        return output

    eng.handles.append(module.register_forward_pre_hook(root_pre, with_kwargs=True))
    eng.handles.append(module.register_forward_hook(root_post))
    for u in eng.units[1:]:
        # a merged unit has several modules: gathered on entering the first, freed after the last
        for i, mod in enumerate(u.modules):
            last = i == len(u.modules) - 1
            eng.handles.append(mod.register_forward_pre_hook(lambda _m, _a, _u=u: eng.pre_forward(_u)))
            eng.handles.append(mod.register_forward_hook(
                lambda _m, _a, out, _u=u, _last=last: eng.post_forward(_u, out, _last)))


def _broadcast_buffers(module: nn.Module, eng: Engine) -> None:
    bufs = [b for b in module.buffers() if b.device.type != "meta"]
    if not bufs:
        return
    from . import collectives as C
    world = eng.groups[("world", eng.plan.mesh.axis_names)]
    src = dist.get_global_rank(world.pg, 0) if world.pg is not None else 0
    for b in bufs:
        C.broadcast(b.data, src, world)


@contextlib.contextmanager
def no_sync(module: nn.Module):
    """Micro-steps inside skip the gradient reduction; gradients accumulate unreduced until the next
    backward outside it, which reduces the sum (like DDP's ``no_sync``)."""
    eng = engine_of(module)
    prev, eng.sync = eng.sync, False
    try:
        yield
    finally:
        eng.sync = prev


@contextlib.contextmanager
def record_ops(module: nn.Module):
    """Record the schedule ops the runtime issues: ``with record_ops(m) as ops: ...`` -> [(kind, unit, phase)]."""
    eng = engine_of(module)
    ops: list = []
    prev, eng.record = eng.record, ops
    try:
        yield ops
    finally:
        eng.record = prev


def _grad_weight(eng: Engine, b: BufferState) -> float:
    # every element is owned by one rank per shard group and copied across the replicas
    reps = math.prod(eng.plan.mesh.shape[a] for a in b.bp.replica_axes) if b.bp.replica_axes else 1
    return 1.0 / reps


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0, foreach: Optional[bool] = None) -> torch.Tensor:
    """Clip the gradients of the local shards by the *global* norm over all ranks; returns that norm."""
    eng = engine_of(module)
    norm_type = float(norm_type)
    dev = eng.device
    world = eng.groups[("world", eng.plan.mesh.axis_names)]
    grads = []
    if norm_type == math.inf:
        local = torch.zeros((), device=dev)
        for u in eng.units:
            for b in u.buffers:
                for lp in b.local:
                    if lp.grad is not None and lp.grad.numel():
                        local = torch.maximum(local, lp.grad.detach().abs().max().float())
                        grads.append(lp.grad)
        total = local.clone()
        if world.size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=world.pg)
    else:
        acc = torch.zeros((), dtype=torch.float64 if dev.type == "cpu" else torch.float32, device=dev)
        for u in eng.units:
            for b in u.buffers:
                gs = [lp.grad for lp in b.local if lp.grad is not None and lp.grad.numel()]
                if not gs:
                    continue
                grads += gs
                norms = torch._foreach_norm(gs, norm_type) if foreach is not False else [torch.linalg.vector_norm(g, norm_type) for g in gs]
                part = torch.stack([n.to(acc.dtype) for n in norms]).pow(norm_type).sum()
                acc = acc + part * _grad_weight(eng, b)
        if world.size > 1:
            dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=world.pg)
        total = acc.pow(1.0 / norm_type)
    total = total.float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total


def memory_stats(module: nn.Module) -> dict[str, int]:
    """Bytes the runtime holds for parameters and gradients now, and the peak since ``shard``."""
    eng = engine_of(module)
    eng.track_memory = True
    eng._account()
    return {"live": eng.live_bytes, "peak": eng.peak_live_bytes}


def reset_peak(module: nn.Module) -> None:
    """Start tracking live bytes (costs O(units) per hook while on) and reset the peak."""
    eng = engine_of(module)
    eng.track_memory = True
    eng._account()
    eng.peak_live_bytes = eng.live_bytes
