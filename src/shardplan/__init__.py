"""shardplan: ZeRO-1/2/3 sharding for PyTorch, declared as data and inspectable before launch.

>>> import shardplan as sp
>>> plan = sp.plan(model, sp.Rules([(r".*norm.*", sp.P()), (r".*", sp.P("dp"))]), sp.Mesh(dp=8),
...                units=[r"layers\\.\\d+"])
>>> print(plan)
"""

from .errors import (CheckpointError, CollectiveError, MeshError, PlanError, PlanWarning, RuleError,
                     RuntimeShardingError, ShardingError, SpecError, UnmatchedParametersError, UnusedRuleWarning)
from .mesh import Mesh
from .plan import BufferPlan, Memory, ParamPlan, Plan, UnitPlan, plan
from .rules import Rules, explain, match
from .schedule import Op
from .spec import P
from .runtime import clip_grad_norm_, memory_stats, no_sync, record_ops, reset_peak, shard

__version__ = "0.1.0"

__all__ = [
    "Mesh", "P", "Rules", "match", "explain", "plan", "Plan", "ParamPlan", "BufferPlan", "UnitPlan", "Memory", "Op",
    "ShardingError", "MeshError", "SpecError", "RuleError", "UnmatchedParametersError", "PlanError",
    "RuntimeShardingError", "CollectiveError", "CheckpointError", "UnusedRuleWarning", "PlanWarning",
    "shard", "no_sync", "clip_grad_norm_", "record_ops", "memory_stats", "reset_peak",
]


