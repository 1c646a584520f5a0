"""shardplan: ZeRO-1/2/3 sharding for PyTorch, declared as data and inspectable before launch.

>>> import shardplan as sp
>>> plan = sp.plan(model, sp.Rules([(r".*norm.*", sp.P()), (r".*", sp.P("dp"))]), sp.Mesh(dp=8),
...                units=[r"layers\\.\\d+"])
>>> print(plan)

The language and the planner (``P``, ``Mesh``, ``Rules``, ``plan``, ``auto_rules``) import without torch;
the runtime (``shard``, ``checkpoint``, ``value_and_grad``, ...) is imported, with torch, on first use, so
that ``import shardplan`` and the ``shardplan`` command start at once.
"""

import importlib as _importlib
from importlib.util import find_spec as _find_spec

from .dtypes import import_torch as _import_torch  # torch-free: it imports torch when called
from .errors import (CheckpointError, CollectiveError, FP8UnavailableError, ForecastError, MeshError, PlanError, PlanWarning, RuleError,
                     RehearsalError, RuntimeShardingError, ShardingError, SpecError, UnmatchedParametersError,
                     UnusedRuleWarning)
from .mesh import Mesh
from .plan import BufferPlan, Memory, Op, ParamPlan, Plan, UnitPlan, plan
from .rules import Rules, explain, match
from .spec import P
from .auto import auto_rules
from . import forecast as _forecast  # torch-free; registers plan.forecast(...) (plan/facade.py: the planner never imports it)

__version__ = "0.1.0"

# name -> the module that defines it, imported (with torch) when the name is first read
_LAZY = {
    **dict.fromkeys(("clip_grad_norm_", "compile_units", "mark_shards_changed", "memory_stats", "no_sync",
                     "record_ops", "reset_peak", "shard"), "runtime"),
    **dict.fromkeys(("full_state_dict", "load_full_state_dict", "load_state_dict", "state_dict"), "runtime.checkpoint"),
    **dict.fromkeys(("functional_call", "grad", "unshard_tree", "value_and_grad"), "runtime.functional"),
    **dict.fromkeys(("assemble", "shard_tree"), "tree"),
    "clip_by_global_norm": "optim",
    **dict.fromkeys(("MixedPrecisionPolicy", "fully_shard", "fully_shard_model", "fully_shard_optimizer", "plan_of",
                     "register_fsdp_forward_method"), "dropin"),
    "run_main": "entry",
    **dict.fromkeys(("offload_optimizer", "OffloadAdamW"), "runtime.offload_optim"),
    **dict.fromkeys(("rehearse", "Rehearsal"), "rehearsal"),
}
_LAZY_MODULES = {"checkpoint": "runtime.checkpoint", "optim": "optim", "metrics": "metrics",
                 "expert_parallel": "runtime.expert_parallel", "context_parallel": "runtime.context_parallel"}


def __getattr__(name: str):
    if name in _LAZY or name in _LAZY_MODULES:
        _import_torch()  # quietly, before the runtime imports it
        if name in _LAZY_MODULES:
            value = _importlib.import_module(f".{_LAZY_MODULES[name]}", __name__)
        else:
            value = getattr(_importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name.isidentifier() and not name.startswith("_") and _find_spec(f"{__name__}.{name}") is not None:
        _import_torch()  # a submodule not imported yet: sp.runtime, sp.tree
        return _importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_LAZY_MODULES))


__all__ = [
    "Mesh", "P", "Rules", "match", "explain", "plan", "Plan", "ParamPlan", "BufferPlan", "UnitPlan", "Memory", "Op",
    "ShardingError", "MeshError", "SpecError", "RuleError", "UnmatchedParametersError", "PlanError",
    "RuntimeShardingError", "FP8UnavailableError", "CollectiveError", "CheckpointError", "ForecastError", "UnusedRuleWarning", "PlanWarning",
    "shard", "no_sync", "clip_grad_norm_", "record_ops", "memory_stats", "reset_peak", "mark_shards_changed",
    "compile_units", "checkpoint", "state_dict", "load_state_dict", "full_state_dict", "load_full_state_dict",
    "shard_tree", "unshard_tree", "assemble", "functional_call", "value_and_grad", "grad", "optim",
    "clip_by_global_norm", "auto_rules", "fully_shard", "MixedPrecisionPolicy", "fully_shard_model",
    "fully_shard_optimizer", "register_fsdp_forward_method", "plan_of", "run_main", "metrics", "offload_optimizer", "OffloadAdamW",
    "rehearse", "Rehearsal", "RehearsalError",
]
