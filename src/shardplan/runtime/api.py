"""The runtime's public functions: ``shard``, ``no_sync``, ``set_requires_gradient_sync``, ``clip_grad_norm_``,
``record_ops``."""

from __future__ import annotations

import contextlib
import functools
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
from . import tp_checks as TPC
from . import state_dict as SD
from . import norms as NORMS
from . import dtensor_params as DP
from .builder import ATTR as _ATTR, build, engine_of
from .executor import Executor
from .startup import device_for, tp_local
from .streams import join
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
          timeout_s: float = 300.0, sync_buffers: bool = True, sync_module_states: bool = False,
          dtensor_params: bool = False) -> nn.Module:
    """Shard ``module`` in place by ``plan`` and return it: its parameters become this rank's shards.

    >>> model = shardplan.shard(model, plan)        # inside torchrun, after init_process_group
    >>> opt = torch.optim.AdamW(model.parameters())  # steps the local shards

    Every rank checks the world, the module and the plan, and all ranks exchange their findings before
    the first collective: a problem on one rank raises on all of them within ``timeout_s``, which also
    bounds every collective on gloo (on NCCL, the process groups' timeout). Ranks whose parameters hold
    different values (models built with different seeds) are refused, naming the parameters; with
    ``sync_module_states=True`` rank 0's values are broadcast instead (FSDP1's option of that name).

    ``dtensor_params=True`` (what ``fully_shard`` does): the module's parameters are FSDP2's DTensor
    parameters over this rank's shards (global ``shape``, ``full_tensor()``, DTensor gradients), for a plan
    whose every parameter is a ``torch.chunk`` piece (``layout="chunked"``); see docs/checkpoint.md.
    """
    if _ATTR in module.__dict__:
        raise RuntimeShardingError("this module is already sharded; build a fresh module to shard it again")
    if dtensor_params:
        DP.check(plan, SD.describe(plan))  # a plan whose shards cannot be DTensors: refused before any work
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
    exe.root = weakref.ref(module)
    offload.attach(exe)  # CPU offload: host master shards and optimizer state (None without it)
    _install(module, plan, exe, rt, face, unit_slots, dtensor_params=dtensor_params, sync_buffers=sync_buffers)
    exe._account()
    return module


def _install(module: nn.Module, plan: Plan, exe: Executor, rt, face: ModuleFace, unit_slots: dict, *,
             dtensor_params: bool, sync_buffers: bool) -> None:
    """What ``shard`` installs once the executor exists: state dict hooks, the DTensor parameters, the module and
    tensor hooks, the styles, the flow check and the axes; the FSDP2 method, the guards, the buffers broadcast."""
    meshes, device = rt.meshes, rt.device
    exe.state_dict_hooks = SD.StateDictHooks(exe, meshes)  # (SD.install below installs it on the modules)
    if dtensor_params:  # FSDP2's DTensor parameters over the same shards (dtensor_params.py)
        DP.install(exe, face, exe.state_dict_hooks, unit_slots)
    for lp in face.by_index.values():
        lp._shardplan_engine = weakref.ref(exe)  # who steps it (fully_shard_optimizer checks)
    for b in exe.buffer.values():  # torch.nn.utils.clip_grad_norm_ on the local gradients: the global norm (norms.py)
        b.grad_owner = None if dtensor_params else exe  # (DTensor gradients are DTensor's; scalars stay plain)
    exe.handles = install(module, exe, rt.modules_of) + TP.install_styles(module, plan, meshes, exe)
    exe.handles += SD.install(module, exe, meshes)  # model.state_dict() in DTensors, as FSDP2 gives it
    exe.handles += FG.install(module, plan, TP.active_modules(plan))  # what cp or tp would compute per rank
    # (the axes after the flow check: cp's hooks nest around its mode, see runtime/context_parallel.py)
    exe.handles += AXES.install(module, plan, rt.groups, exe)  # expert modules, cp attention, ... (runtime/axes.py)
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
        TPC.align_generators(plan, rt.groups.world, device)
        exe.handles.append(TPC.install_input_check(module, plan, rt.groups.world, device))
        exe.partial_check = TPC.PartialCheck(plan, rt.groups.world, device)


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


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0, foreach: Optional[bool] = None) -> torch.Tensor:
    """Clip the gradients of the local shards by the *global* norm over all ranks; returns that norm.

    >>> norm = shardplan.clip_grad_norm_(model, 1.0)   # like torch.nn.utils.clip_grad_norm_, over every rank
    """
    eng = engine_of(module)
    if getattr(eng, "offload", None) is not None:  # host steps that already used the gradients: refuse
        eng.offload.check_clip()
    norm_type = float(norm_type)
    groups = [[(g, m.name) for m in b.members for g in (DP.plain(m.local.grad),) if g is not None and g.numel()]
              for b in eng.buffer.values()]
    groups = [g for g in groups if g]
    grads = [g for group in groups for g, _ in group]
    total = NORMS.global_norm(eng, groups, norm_type, foreach)
    total = total.float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    host = getattr(eng, "offload", None)
    current = host.copies_current() if host is not None else set()  # the host copies the scaling leaves current
    if grads and host is not None and host.cuda:  # the gradients' copies to the host (a side stream) read them
        join(host.d2h_stream)  # first: scaled under them, the host step
        # would scale the scaled gradients again
    if grads:
        with torch._C.DisableTorchFunctionSubclass():  # the gradients are norms.ShardGrad: plain here
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    if host is not None:  # the host copies of the gradients are scaled alike
        eng.offload.grads_scaled(coef.to(grads[0].dtype) if grads else coef, current)
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
