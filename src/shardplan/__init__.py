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
``shardplan.dropin``: one name per thing.
"""

import importlib as _importlib
from importlib.util import find_spec as _find_spec

from .dtypes import import_torch as _import_torch  # torch-free: it imports torch when called
from .errors import ShardingError
from .mesh import Mesh
from .planner import Plan, plan
from .rules import Rules, explain, match
from .spec import P
from .auto import auto_rules
from . import errors
from . import forecast  # torch-free; registers plan.forecast(...) (planner/facade.py; the planner never imports it)

__version__ = "0.1.0"


# name -> the module that defines it, imported (with torch) when the name is first read
_LAZY = {
    **dict.fromkeys(("clip_grad_norm_", "compile_units", "memory_stats", "no_sync", "record_ops", "reset_peak",
                     "shard"), "runtime"),
    **dict.fromkeys(("functional_call", "grad", "unshard_tree", "value_and_grad"), "runtime.functional"),
    "shard_tree": "tree",
    **dict.fromkeys(("MixedPrecisionPolicy", "fully_shard", "fully_shard_model", "fully_shard_optimizer", "plan_of"),
                   "dropin"),
    "run_main": "entry",
    "offload_optimizer": "runtime.offload_optim",
    "rehearse": "rehearsal",
    "capture": "runtime.capture",
    "emulated_network": "runtime.emulated",
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


__all__ = [
    # the language and the planner (no torch)
    "Mesh", "P", "Rules", "match", "explain", "auto_rules", "plan", "Plan",
    # the runtime: a module's face
    "shard", "no_sync", "clip_grad_norm_", "record_ops", "compile_units", "memory_stats", "reset_peak",
    # the functional face
    "shard_tree", "unshard_tree", "functional_call", "value_and_grad", "grad",
    # FSDP2 / Megatron-FSDP drop-ins
    "fully_shard", "fully_shard_model", "fully_shard_optimizer", "MixedPrecisionPolicy", "plan_of",
    # training
    "offload_optimizer", "rehearse", "run_main", "capture", "emulated_network",
    # subpackages
    "checkpoint", "optim", "metrics", "forecast", "expert_parallel", "context_parallel", "errors",
    # the base of every shardplan error (the others: shardplan.errors)
    "ShardingError",
]


def __dir__():
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__") and n.endswith("__")})
