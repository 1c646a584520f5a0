"""The gradient tracker: which gradients arrived in this backward and in this accumulation window.

An accumulation window ends with each synchronising backward (``no_sync`` micro-steps stay in it).
Within a pass, a unit completes when every parameter of it that takes a gradient got one; a gradient
that reaches a unit after its reduction raises, since it would otherwise be lost. Which parameters got
a gradient on any rank is exchanged once per window (``used``): parameters no rank used keep a
``None`` gradient, as in plain PyTorch.
"""

from __future__ import annotations

from typing import Optional

from ..errors import RuntimeShardingError
from ..planner import Plan
from .unit import Grads, PendingUsed, UnitRuntime


class GradTracker:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.sync = True          # this backward reduces gradients (False under no_sync)
        self.window = 0           # the accumulation window; ends with each synchronising backward
        self.used = bytearray(len(plan.params))  # parameters that got a gradient on this rank in this window
        self.pending_used: Optional[PendingUsed] = None

    def arrived(self, u: UnitRuntime, index: int) -> bool:
        """Parameter ``index`` of unit ``u`` got its gradient; returns whether ``u`` now has all of them."""
        self.used[index] = 1
        if u.grads is Grads.REDUCING or u.grads is Grads.DONE:
            self.check_not_reduced(u, [self.plan.params[index].name])
        u.got += 1
        if u.grads is Grads.IDLE:
            u.grads = Grads.RUNNING
        u.params_done = u.got >= u.expected
        return u.params_done and u.awaiting <= 0

    def reduced_activation(self, u: UnitRuntime) -> bool:
        """A ``module_backward`` op of ``u`` ran (its input's gradient is reduced); returns whether ``u`` now
        has everything. [Note: a unit's post_backward step waits for its modules' input-gradient
        collectives, as the plan lists them: a module reading the unit's input (nothing of the unit
        upstream of it) would otherwise see its reduce-scatter issued before that all-reduce.]"""
        u.awaiting -= 1
        return u.params_done and u.awaiting <= 0

    def check_not_reduced(self, u: UnitRuntime, names: list[str]) -> None:
        """A gradient arriving for ``u`` after its reduction would be lost: raise instead."""
        if u.grads in (Grads.REDUCING, Grads.DONE) and self.sync:
            raise RuntimeShardingError(
                f"shardplan: parameter {names[0]!r} of unit {u.name!r} received a gradient after the unit's gradients "
                f"were reduced: it is used outside the unit's forward, or the units' backward ran in another order "
                f"than the plan's. Move it to the root unit (units=...), use it inside its unit's forward, or plan "
                f"with order='dynamic' (reduces every gradient at the end of backward)")

    def end_pass(self) -> bool:
        """A backward ended; returns whether it closed the window (it synchronised)."""
        if not self.sync:
            return False
        self.window += 1
        self.used = bytearray(len(self.plan.params))
        return True
