"""The runtime's public functions: ``shard``, ``no_sync``, ``clip_grad_norm_``, ``record_ops``."""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import RuntimeShardingError, ShardingError
from ..plan import Plan
from ..plan.schedule import ROOT
from . import collectives as C
from . import tensor_parallel as TP
from . import state_dict as SD
from .buffers import BufferState
from .executor import Executor
from .seams import guard_apply, unwrap_compiled
from .faces import ModuleFace
from . import identity
from .hooks import install
from .unit import UnitRuntime

_ATTR = "_shardplan"


def engine_of(module: nn.Module, plan: Optional[Plan] = None) -> Executor:
    """The executor running ``module``'s plan (``shard`` attaches it; with ``plan``, the one
    ``functional_call(module, plan, ...)`` made)."""
    if plan is not None:
        from .functional import _RUNTIMES
        rt = _RUNTIMES.get(module, {}).get(plan.fingerprint())
        if rt is None:
            raise RuntimeShardingError("functional_call has not run this module with this plan yet")
        return rt.exe
    eng = unwrap_compiled(module).__dict__.get(_ATTR)  # torch.compile(model): the module it wraps
    if eng is None:
        raise RuntimeShardingError("this module is not sharded; call shardplan.shard(module, plan) first")
    return eng


# -- start-up checks --------------------------------------------------------------------------------

def _world() -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeShardingError(
            "shardplan.shard() needs an initialised torch.distributed process group: run under torchrun and call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first (world size 1 works too)")
    return dist.get_world_size(), dist.get_rank()


def _check_module(module: nn.Module, plan: Plan) -> tuple[dict[str, list[tuple[nn.Module, str]]], list[str]]:
    """({plan name: [(owner module, attribute)]}, problems)."""
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
        if tuple(p.shape) != pp.global_shape:
            problems.append(f"  {name}: module has shape {tuple(p.shape)}, plan has {pp.global_shape}")
        if str(p.dtype).replace("torch.", "") != pp.dtype:
            problems.append(f"  {name}: module has dtype {p.dtype}, plan has {pp.dtype}")
        slots.setdefault(pp.name, []).append((mods[owner], attr))
    problems += [f"  {p.name}: in the plan, not in the module" for p in plan.params if p.name not in slots]
    return slots, problems


def _fingerprints(module: nn.Module, plan: Plan) -> Optional[list[list[float]]]:
    """Two float64 sums per planned parameter (all elements; every 7th), or None on the meta device."""
    named = dict(module.named_parameters())
    ts = [named.get(p.name) for p in plan.params]
    if any(t is None or t.device.type == "meta" for t in ts):
        return None
    with torch.no_grad():
        sums = [torch.stack([t.sum(dtype=torch.float64), t.reshape(-1)[::7].sum(dtype=torch.float64)])
                for t in ts]
    return torch.stack(sums).cpu().tolist() if sums else []


def _differing(plan: Plan, reports: list[dict]) -> Optional[str]:
    """Name the parameters whose values differ between ranks (seen from the start-up fingerprints)."""
    prints = [(r["rank"], r.get("values")) for r in reports if r.get("values") is not None]
    if len(prints) < 2:
        return None
    r0, base = prints[0]
    bad = []
    for i, p in enumerate(plan.params):
        # [Note: exact]: the same values on the same kind of device sum to the same bits; a tolerance
        # only guards against a reduction order that differs between ranks (different thread counts)
        others = [r for r, v in prints[1:] if any(abs(a - b) > 1e-9 * (1 + abs(a)) for a, b in zip(base[i], v[i]))]
        if others:
            bad.append(f"{p.name} (rank {r0} vs ranks {others})")
    if not bad:
        return None
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return (f"the ranks' models differ before sharding: {', '.join(bad[:5])}{more} hold different values. Sharding "
            f"would train a mix of them (replicated parameters would drift apart). Build the model with the same "
            f"seed on every rank (torch.manual_seed before constructing it), load the same weights everywhere, or "
            f"pass shard(..., sync_module_states=True) to broadcast rank 0's values")


