"""shardplan: ZeRO-1/2/3 sharding for PyTorch, declared as data and inspectable before launch.

>>> import shardplan as sp
>>> plan = sp.plan(model, sp.Rules([(r".*norm.*", sp.P()), (r".*", sp.P("dp"))]), sp.Mesh(dp=8),
...                units=[r"layers\\.\\d+"])
>>> print(plan)

The language and the planner (``P``, ``Mesh``, ``Rules``, ``plan``, ``auto_rules``) import without torch;
the runtime (``shard``, ``checkpoint``, ``value_and_grad``, ...) is imported, with torch, on first use, so
that ``import shardplan`` and the ``shardplan`` command start at once.

``dir(shardplan)`` is the everyday surface (``__all__``); the rest lives in its subpackage: the errors in
``shardplan.errors``, the checkpoint functions in ``shardplan.checkpoint``, the plan's values (``Op``,
``ParamPlan``, ...) in ``shardplan.planner``, ``clip_by_global_norm`` in ``shardplan.optim``, the FSDP2 extras in
``shardplan.dropin``. Every name that was once at the top level still is (``sp.PlanError``, ``sp.state_dict``,
...): ``_MOVED`` below resolves it from its subpackage on first use.
"""

import importlib as _importlib
import sys as _sys
from importlib.util import find_spec as _find_spec

from .dtypes import import_torch as _import_torch  # torch-free: it imports torch when called
from .errors import ShardingError
from .mesh import Mesh
from .planner import Layout, Offload, Plan, Precision, Schedule, plan
from .rules import Rules, explain, match
from .spec import P
from .auto import auto_rules
from . import errors
from . import forecast  # torch-free; registers plan.forecast(...) (planner/plan_accounting.py; the planner never imports it)

__version__ = "0.1.0"


class _PlannerAlias:
    """[Note: the planner package was once ``shardplan.plan``, a name the function ``sp.plan`` shadows
    (``import shardplan.plan as pp`` gave the function); it is ``shardplan.planner``. Deep imports written for
    the old name (``from shardplan.plan.render import render_schedule``, pickled plans) keep working: the
    old package name is the new package in ``sys.modules`` (so the attribute ``sp.plan`` stays the function),
    and this finder hands out ``shardplan.planner.X`` for ``shardplan.plan.X`` (one module, not a copy)]"""

    OLD, NEW = "shardplan.plan.", "shardplan.planner."

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if not name.startswith(cls.OLD):
            return None
        from importlib.machinery import ModuleSpec
        return ModuleSpec(name, cls, origin=cls.NEW + name[len(cls.OLD):])

    @classmethod
    def create_module(cls, spec):
        module = _importlib.import_module(spec.origin)
        spec.loader_state = module.__spec__  # importlib sets __spec__ to the alias's: exec_module puts it back
        return module

    @staticmethod
    def exec_module(module):
        module.__spec__ = module.__spec__.loader_state


_sys.modules.setdefault("shardplan.plan", _sys.modules["shardplan.planner"])
_sys.meta_path.insert(0, _PlannerAlias)

# name -> the module that defines it, imported (with torch) when the name is first read
_LAZY = {
    **dict.fromkeys(("clip_grad_norm_", "compile_units", "memory_stats", "no_sync", "record_ops", "reset_peak",
                     "shard"), "runtime"),
    **dict.fromkeys(("functional_call", "grad", "unshard_tree", "value_and_grad"), "runtime.functional"),
    "shard_tree": "tree",
    **dict.fromkeys(("MixedPrecisionPolicy", "fully_shard", "fully_shard_model", "plan_of"), "dropin"),
    "run_main": "entry",
    "offload_optimizer": "runtime.offload_optim",
    "rehearse": "rehearsal",
    "capture": "runtime.capture",
    "emulated_network": "runtime.emulated",
}
_LAZY_MODULES = {"checkpoint": "runtime.checkpoint", "optim": "optim", "metrics": "metrics",
                 "expert_parallel": "runtime.expert_parallel", "context_parallel": "runtime.context_parallel"}

# [Note: compatibility: names once at the top level, now only in their subpackage (not in dir() or __all__).
# ``sp.PlanError``, ``from shardplan import state_dict`` keep working; the first read imports the module
# (with torch where it needs it, like _LAZY) and caches the name here]
_MOVED = {
    **dict.fromkeys(("CheckpointError", "CollectiveError", "FP8UnavailableError", "ForecastError", "MeshError",
                     "PlanError", "PlanWarning", "RehearsalError", "RuleError", "RuntimeShardingError", "SpecError",
                     "UnmatchedParametersError", "UnusedRuleWarning", "CaptureError"), "errors"),
    **dict.fromkeys(("BufferPlan", "Memory", "Op", "ParamPlan", "UnitPlan"), "planner"),
    **dict.fromkeys(("full_state_dict", "load_full_state_dict", "load_state_dict", "state_dict"), "runtime.checkpoint"),
    "mark_shards_changed": "runtime",
    "assemble": "tree",
    "clip_by_global_norm": "optim",
    **dict.fromkeys(("fully_shard_optimizer", "register_fsdp_forward_method"), "dropin"),
    "OffloadAdamW": "runtime.offload_optim",
    "Rehearsal": "rehearsal",
    "CapturedStep": "runtime.capture",
}
_TORCH_FREE = ("errors", "planner")  # _MOVED modules that load without torch


def __getattr__(name: str):
    if name in _LAZY or name in _LAZY_MODULES or name in _MOVED:
        module = _LAZY.get(name) or _MOVED.get(name)
        if module not in _TORCH_FREE:
            _import_torch()  # quietly, before the runtime imports it
        if name in _LAZY_MODULES:
            value = _importlib.import_module(f".{_LAZY_MODULES[name]}", __name__)
        else:
            value = getattr(_importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value
        return value
    if name.isidentifier() and not name.startswith("_") and _find_spec(f"{__name__}.{name}") is not None:
        _import_torch()  # a submodule not imported yet: sp.runtime, sp.tree
        return _importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    # the language and the planner (no torch)
    "Mesh", "P", "Rules", "match", "explain", "auto_rules", "plan", "Plan",
    # plan()'s options grouped by feature (the flat keywords mean the same)
    "Precision", "Offload", "Schedule", "Layout",
    # the runtime: a module's face
    "shard", "no_sync", "clip_grad_norm_", "record_ops", "compile_units", "memory_stats", "reset_peak",
    # the functional face
    "shard_tree", "unshard_tree", "functional_call", "value_and_grad", "grad",
    # FSDP2 / Megatron-FSDP drop-ins
    "fully_shard", "fully_shard_model", "MixedPrecisionPolicy", "plan_of",
    # training
    "offload_optimizer", "rehearse", "run_main", "capture", "emulated_network",
    # subpackages
    "checkpoint", "optim", "metrics", "forecast", "expert_parallel", "context_parallel", "errors",
    # the base of every shardplan error (the others: shardplan.errors)
    "ShardingError",
]


def __dir__():
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__") and n.endswith("__")})
