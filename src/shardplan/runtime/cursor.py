"""Where a rank is in the plan's program: the next forward step and the next backward step.

The cursor knows only the plan. It walks ``plan.program`` (forward steps, then backward steps, then
``end_backward``) and says which ops a step runs under the facts of this step (:class:`Facts`); the
executor runs them. Both positions only move forward within a step, so every rank runs the same
ops in the same order whatever its data does.

>>> cur = Cursor(plan)
>>> for step in cur.forward_to(cur.forward_index[(PRE_FORWARD, "layers.0")]):
...     ops = cur.ops_of(step, Facts(stale=False, grad=True, sync=True))
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Optional, Sequence

from ..planner import Plan
from ..planner.schedule import POST_BACKWARD, PRE_BACKWARD, Op, Step


class Facts(NamedTuple):
    """What decides whether a conditional op runs (``Op.when``)."""

    stale: bool   # the shards changed since the last gather (ZeRO-0/1/2 gather before the next forward)
    grad: bool    # the forward records a graph (a backward will follow)
    sync: bool    # this backward reduces gradients (not under no_sync)


class Cursor:
    """Positions in ``plan.program`` and the ops of each step, selected once per (step, facts)."""

    def __init__(self, plan: Plan):
        self.program = plan.program
        self.schedule = plan.schedule
        self.forward_index = {(s.event, s.at): k for k, s in enumerate(self.program.forward)}
        self.pre_backward_index = {s.at: k for k, s in enumerate(self.program.backward) if s.event == PRE_BACKWARD}
        self.fwd = 0  # the next forward step to run
        self.bwd = 0  # the next backward step to run
        self._selected: dict[tuple, list[Op]] = {}

    def reset(self) -> None:
        self.fwd = self.bwd = 0

    @property
    def mid_forward(self) -> bool:
        """A forward started and did not reach its end."""
        return 0 < self.fwd < len(self.program.forward)

    def forward_to(self, k: int) -> Iterator[Step]:
        """The forward steps up to and including ``k`` not run yet, advancing as each is handed out."""
        while self.fwd <= k:
            step = self.program.forward[self.fwd]
            self.fwd += 1
            yield step

    def backward_to(self, k: int) -> Iterator[Step]:
        """The backward steps up to and including ``k`` not run yet, advancing as each is handed out."""
        while self.bwd <= k:
            step = self.program.backward[self.bwd]
            self.bwd += 1
            yield step

    def pending_post_backward(self) -> Optional[str]:
        """The unit of the ``post_backward`` step at the backward position, if that is the next step."""
        steps = self.program.backward
        if self.bwd < len(steps) and steps[self.bwd].event == POST_BACKWARD:
            return steps[self.bwd].at
        return None

    def ops_of(self, step: Step, facts: Facts) -> list[Op]:
        """The ops of ``step`` that apply under ``facts``, in schedule order (selected once, then cached)."""
        key = (step.event, step.at, facts)
        ops = self._selected.get(key)
        if ops is None:
            ops = self._selected[key] = [self.schedule[i] for i in step.ops
                                         if self.schedule[i].applies(stale=facts.stale, grad=facts.grad,
                                                                     sync=facts.sync)]
        return ops

    def departure(self, event: str, backward: bool) -> str:
        """The error for an event behind the cursor whose unit the plan already freed."""
        steps: Sequence[Step] = self.program.backward if backward else self.program.forward
        pos = self.bwd if backward else self.fwd
        expected = steps[pos].name if pos < len(steps) else "the end of this pass"
        unit = event[event.index("(") + 1:-1]
        head = (f"shardplan: {event} arrived but the plan already freed unit {unit!r}: the model ran it again or out "
                f"of plan order (the schedule expected {expected} next). ")
        if getattr(self, "fix_hint", None):  # the drop-in's spelling of the fix
            return head + self.fix_hint
        return head + (f"Units that run in a data-dependent order or "
                       f"more than once per step need plan(..., order='dynamic') (keeps units gathered until the forward "
                       f"ends) or plan.with_reshard_after_forward({{{unit!r}: False}}); a fixed order other than module "
                       f"registration needs plan(..., trace=(args, kwargs)) or other units=")
