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

__version__ = "0.1.0"

__all__ = [
    "Mesh", "P", "Rules", "match", "explain", "plan", "Plan", "ParamPlan", "BufferPlan", "UnitPlan", "Memory", "Op",
    "ShardingError", "MeshError", "SpecError", "RuleError", "UnmatchedParametersError", "PlanError",
    "RuntimeShardingError", "CollectiveError", "CheckpointError", "UnusedRuleWarning", "PlanWarning",
]


def __getattr__(name):  # the runtime imports torch.distributed; load it only when asked for
    from . import runtime
    if name in runtime.__all__:
        return getattr(runtime, name)
    raise AttributeError(f"module 'shardplan' has no attribute {name!r}")
