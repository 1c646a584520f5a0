"""The schedule of a :class:`~shardplan.planner.facade.Plan`, read: as the runtime's program (steps per event),
as the ops a step runs under given facts (``plan.ops(...)``), and what keeps it from being captured and
replayed (``plan.capture_blockers``). A mixin of ``Plan``, over its fields.
"""

from __future__ import annotations

from functools import cached_property
from typing import Union

from . import capture
from . import schedule as S
from .values import Op, Program


class PlanSchedule:
    """``Plan``'s schedule as it runs: ``program``, ``ops(...)``, ``capture_blockers``, ``capturable``."""

    # -- the schedule as a program -----------------------------------------------------------------------
    @cached_property
    def program(self) -> Program:
        """The schedule arranged per event, as the runtime executes it (see :mod:`shardplan.planner.schedule`)."""
        return S.program(self.units, self.schedule)

    def ops(self, *, stale: bool = True, grad: bool = True, sync: bool = True,
            recompute: Union[bool, str] = False) -> tuple[Op, ...]:
        """The ops a step with these facts runs, in order: ``stale`` (the shards changed since the last
        gather), ``grad`` (a backward follows the forward), ``sync`` (gradients are reduced), ``recompute``
        (each unit's forward is recomputed in backward: activation checkpointing per unit, which repeats
        the forward's tensor-parallel collectives). ``recompute=True`` is torch's checkpoint as it runs by
        default (non-reentrant, early stop: a recompute ends once backward has every tensor it saves, before
        a block's last row-parallel all-reduce); ``recompute="whole"`` is a whole recompute
        (``set_checkpoint_early_stop(False)``, or ``use_reentrant=True``). Which collectives early stop
        leaves out a traced plan knows (its checkpointed meta step); untraced, each unit's last forward
        collective is assumed left out (a pre-norm block: its last output only feeds the residual).

        >>> plan.ops()                       # a training step
        >>> plan.ops(grad=False)             # an eval / no_grad forward
        """
        return S.select(self.schedule, stale=stale, grad=grad, sync=sync, recompute=recompute)

    @cached_property
    def capture_blockers(self) -> tuple:
        """What keeps this plan's training step from being captured and replayed (``shardplan.capture``), each a
        :class:`~shardplan.planner.capture.Blocker` (``code``, ``reason``, ``fix``); empty when it can be.

        >>> [b.code for b in plan.with_order("dynamic").capture_blockers]
        ['dynamic_order']
        """
        return capture.blockers(self)

    @property
    def capturable(self) -> bool:
        """Whether ``shardplan.capture`` can replay this plan's step (no :attr:`capture_blockers`)."""
        return not self.capture_blockers
