"""One runtime from one plan: every face builds here.

``shard`` (and through it ``fully_shard`` and ``fully_shard_model``), the functional face
(``functional_call`` / ``value_and_grad``) and ``unshard_tree`` all get their process groups, start-up
checks, device, tensor-parallel meshes and per-unit buffers from :func:`build`; what differs between
faces is only how a unit's buffers are filled (from the module's parameters, or left to the caller's
local tree) and which face the executor serves (runtime/faces.py).

>>> rt = build(module, plan, timeout_s=300.0)                       # checks, groups, device
>>> units = rt.make_units(lambda up, bufs: [b.make_params() for b in bufs])
>>> exe = Executor(plan, units, rt.groups, rt.device, rt.rank, 300.0, face)
"""

from __future__ import annotations

import os

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..planner import Plan, UnitPlan
from ..planner.schedule import ROOT
from . import collectives as C
from . import tensor_parallel as TP
from .buffers import BufferState
from ..errors import RuntimeShardingError
from .seams import unwrap_compiled
from .startup import Slots, device_for, startup, world_and_rank
from .unit import UnitRuntime

if TYPE_CHECKING:  # pragma: no cover
    from .executor import Executor

ATTR = "_shardplan"  # module.__dict__ key of the executor shard() attaches
FULLY_SHARD_MARK = "_shardplan_fully_shard"  # module.__dict__ key of fully_shard's options (dropin/marks.py: _MARK)
FIRST_USE: list = []  # fully_shard's compile at first use, registered by dropin/compile.py
_GROUPS: dict[str, tuple[object, C.Groups]] = {}
FUNCTIONAL_ATTR = "_shardplan_functional"
"""module.__dict__ key of {plan fingerprint: the functional face's runtime of that pair} (runtime/functional.py).
[Note: on the module, not in a weak-keyed cache: a runtime refers to its modules (the parameters' owners,
the root included when it owns one), and a weak-keyed cache's value that refers to its key keeps it alive
for ever; a module <-> runtime cycle is collected with the module.]"""


class _Runtimes(dict):
    """The functional face's runtimes of one module. A copy or a pickle of the module carries none: a
    runtime belongs to the module it was made for (its process groups, buffers and hooks), and
    ``copy.deepcopy(model)`` / ``torch.save(model)`` must work after a functional call as before it."""

    def __deepcopy__(self, memo):
        return _Runtimes()

    def __reduce__(self):
        return (_Runtimes, ())


def functional_runtimes(module: nn.Module) -> dict:
    """{plan fingerprint: runtime} of ``module`` for the functional face (made empty on first use)."""
    return module.__dict__.setdefault(FUNCTIONAL_ATTR, _Runtimes())


def engine_of(module: nn.Module, plan: Optional[Plan] = None) -> "Executor":
    """The executor running ``module``'s plan (``shard`` attaches it; with ``plan``, the one
    ``functional_call(module, plan, ...)`` made)."""
    if plan is not None:
        rt = module.__dict__.get(FUNCTIONAL_ATTR, {}).get(plan.fingerprint())
        if rt is None:
            raise RuntimeShardingError("functional_call has not run this module with this plan yet")
        return rt.exe
    module = unwrap_compiled(module)  # torch.compile(model): the module it wraps
    eng = module.__dict__.get(ATTR)
    if eng is None and FULLY_SHARD_MARK in module.__dict__:
        # [Note: a fully_shard model before its first use] its plan compiles at the first use (dropin/compile.py); a
        # shardplan function (full_state_dict, checkpoint.save, ...) is a use, as FSDP2 allows them right after
        # fully_shard
        for compile_plan in FIRST_USE:
            compile_plan(module)
        eng = module.__dict__.get(ATTR)
        root = module.__dict__[FULLY_SHARD_MARK].get("root")
        if eng is None and root is not None and root is not module:
            raise RuntimeShardingError(
                f"this {type(module).__name__} is one fully_shard unit of a larger model, whose plan was compiled on "
                f"its root ({type(root).__name__}); pass the root model (the last module fully_shard was called on)")
    if eng is None:
        raise RuntimeShardingError("this module is not sharded; call shardplan.shard(module, plan) first")
    return eng


def groups_for(plan: Plan, timeout_s: float = 300.0) -> C.Groups:
    """The plan's process groups, made once per plan and default process group (every rank asks in the
    same order, so every rank creates the same groups in the same order)."""
    # [Note: SHARDPLAN_SINGLETON_GROUPS is part of the key: groups of one are made real or not by it, and a
    # process that shards the same plan both ways (benchmarks comparing the paths) must get both]
    key = (plan.fingerprint(), os.environ.get("SHARDPLAN_SINGLETON_GROUPS") == "1")
    world_pg = dist.distributed_c10d._get_default_group()
    held = _GROUPS.get(key)
    if held is None or held[0] is not world_pg:  # a new init_process_group: the old groups are gone
        held = _GROUPS[key] = (world_pg, C.build_groups(plan, dist.get_rank(), dist.get_backend(), timeout_s))
    return held[1]


@dataclass
class Runtime:
    """What one plan needs on this rank before a face fills its buffers."""

    plan: Plan
    module: nn.Module
    world: int
    rank: int
    device: torch.device
    meta: bool                      # the module's parameters are on the meta device
    slots: Slots                    # plan name -> where the module holds it
    groups: C.Groups
    meshes: dict = field(default_factory=dict)     # tensor parallelism: compute axis -> DeviceMesh
    wrappers: dict = field(default_factory=dict)   # tensor parallelism: plan name -> full tensor -> DTensor
    modules_of: dict = field(default_factory=dict)  # unit -> the modules whose hooks report its events

    def make_units(self, fill: Callable[[UnitPlan, list[BufferState]], None]) -> list[UnitRuntime]:
        """Each unit's buffers, filled by ``fill(unit plan, buffers)`` one unit at a time (a unit's full
        tensors exist only while it is filled: meta initialisation materialises one unit at a time)."""
        units = []
        for up in self.plan.units:
            bufs = [BufferState(self.plan, self.plan.buffers[i], self.rank, self.device) for i in up.buffers]
            fill(up, bufs)
            units.append(UnitRuntime(up.name, bufs))
        return units


def build(module: nn.Module, plan: Plan, *, timeout_s: float = 300.0, problems: Sequence[str] = (),
          check_values: bool = False, face: str = "shardplan.shard()") -> Runtime:
    """Start-up checks on every rank (``problems`` found by the caller join them), then the device, the
    process groups and the tensor-parallel meshes. No buffers yet: see :meth:`Runtime.make_units`."""
    world, rank = world_and_rank()
    slots = startup(module, plan, world, rank, timeout_s, list(problems), check_values=check_values, face=face)
    device, meta = device_for(module, dist.get_backend())
    groups = groups_for(plan, timeout_s)
    meshes = TP.device_meshes(plan, device) if TP.active_modules(plan) else {}
    modules = dict(module.named_modules())
    modules_of = {up.name: [modules[m] for m in up.module_paths] for up in plan.units if up.name != ROOT}
    return Runtime(plan, module, world, rank, device, meta, slots, groups, meshes,
                   TP.param_wrappers(plan, meshes) if meshes else {}, modules_of)
