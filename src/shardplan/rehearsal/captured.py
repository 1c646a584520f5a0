"""A rehearsal of the captured step (``shardplan rehearse --capture``): one rank's training step captured once
with :func:`shardplan.capture` and replayed, on the fake process group. The collectives are local stand-ins
that launch nothing, so the graph holds this rank's compute, copies and frees, and the replays show what the
host costs once no Python runs per unit.

>>> r = sp.rehearse(lambda: gpt.build("1B"), plan, rank=0, batch=(4, 2048), steps=5, capture=True)
>>> r.captured, r.step_s            # the replays' times, after the eager warm-up and the capture
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..step_call import scalar_of
from ..errors import RehearsalError
from ..planner import Plan
from ..runtime.capture import capture
from .timing import Clock

WARMUP = 2  # eager steps before the capture (``shardplan.capture``'s default)


@dataclass(frozen=True)
class Replays:
    """What the captured steps measured: each replay's time and device peak, and the host time per replay
    (the captured step's own bookkeeping: copying the batch in, its checks)."""

    step_s: tuple[float, ...]
    peaks: tuple[int, ...]
    host_s_per_replay: float
    backend: str


def check(plan: Plan) -> None:
    """Refuse a plan whose step cannot be captured, naming each reason and its fix (``plan.capture_blockers``)."""
    blockers = plan.capture_blockers
    if blockers:
        why = "; ".join(f"{b.code}: {b.reason} (fix: {b.fix})" for b in blockers)
        raise RehearsalError(f"rehearse(capture=True): this plan's step cannot be captured: {why}; rehearse it "
                             f"without capture, or plan again without what blocks it")


def capturable_optimizer(params, device: torch.device) -> torch.optim.Optimizer:
    """AdamW whose step can be captured on a GPU: its step count and learning rate live on the device."""
    return torch.optim.AdamW(list(params), lr=torch.tensor(1e-4, device=device), fused=True, capturable=True)


def run(model: nn.Module, opt: torch.optim.Optimizer, batch_fn: Callable[[int], tuple[tuple, dict]], steps: int,
        device: torch.device) -> Replays:
    """``WARMUP`` eager steps and the capture (not measured), then ``steps`` replays, timed one by one.
    ``batch_fn(i)`` gives step ``i``'s ``(args, kwargs)``; the captured step copies them into its static
    inputs. On a CPU the step runs eagerly through the same machinery (``backend="eager"``)."""
    cuda = device.type == "cuda"

    def train_step(args, kwargs):
        loss = scalar_of(model(*args, **kwargs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step = capture(train_step, warmup=WARMUP, backend="cuda_graph" if cuda else "eager")
    for i in range(WARMUP + 1):  # eager warm-up, then the call that captures
        step(*batch_fn(i))
    clock, times, peaks = Clock(device), [], []
    host0, replays0 = step.host_seconds, step.replays
    for i in range(steps):
        args = batch_fn(WARMUP + 1 + i)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        clock.mark("start")
        step(*args)
        clock.mark("end")
        times.append(clock.read()["end"])
        if cuda:
            peaks.append(int(torch.cuda.max_memory_allocated(device)))
    n = max(step.replays - replays0, 1)
    return Replays(step_s=tuple(times), peaks=tuple(peaks), host_s_per_replay=(step.host_seconds - host0) / n,
                   backend=step.backend)
