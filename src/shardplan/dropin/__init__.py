"""Drop-in entry points: switch from FSDP2 or Megatron-FSDP by changing an import. Each one compiles an
ordinary :class:`Plan` (``shardplan.plan_of(model)``), which prints, dry-runs and turns back into rules
(``plan.to_source()``) like any other.

>>> from shardplan import fully_shard, MixedPrecisionPolicy            # was: torch.distributed.fsdp
>>> for block in model.layers: fully_shard(block, mp_policy=mp)
>>> fully_shard(model, mp_policy=mp)                                    # one plan, compiled at first use

>>> from shardplan import fully_shard_model, fully_shard_optimizer     # was: megatron_fsdp
>>> model = fully_shard_model(model, fsdp_unit_modules=[Block], zero_dp_strategy=3)
>>> optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters()))

The rooms: ``fsdp2.py`` (``fully_shard``, ``MixedPrecisionPolicy``, the ``FSDPModule`` methods), ``compile.py``
(the plan compiled at the first use, ``plan_of``), ``marks.py`` (the marks and shared flags), ``init_view.py``
(``to_empty`` and the init view), ``optimizer_state.py`` (FSDP2's DTensor optimizer states),
``forward_methods.py`` (``register_fsdp_forward_method``, torch's routed to it), ``megatron.py``
(``fully_shard_model``, ``fully_shard_optimizer``), ``common.py`` (meshes, dim-0 rules, refusals).
"""

from .compile import plan_of
from .forward_methods import register_fsdp_forward_method
from .fsdp2 import MixedPrecisionPolicy, ShardPlanModule, fully_shard
from .megatron import fully_shard_model, fully_shard_optimizer

__all__ = ["fully_shard", "MixedPrecisionPolicy", "ShardPlanModule", "fully_shard_model", "fully_shard_optimizer",
           "plan_of", "register_fsdp_forward_method"]
