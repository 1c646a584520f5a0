"""What keeps a plan's training step from being captured once and replayed (``shardplan.capture``).

A captured step (a CUDA graph of the forward, the loss, the backward, every op of the schedule and the
optimizer step) replays the device work it recorded, and nothing else: no Python, no host decision. A plan
can be captured when every step runs the same ops on the same buffers, decided before the step starts (the
captured step checks it: the capture must run the ops of the warm-up step before it).
:func:`blockers` names what in a plan breaks that, each with its fix; ``plan.capture_blockers`` holds them and
``print(plan)`` says them. Pure: reads the plan only.

>>> plan.capturable, [b.code for b in plan.capture_blockers]
(False, ['dynamic_order'])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .kinds import Order
from . import expert_parallel as EPX

if TYPE_CHECKING:  # pragma: no cover
    from .facade import Plan


@dataclass(frozen=True)
class Blocker:
    """One reason a plan's step cannot be captured: a stable ``code``, the ``reason`` and the ``fix``."""

    code: str
    reason: str
    fix: str

    def __str__(self) -> str:
        return f"{self.code}: {self.reason}; {self.fix}"


# What capture handles rather than refuses, said once in the docs and by print(plan) where it applies:
# [Note: the used-parameter exchange under capture] every step all-reduces which parameters got a gradient
# (on the host, over a CPU group) so that parameters no rank used keep a None gradient. A captured step cannot
# decide that per replay: shardplan.capture runs the exchange in its warm-up steps and in the capture, requires
# every one of them to agree, and replays that set. A step whose set of used parameters changes from step to
# step is refused at capture (it is data-dependent use: plan with order="dynamic" and run it eagerly).
USED_NOTE = ("the parameters that get a gradient are fixed when the step is captured (checked over the warm-up "
             "steps): a step that uses different parameters from step to step runs eagerly")


def blockers(plan: "Plan") -> tuple[Blocker, ...]:
    """The reasons ``plan``'s training step cannot be captured (empty: it can)."""
    out = []
    if plan.order == Order.DYNAMIC:
        out.append(Blocker("dynamic_order", "order='dynamic' gathers units as the data decides, step by step",
                           "plan with order='static' (the default) if the units run in one order, or run eagerly"))
    if EPX.of(plan).modules:
        names = ", ".join(m.path for m in EPX.of(plan).modules[:2]) + (", ..." if len(EPX.of(plan).modules) > 2 else "")
        out.append(Blocker("expert_parallel",
                           f"expert parallelism ({names}) sends data-dependent token counts: the all-to-all split "
                           f"sizes are read on the host every step",
                           "run expert-parallel plans eagerly (or plan without an expert axis)"))
    # CPU offload steps the optimizer on the host between the backward and the next forward: shardplan.capture
    # captures the device work on either side as two graphs of one program and runs the host step between them
    # at every replay ([Note: a step in segments], runtime/capture/graph.py): not a blocker
    # quantized gathers and FP8 compute check their scales for NaN/inf: a captured step reads the flags after each
    # replay instead ([Note: the non-finite check in a captured step], runtime/scales.py): not a blocker
    # a schedule edited by hand (with_schedule) was validated as the planner's own is, and shardplan.capture checks
    # that the capture ran the ops of the warm-up step before it ([Note: the same ops every step],
    # runtime/capture/session.py): not a blocker
    return tuple(out)


def describe(plan: "Plan") -> str:
    """One line for ``print(plan)``: whether the step can be captured, and why not."""
    bs = plan.capture_blockers
    if not bs:
        return "capture: yes (shardplan.capture replays the whole step)"
    return "capture: no (" + "; ".join(f"{b.code}: {b.reason}" for b in bs) + ")"
