"""The runtime's public functions: ``shard``, ``no_sync``, ``set_requires_gradient_sync``, ``clip_grad_norm_``,
``record_ops``."""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import FP8UnavailableError, RuntimeShardingError
from ..planner import Plan
from . import axes as AXES
from . import collectives as C
from . import flow_guard as FG
from . import tensor_parallel as TP
from . import state_dict as SD
from .builder import ATTR as _ATTR, build, engine_of
from .executor import Executor
from .startup import device_for, tp_local
from .seams import guard_apply
from .faces import ModuleFace
from . import identity
from . import offload
from .hooks import install
from .. import fp8
from .init import materialize_unit
from ..fp8 import weight_maker
from ..units import entry_points



# -- shard ---------------------------------------------------------------------------------------------

def _build_fp8(module: nn.Module, plan: Plan, timeout_s: float, check_values: bool):
    """:func:`build`, after the plan's FP8 Linears are converted (``plan.fp8_modules``, :mod:`shardplan.fp8`).

    [Note: one rank without FP8] the conversion's problem (no torchao, no float8 matmuls) joins the start-up
    checks, so every rank raises together instead of the others waiting at the first collective; the rank
    that found it raises its own FP8UnavailableError (naming the install or the device)."""
    mine = None
    if plan.fp8_modules:
        try:
            fp8.convert(module, plan, device_for(module, dist.get_backend())[0])
        except FP8UnavailableError as exc:
            mine = exc
    try:
        return build(module, plan, timeout_s=timeout_s, check_values=check_values,
                     problems=[str(mine)] if mine else [])
    except RuntimeShardingError as exc:
        if mine is not None:
            raise mine from exc
        raise


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
    rt = _build_fp8(module, plan, timeout_s, not sync_module_states)
    slots, rank, device = rt.slots, rt.rank, rt.device
    if sync_module_states and rt.world > 1 and not rt.meta:
        with torch.no_grad():
            for n, places in slots.items():
                C.broadcast(getattr(*places[0]).data, 0, rt.groups.world)
    originals = {n: getattr(*places[0]) for n, places in slots.items()}  # by plan name: what the user holds
    unit_slots = {}

    def fill(up, bufs):
        names = [n for b in bufs for n in b.bp.params]
        if rt.meta:  # one unit at a time: the full unit exists only while its shards are cut out
            owners = [m for n in names for m, _ in slots[n][:1]]
            attr_of = {n: (lambda _n=n: getattr(*slots[_n][0]).detach()) for n in names}
            unit_full = materialize_unit(owners, names, attr_of, init_fn, device)
        else:
            unit_full = {n: originals[n].detach() for n in names}
        for b in bufs:
            b.fill_local([tp_local(plan, n, unit_full[n], rank) for n in b.bp.params])
            b.make_params([rt.wrappers.get(n) for n in b.bp.params], float8 if b.tw else None)
            # the objects the user holds (an optimizer built before shard()) become the local shards
            for m in b.members:
                m.local = identity.adopt(originals[m.name], m.local, m.name)
        del unit_full
        unit_slots[up.name] = [(owner, attr, m.local, m.full) for b in bufs for m in b.members
                               for owner, attr in slots[m.name]]
        for m, attr, lp, _ in unit_slots[up.name]:
            m._parameters[attr] = lp  # drops the module's full tensors (meta init: the only full copy of this unit)

    float8 = None
    if any(b.tensorwise for b in plan.buffers):  # FP8 compute's float8 gathers: torchao's tensors over them
        float8 = weight_maker(slots)
    units = rt.make_units(fill)
    identity.sharded()
    face = ModuleFace(unit_slots)
    face.attach(units, plan)
    exe = Executor(plan, units, rt.groups, device, rank, timeout_s, face)
    offload.attach(exe)  # CPU offload: host master shards and optimizer state (None without it)
    for lp in face.by_index.values():
        lp._shardplan_engine = weakref.ref(exe)  # who steps it (fully_shard_optimizer checks)
    _LIVE.add(exe)
    _patch_torch_norms()  # torch.nn.utils.clip_grad_norm_ on the local shards: the global norm, as with DTensors
    meshes = rt.meshes
    exe.handles = install(module, exe, rt.modules_of) + TP.install_styles(module, plan, meshes, exe)
    exe.handles += SD.install(module, exe, meshes)  # model.state_dict() in DTensors, as FSDP2 gives it
    exe.handles += AXES.install(module, plan, rt.groups, exe)  # expert modules, cp attention, ... (runtime/axes.py)
    exe.handles += FG.install(module, plan, TP.active_modules(plan))  # what cp or tp would compute per rank
    module.__dict__[_ATTR] = exe
    if not hasattr(type(module), "set_requires_gradient_sync"):  # fully_shard's modules have their own
        # FSDP2's method on the sharded module, so code written for FSDP2 (torchtitan's accumulation) runs as is
        module.__dict__["set_requires_gradient_sync"] = functools.partial(set_requires_gradient_sync, module)
    guard_apply(module)  # .to(bf16)/.half()/.cuda() from now on raise instead of detaching the shards
    if sync_buffers and rt.world > 1:
        for b in module.buffers():
            if b.device.type != "meta":
                C.broadcast(b.data, 0, rt.groups.world)
    if meshes:  # after initialisation: the states the first forward draws from
        TP.align_generators(plan, rt.groups.world, device)
        exe.handles.append(TP.install_input_check(module, plan, rt.groups.world, device))
        exe.partial_check = TP.PartialCheck(plan, rt.groups.world, device)
    exe._account()
    return module


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
    """FSDP2's switch for gradient accumulation on a module sharded with :func:`shard` (``shard`` also binds it
    as ``module.set_requires_gradient_sync``): ``False`` skips the gradient reductions of the backwards that
    follow, which accumulate unreduced, until a backward after ``set_requires_gradient_sync(True)`` reduces the
    sum, as :func:`no_sync` does around a block. One plan synchronises the whole model at once, so ``recurse``
    changes nothing (FSDP2 sets the flag module by module; the numbers are the same)."""
    if not isinstance(requires_gradient_sync, bool):
        raise RuntimeShardingError(f"set_requires_gradient_sync({requires_gradient_sync!r}): pass True or False")
    engine_of(module).sync = requires_gradient_sync


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Micro-steps inside skip the gradient reduction; gradients accumulate unreduced until the next
    backward outside it, which reduces the sum (like DDP's ``no_sync``).

    >>> with sp.no_sync(model):
    ...     model(x1).sum().backward()          # accumulates, no reduction
    >>> model(x2).sum().backward()              # reduces the sum of both
    """
    eng = engine_of(module)
    prev, eng.sync = eng.sync, False
    try:
        yield
    finally:
        eng.sync = prev


@contextlib.contextmanager
def record_ops(module: nn.Module, plan: Optional[Plan] = None) -> Iterator[list]:
    """Record the schedule ops the runtime runs: ``with record_ops(m) as ops: ...`` -> [Op, ...], the plan's
    own op objects (compare with ``plan.ops(...)``). With ``plan``: the functional face's runtime.
    [Note: context- and expert-parallel ops are recorded by ``attention()`` and ``dispatch``/``combine``,
    one call per module and step: a module that calls them twice records its first call's ops twice.]

    >>> with sp.record_ops(model) as ops:
    ...     model(x).sum().backward()
    >>> [(o.kind, o.unit) for o in ops][:2]       # the plan's ops, in the order they ran
    """
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
    unit_paths = [p for u in eng.plan.units[1:] for p in u.module_paths]
    for up in eng.plan.units[1:]:
        for path in (e for p in up.module_paths for e in entry_points(module, p, unit_paths)):
            m = module.get_submodule(path)  # a container without a forward: the submodules it is run through
            m.forward = torch.compile(m.forward, **compile_kwargs)
    return module


# -- torch's own gradient norm over local shards --------------------------------------------------------

_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # the executors of every sharded module alive
_TORCH_NORM: list = []  # torch.nn.utils' get_total_norm, before it was wrapped


def _owners(tensors: list) -> Optional[tuple]:
    """``(executor, [parameter name per tensor])`` when every tensor is the gradient of one sharded model's
    local shard; ``None`` when none is; raises when some are (or they span several models)."""
    owner = {}
    for exe in list(_LIVE):
        for name, lp in exe.local_params().items():
            if lp.grad is not None:
                owner[id(lp.grad)] = (exe, name)
    found = [owner.get(id(t)) for t in tensors]
    if not any(found):
        return None
    engines = {id(f[0]) for f in found if f is not None}
    if None in found or len(engines) > 1:
        raise RuntimeShardingError(
            "torch.nn.utils.clip_grad_norm_ / get_total_norm: the gradients given mix local shards of a shardplan-"
            "sharded model with other tensors (or with another sharded model's); their norm would be neither this "
            "rank's nor the global one. Clip each sharded model on its own: shardplan.clip_grad_norm_(model, "
            "max_norm) or torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)")
    return found[0][0], [f[1] for f in found]


def _sharded_total_norm(exe, grads: list, names: list, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    """The norm of the full gradients whose local shards are ``grads``, over every rank (each element once)."""
    if getattr(exe, "offload", None) is not None:
        raise RuntimeShardingError("torch.nn.utils.clip_grad_norm_ on a model whose optimizer is offloaded: the host "
                                   "copies of the gradients must be scaled too; use shardplan.clip_grad_norm_(model, "
                                   "max_norm)")
    if not (norm_type > 0):  # -inf, 0 and negative orders have no sum of powers over the ranks' pieces
        raise RuntimeShardingError(f"torch.nn.utils.clip_grad_norm_ / get_total_norm over a sharded model's gradients: "
                                   f"norm_type={norm_type} is not supported; use a positive order or inf")
    held = [(g.detach(), n) for g, n in zip(grads, names) if g.numel()]
    total = _global_norm(exe, [held] if held else [], norm_type)
    # torch's dtype: that of the per-tensor norms stacked (promoted over the gradients' dtypes)
    floats = {g.dtype for g in grads if g.is_floating_point()}
    total = total.to(functools.reduce(torch.promote_types, floats) if floats else torch.float32)
    if error_if_nonfinite and not torch.isfinite(total).item():
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
                           f"cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                           f"anyway, set `error_if_nonfinite=False`")
    return total


def _norm_weights(eng, names: tuple, dtype, dev) -> torch.Tensor:
    """``1 / replicas`` per parameter, on the device: made once per group of names (a host-to-device copy per step
    would also stop a captured step, shardplan.capture, which cannot copy from pageable host memory)."""
    cache = eng.__dict__.setdefault("_norm_weights", {})
    key = (names, dtype, dev)
    w = cache.get(key)
    if w is None:
        w = cache[key] = torch.tensor([1.0 / eng.plan.replicas(n) for n in names], dtype=dtype, device=dev)
    return w


def _global_norm(eng, groups: list, norm_type: float, foreach: Optional[bool] = None) -> torch.Tensor:
    """The norm over every rank of the full gradients whose local pieces are in ``groups`` (lists of
    ``(gradient, parameter name)``, each a buffer's): each element counts once, however many ranks hold it.
    One collective: every rank calls it."""
    dev, world = eng.device, eng.groups.world
    if norm_type == math.inf:
        total = torch.zeros((), device=dev)
        for held in groups:
            norms = torch._foreach_norm([g for g, _ in held], norm_type)
            total = torch.maximum(total, torch.stack([t.float() for t in norms]).max())
        C.all_reduce(total, world, async_op=False, op=dist.ReduceOp.MAX)
        return total
    acc = torch.zeros((), dtype=torch.float64 if dev.type == "cpu" else torch.float32, device=dev)
    for held in groups:
        gs = [g for g, _ in held]
        norms = torch._foreach_norm(gs, norm_type) if foreach is not False else \
            [torch.linalg.vector_norm(g, norm_type) for g in gs]
        # each element is held by `replicas` ranks (copies across data replicas and compute axes that
        # replicate it): count it once
        weights = _norm_weights(eng, tuple(n for _, n in held), acc.dtype, dev)
        acc = acc + (torch.stack([t.to(acc.dtype) for t in norms]).pow(norm_type) * weights).sum()
    C.all_reduce(acc, world, async_op=False, op=dist.ReduceOp.SUM)
    return acc.pow(1.0 / norm_type)


def _patch_torch_norms() -> None:
    """[Note: torch's clip_grad_norm_ on local shards] A shardplan model's parameters are this rank's shards as
    plain tensors, not FSDP2's DTensors, so torch's ``clip_grad_norm_(model.parameters(), ...)`` (and
    torchtitan's ``get_total_norm(grads)``) would return this rank's norm and clip each rank's shards by a
    different factor: silently wrong. Routed once: given local shards' gradients, it returns the global norm
    (one collective: every rank must call it, as with DTensors); any other tensors go to torch unchanged.

    The code of torch's function is swapped (as for ``register_fsdp_forward_method``, see dropin/), not
    only the module attributes: a name bound before the first ``shard()`` (``from torch.nn.utils import
    get_total_norm`` at the top of a training script) is the same function object, and it would otherwise
    keep returning this rank's norm."""
    if _TORCH_NORM:
        return
    import types
    from torch.nn.utils import clip_grad as CG
    public = CG._get_total_norm  # torch's @_no_grad wrapper (every name torch exports is this object)
    inner = getattr(public, "__wrapped__", None)
    if isinstance(inner, types.FunctionType) and not inner.__code__.co_freevars and \
            "_shardplan_total_norm" not in inner.__globals__:
        orig = types.FunctionType(inner.__code__, inner.__globals__, inner.__name__, inner.__defaults__)
    else:  # another torch layout: the module attributes only (names bound earlier keep torch's own)
        inner, orig = None, public
    _TORCH_NORM.append(orig)

    def total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        found = _owners(ts) if _LIVE else None
        if found is None:
            return orig(ts, norm_type, error_if_nonfinite, foreach)
        return _sharded_total_norm(found[0], ts, found[1], float(norm_type), error_if_nonfinite)

    if inner is not None:
        inner.__globals__["_shardplan_total_norm"] = total_norm

        def routed(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):  # runs in torch's module
            return _shardplan_total_norm(tensors, norm_type, error_if_nonfinite, foreach)  # noqa: F821

        inner.__code__ = routed.__code__
        return
    get_total_norm = functools.wraps(public)(total_norm)
    CG._get_total_norm = get_total_norm  # what clip_grad_norm_ calls
    torch.nn.utils.get_total_norm = get_total_norm
    if hasattr(CG, "get_total_norm"):
        CG.get_total_norm = get_total_norm


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0, foreach: Optional[bool] = None) -> torch.Tensor:
    """Clip the gradients of the local shards by the *global* norm over all ranks; returns that norm.

    >>> norm = shardplan.clip_grad_norm_(model, 1.0)   # like torch.nn.utils.clip_grad_norm_, over every rank
    """
    eng = engine_of(module)
    if getattr(eng, "offload", None) is not None:  # host steps that already used the gradients: refuse
        eng.offload.check_clip()
    norm_type = float(norm_type)
    groups = [[(m.local.grad, m.name) for m in b.members if m.local.grad is not None and m.local.grad.numel()]
              for b in eng.buffer.values()]
    groups = [g for g in groups if g]
    grads = [g for group in groups for g, _ in group]
    total = _global_norm(eng, groups, norm_type, foreach)
    total = total.float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    if getattr(eng, "offload", None) is not None:  # the host copies of the gradients are scaled alike
        eng.offload.grads_scaled(coef.to(grads[0].dtype) if grads else coef)
    return total


def memory_stats(module: nn.Module) -> dict[str, int]:
    """Bytes the runtime holds for parameters and gradients now, and the peak since tracking began.

    >>> sp.reset_peak(model); loss = model(x).sum(); loss.backward()
    >>> sp.memory_stats(model)          # {"live": ..., "peak": ...}: compare with plan.memory(rank).peak
    """
    eng = engine_of(module)
    eng.track_memory = True
    eng._account()
    return {"live": eng.live_bytes, "peak": eng.peak_live_bytes}


def reset_peak(module: nn.Module) -> None:
    """Start tracking live bytes (costs O(units) per op while on) and reset the peak.

    >>> sp.reset_peak(model)            # then a step, then sp.memory_stats(model)["peak"]
    """
    eng = engine_of(module)
    eng.track_memory = True
    eng._account()
    eng.peak_live_bytes = eng.live_bytes