def _startup(module: nn.Module, plan: Plan, world: int, rank: int, timeout_s: float, problems: Optional[list] = None,
             check_values: bool = False):
    """Local checks on every rank, then one bounded exchange of their findings and plans: a problem on any
    rank raises on every rank, naming it, before the first collective. ``check_values``: the parameters'
    values must agree across ranks too (a cheap fingerprint)."""
    problems = list(problems or [])
    try:
        from ..plan.validate import validate
        validate(plan)  # an edited or hand-written plan is checked before anything runs
    except ShardingError as exc:
        problems.append(f"the plan is invalid: {exc}")
    if world != plan.mesh.size:
        problems.append(f"the plan's mesh {plan.mesh!r} has {plan.mesh.size} ranks but the world size is {world}; "
                        f"plan again with a mesh whose axis sizes multiply to {world}")
    slots, mismatch = _check_module(module, plan)
    if mismatch:
        more = f"\n  ... and {len(mismatch) - 40} more" if len(mismatch) > 40 else ""
        problems.append("the module does not match the plan:\n" + "\n".join(mismatch[:40]) + more +
                        "\nbuild the plan from this module (shardplan.plan(module, ...))")
    mine = {"rank": rank, "problems": problems, "fingerprint": plan.fingerprint(), "summary": plan.summary()}
    if check_values and not mismatch and world > 1:
        mine["values"] = _fingerprints(module, plan)
    reports = C.exchange(mine, timeout_s)
    differ = _differing(plan, reports) if check_values else None
    if differ:
        reports[0]["problems"] = reports[0]["problems"] + [differ]
    failed = [r for r in reports if r["problems"]]
    if failed:
        detail = "\n".join(f"rank {r['rank']}: " + "\n".join(r["problems"]) for r in failed)
        raise RuntimeShardingError(f"shardplan.shard() failed on rank(s) {[r['rank'] for r in failed]}:\n{detail}")
    prints: dict[str, list[int]] = {}
    for r in reports:
        prints.setdefault(r["fingerprint"], []).append(r["rank"])
    if len(prints) > 1:
        first = {fp: next(r["summary"] for r in reports if r["fingerprint"] == fp) for fp in prints}
        a, b = list(first.values())[:2]
        diff = [f"{k}: {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b.get(k)] or ["layouts or schedule details"]
        who = "; ".join(f"ranks {rs} have {fp}" for fp, rs in prints.items())
        raise RuntimeShardingError(f"ranks hold different plans ({who}); they differ in {', '.join(diff)}. Build the "
                                   f"plan the same way on every rank (same model, rules, mesh and options)")
    return slots


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


def _tp_local(plan: Plan, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """The block of ``full`` that ``rank``'s tensor-parallel group member computes with."""
    p = plan.param(name)
    if p.tp_dim < 0:
        return full
    size = p.shape[p.tp_dim]
    return full.narrow(p.tp_dim, plan.mesh.axis_index(rank, (p.tp_axis,)) * size, size)


# -- shard ---------------------------------------------------------------------------------------------

def shard(module: nn.Module, plan: Plan, *, init_fn: Optional[Callable[[nn.Module], None]] = None,
          timeout_s: float = 300.0, sync_buffers: bool = True, sync_module_states: bool = False) -> nn.Module:
    """Shard ``module`` in place by ``plan`` and return it: its parameters become this rank's shards.

    >>> model = shardplan.shard(model, plan)        # inside torchrun, after init_process_group
    >>> opt = torch.optim.AdamW(model.parameters())  # steps the local shards

    Every rank checks the world, the module and the plan, and all ranks exchange their findings before
    the first collective: a problem on one rank raises on all of them within ``timeout_s``, which also
    bounds every collective on gloo (on NCCL, the process groups' timeout). Ranks whose parameters hold
    different values (models built with different seeds) are refused, naming the parameters; with
    ``sync_module_states=True`` rank 0's values are broadcast instead (FSDP1's option of that name).
    """
    if _ATTR in module.__dict__:
        raise RuntimeShardingError("this module is already sharded; build a fresh module to shard it again")
    world, rank = _world()
    slots = _startup(module, plan, world, rank, timeout_s, check_values=not sync_module_states)
    backend = dist.get_backend()
    device, meta = _device_for(module, backend)
    groups = C.build_groups(plan, rank, backend, timeout_s)
    if sync_module_states and world > 1 and not meta:
        with torch.no_grad():
            for n, places in slots.items():
                C.broadcast(getattr(places[0][0], places[0][1]).data, 0, groups.world)
    meshes = TP.device_meshes(plan, device) if TP.active_modules(plan) else {}
    wrappers = TP.param_wrappers(plan, meshes) if meshes else {}
    originals = {n: getattr(places[0][0], places[0][1]) for n, places in slots.items()}  # by plan name
    modules = dict(module.named_modules())
    units, modules_of, unit_slots = [], {}, {}
    for up in plan.units:
        bufs = [BufferState(plan, plan.buffers[i], rank, device) for i in up.buffers]
        names = [n for b in bufs for n in b.bp.params]
        if meta:  # one unit at a time: the full unit exists only while its shards are cut out
            from .init import materialize_unit
            owners = [m for n in names for m, _ in slots[n][:1]]
            attr_of = {n: (lambda _n=n: getattr(slots[_n][0][0], slots[_n][0][1]).detach()) for n in names}
            unit_full = materialize_unit(owners, names, attr_of, init_fn, device)
        else:
            unit_full = {n: originals[n].detach() for n in names}
        for b in bufs:
            b.fill_local([_tp_local(plan, n, unit_full[n], rank) for n in b.bp.params])
            b.make_params([wrappers.get(n) for n in b.bp.params])
            # the objects the user holds (an optimizer built before shard()) become the local shards
            b.local = [identity.adopt(originals[n], lp, n) for n, lp in zip(b.bp.params, b.local)]
        del unit_full
        u = UnitRuntime(up.name, bufs)
        unit_slots[up.name] = [(m, attr, lp, fp) for b in bufs for pp, lp, fp in zip(b.infos, b.local, b.full_params)
                               for m, attr in slots[pp.name]]
        for m, attr, lp, _ in unit_slots[up.name]:
            m._parameters[attr] = lp  # drops the module's full tensors (meta init: the only full copy of this unit)
        units.append(u)
        if up.name != ROOT:
            modules_of[up.name] = [modules[m] for m in up.module_paths]
    del originals
    identity.sharded()
    face = ModuleFace(unit_slots)
    face.attach(units, plan)
    exe = Executor(plan, units, groups, device, rank, timeout_s, face)
    for lp in face.by_index.values():
        lp._shardplan_engine = weakref.ref(exe)  # who steps it (fully_shard_optimizer checks)
    exe.handles = install(module, exe, modules_of) + TP.install_styles(module, plan, meshes)
    exe.handles += SD.install(module, exe, meshes)  # model.state_dict() in DTensors, as FSDP2 gives it
    module.__dict__[_ATTR] = exe
    guard_apply(module)  # .to(bf16)/.half()/.cuda() from now on raise instead of detaching the shards
    if sync_buffers and world > 1:
        for b in module.buffers():
            if b.device.type != "meta":
                C.broadcast(b.data, 0, groups.world)
    if meshes:  # after initialisation: the states the first forward draws from
        TP.align_generators(plan, groups.world, device)
        exe.handles.append(TP.install_input_check(module, plan, groups.world, device))
    exe._account()
    return module


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
def record_ops(module: nn.Module, plan: Optional[Plan] = None):
    """Record the schedule ops the runtime runs: ``with record_ops(m) as ops: ...`` -> [Op, ...], the plan's
    own op objects (compare with ``plan.ops(...)``). With ``plan``: the functional face's runtime."""
    eng = engine_of(module, plan)
    ops: list = []
    prev, eng.record = eng.record, ops
    try:
        yield ops
    finally:
        eng.record = prev


def mark_shards_changed(module: nn.Module) -> None:
    """Say that the local shards were changed outside an optimizer step, so ZeRO-0/1/2 gather them again
    before the next forward (checkpoint loading does this itself)."""
    engine_of(module).mark_shards_changed()


def compile_units(module: nn.Module, **compile_kwargs) -> nn.Module:
    """``torch.compile`` each unit's forward in place, hooks staying outside (torchtitan's per-block compile).

    >>> model = shardplan.compile_units(shardplan.shard(model, plan), backend="inductor")

    The runtime's hooks never enter a compiled graph, so gathers, frees and reductions run exactly as
    planned. ``torch.compile(model)`` works too: every hook is a graph break, which splits the graph at
    each unit boundary the same way.
    """
    eng = engine_of(module)
    from ..units import entry_points
    unit_paths = [p for u in eng.plan.units[1:] for p in u.module_paths]
    for up in eng.plan.units[1:]:
        for path in (e for p in up.module_paths for e in entry_points(module, p, unit_paths)):
            m = module.get_submodule(path)  # a container without a forward: the submodules it is run through
            m.forward = torch.compile(m.forward, **compile_kwargs)
    return module


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0, foreach: Optional[bool] = None) -> torch.Tensor:
    """Clip the gradients of the local shards by the *global* norm over all ranks; returns that norm.

    >>> norm = shardplan.clip_grad_norm_(model, 1.0)   # like torch.nn.utils.clip_grad_norm_, over every rank
    """
    eng = engine_of(module)
    norm_type = float(norm_type)
    dev = eng.device
    world = eng.groups.world
    grads: list[torch.Tensor] = []
    if norm_type == math.inf:
        local = torch.zeros((), device=dev)
        for b in eng.buffer.values():
            for lp in b.local:
                if lp.grad is not None and lp.grad.numel():
                    local = torch.maximum(local, lp.grad.detach().abs().max().float())
                    grads.append(lp.grad)
        total = local.clone()
        C.all_reduce(total, world, async_op=False, op=dist.ReduceOp.MAX)
    else:
        acc = torch.zeros((), dtype=torch.float64 if dev.type == "cpu" else torch.float32, device=dev)
        for b in eng.buffer.values():
            held = [(lp.grad, info.name) for lp, info in zip(b.local, b.infos) if lp.grad is not None and lp.grad.numel()]
            if not held:
                continue
            gs = [g for g, _ in held]
            grads += gs
            norms = torch._foreach_norm(gs, norm_type) if foreach is not False else [torch.linalg.vector_norm(g, norm_type) for g in gs]
            # each element is held by `replicas` ranks (copies across data replicas and compute axes that
            # replicate it): count it once
            weights = torch.tensor([1.0 / eng.plan.replicas(n) for _, n in held], dtype=acc.dtype, device=dev)
            acc = acc + (torch.stack([n.to(acc.dtype) for n in norms]).pow(norm_type) * weights).sum()
        C.all_reduce(acc, world, async_op=False, op=dist.ReduceOp.SUM)
        total = acc.pow(1.0 / norm_type)
    total = total.float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total


def memory_stats(module: nn.Module) -> dict[str, int]:
    """Bytes the runtime holds for parameters and gradients now, and the peak since tracking began."""
    eng = engine_of(module)
    eng.track_memory = True
    eng._account()
    return {"live": eng.live_bytes, "peak": eng.peak_live_bytes}


def reset_peak(module: nn.Module) -> None:
    """Start tracking live bytes (costs O(units) per op while on) and reset the peak."""
    eng = engine_of(module)
    eng.track_memory = True
    eng._account()
    eng.peak_live_bytes = eng.live_bytes
