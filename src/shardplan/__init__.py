"""shardplan: ZeRO-1/2/3 sharding for PyTorch, declared as data and inspectable before launch.

>>> import shardplan as sp
>>> plan = sp.plan(model, sp.Rules([(r".*norm.*", sp.P()), (r".*", sp.P("dp"))]), sp.Mesh(dp=8),
...                units=[r"layers\\.\\d+"])
>>> print(plan)
"""

import warnings as _warnings

with _warnings.catch_warnings():  # torch warns at import when NumPy is absent; shardplan never uses NumPy
    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch as _torch  # noqa: F401

from .errors import (CheckpointError, CollectiveError, ForecastError, MeshError, PlanError, PlanWarning, RuleError,
                     RuntimeShardingError, ShardingError, SpecError, UnmatchedParametersError, UnusedRuleWarning)
from .mesh import Mesh
from .plan import BufferPlan, Memory, Op, ParamPlan, Plan, UnitPlan, plan
from .rules import Rules, explain, match

from .spec import P
from .runtime import clip_grad_norm_, compile_units, mark_shards_changed, memory_stats, no_sync, record_ops, reset_peak, shard
from .runtime import checkpoint
from .runtime.checkpoint import full_state_dict, load_full_state_dict, load_state_dict, state_dict
from .runtime.functional import functional_call, grad, value_and_grad
from .tree import assemble, shard_tree, unshard_tree
from . import metrics, optim
from .optim import clip_by_global_norm
from .auto import auto_rules
from .dropin import MixedPrecisionPolicy, fully_shard, fully_shard_model, fully_shard_optimizer, plan_of
from .entry import run_main

__version__ = "0.1.0"

__all__ = [
    "Mesh", "P", "Rules", "match", "explain", "plan", "Plan", "ParamPlan", "BufferPlan", "UnitPlan", "Memory", "Op",
    "ShardingError", "MeshError", "SpecError", "RuleError", "UnmatchedParametersError", "PlanError",
    "RuntimeShardingError", "CollectiveError", "CheckpointError", "ForecastError", "UnusedRuleWarning", "PlanWarning",
    "shard", "no_sync", "clip_grad_norm_", "record_ops", "memory_stats", "reset_peak", "mark_shards_changed",
    "compile_units", "checkpoint", "state_dict", "load_state_dict", "full_state_dict", "load_full_state_dict",
    "shard_tree", "unshard_tree", "assemble", "functional_call", "value_and_grad", "grad", "optim",
    "clip_by_global_norm", "auto_rules", "fully_shard", "MixedPrecisionPolicy", "fully_shard_model",
    "fully_shard_optimizer", "plan_of", "run_main", "metrics",
]
