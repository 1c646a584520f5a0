"""Learning-rate schedules in optax's style: pure functions of the step, ``sched(step) -> float``.

>>> sched = sp.optim.warmup_cosine(3e-4, warmup=100, total=10_000, end=3e-5)
>>> sched(0), sched(100), sched(10_000)                  # 0.0, 3e-4 (the peak), 3e-5 (the end)
>>> opt = sp.optim.adamw(lr=sched)                       # a pure optimizer: step t uses sched(t)
>>> torch_opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
>>> lr_sched = sp.optim.as_lr_scheduler(torch_opt, sched)   # stock torch.optim: lr_sched.step() after opt.step()

Step ``t`` counts optimizer updates from 0 (the first update uses ``sched(0)``), as optax's schedules and
torch's ``LRScheduler`` do, so the same schedule gives the same learning rates to both. Every schedule
is defined for every integer step: before its start it holds its first value, after its end its last.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence, Union

import torch

from .errors import ShardingError

Schedule = Callable[[int], float]
LearningRate = Union[float, Schedule]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ShardingError(msg)


def _steps(name: str, value) -> int:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
           f"{name} must be a whole number of steps >= 0, got {value!r}")
    return value


def constant(value: float) -> Schedule:
    """``value`` at every step.

    >>> sp.optim.constant(1e-3)(123)   # 0.001
    """
    value = float(value)
    return lambda step: _f64(value, step) if isinstance(step, torch.Tensor) else value


def linear(init: float, end: float, steps: int, begin: int = 0) -> Schedule:
    """From ``init`` at step ``begin`` to ``end`` at ``begin + steps`` in a straight line, then ``end``
    (optax's ``linear_schedule``).

    >>> sp.optim.linear(1.0, 0.0, steps=10)(5)   # 0.5
    """
    init, end, steps, begin = float(init), float(end), _steps("steps", steps), _steps("begin", begin)

    def sched(step: int) -> float:
        if isinstance(step, torch.Tensor):  # on the device: a captured step (shardplan.capture)
            return _linear_t(step, init, end, steps, begin)
        if steps == 0:
            return end if step >= begin else init
        done = min(max(step - begin, 0), steps)
        return init if done == 0 else end if done == steps else init + (end - init) * (done / steps)  # exact ends
    return sched


def linear_warmup(peak: float, warmup: int, init: float = 0.0) -> Schedule:
    """From ``init`` (0 by default) to ``peak`` over ``warmup`` steps, then ``peak`` for ever.

    >>> sp.optim.linear_warmup(1e-3, warmup=100)(50)   # 5e-4
    """
    return linear(init, peak, warmup)


def cosine_decay(init: float, steps: int, end: float = 0.0) -> Schedule:
    """Half a cosine from ``init`` at step 0 to ``end`` at ``steps``, then ``end`` (optax's
    ``cosine_decay_schedule`` with ``alpha = end / init``).

    >>> sp.optim.cosine_decay(1.0, steps=100)(50)   # 0.5
    """
    init, end, steps = float(init), float(end), _steps("steps", steps)

    def sched(step: int) -> float:
        if isinstance(step, torch.Tensor):
            return _cosine_t(step, init, end, steps)
        if steps == 0:
            return end if step > 0 else init
        done = min(max(step, 0), steps)
        if done == 0 or done == steps:  # exact ends
            return init if done == 0 else end
        return end + (init - end) * 0.5 * (1.0 + math.cos(math.pi * done / steps))
    return sched


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[i]`` from ``boundaries[i-1]`` on, each called with the steps since its own start
    (optax's ``join_schedules``).

    >>> sp.optim.join([sp.optim.linear_warmup(1.0, 10), sp.optim.cosine_decay(1.0, 90)], [10])
    """
    schedules, boundaries = list(schedules), [_steps("boundary", b) for b in boundaries]
    _check(len(schedules) == len(boundaries) + 1,
           f"join: {len(schedules)} schedules need {len(schedules) - 1} boundaries, got {len(boundaries)}")
    _check(boundaries == sorted(boundaries), f"join: boundaries must be increasing, got {boundaries}")

    def sched(step: int) -> float:
        if isinstance(step, torch.Tensor):  # every piece evaluated, the one in force selected: no host read
            out = _f64(schedules[0](step), step)
            for b, piece in zip(boundaries, schedules[1:]):
                out = torch.where(step >= b, _f64(piece(step - b), step), out)
            return out
        start, i = 0, 0
        while i < len(boundaries) and step >= boundaries[i]:
            start, i = boundaries[i], i + 1
        return schedules[i](step - start)
    return sched


def warmup_cosine(peak: float, warmup: int, total: int, end: float = 0.0, init: float = 0.0) -> Schedule:
    """Linear warm-up from ``init`` to ``peak`` over ``warmup`` steps, then a cosine to ``end`` at step
    ``total`` (warm-up included), then ``end`` (optax's ``warmup_cosine_decay_schedule``).

    >>> sched = sp.optim.warmup_cosine(3e-4, warmup=100, total=10_000, end=3e-5)
    """
    warmup, total = _steps("warmup", warmup), _steps("total", total)
    _check(warmup <= total, f"warmup_cosine: warmup ({warmup} steps) is longer than total ({total} steps); "
                            f"make total the whole run's steps, warm-up included")
    return join([linear_warmup(peak, warmup, init), cosine_decay(peak, total - warmup, end)], [warmup])


SCHEDULES = ("constant", "linear_warmup", "cosine_decay", "warmup_cosine")


def by_name(name: str, peak: float, *, warmup: int = 0, total: int = 0, end: float = 0.0) -> Schedule:
    """A schedule from a command-line name (``constant``, ``linear_warmup``, ``cosine_decay``,
    ``warmup_cosine``) and the options they share.

    >>> sp.optim.by_name("warmup_cosine", 3e-4, warmup=100, total=10_000, end=3e-5)
    """
    if name == "constant":
        return constant(peak)
    if name == "linear_warmup":
        return linear_warmup(peak, warmup)
    if name == "cosine_decay":
        return cosine_decay(peak, total, end)
    if name == "warmup_cosine":
        return warmup_cosine(peak, warmup, total, end)
    raise ShardingError(f"no learning-rate schedule named {name!r}; choose one of {', '.join(SCHEDULES)}")


def value_at(lr: LearningRate, step: int) -> float:
    """The learning rate at ``step`` of a number (constant) or a schedule. ``step`` a tensor: the learning rate as a
    float64 tensor on its device, computed there (no host read: what a captured step needs)."""
    if isinstance(step, torch.Tensor):
        return _f64(lr(step) if callable(lr) else float(lr), step)
    return float(lr(step)) if callable(lr) else float(lr)


# [Note: schedules on the device] a captured step (shardplan.capture) keeps its step count in a device tensor
# and evaluates the schedule there every replay. The tensor forms compute in float64, as Python's floats do,
# with the same formulas and the same exact ends, so a schedule gives the same learning rate on both paths
# (to the last bit of the float64 formula; tests/test_capture.py compares them).
def _f64(x, like: torch.Tensor) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64)
    return torch.full((), float(x), dtype=torch.float64, device=like.device)


def _linear_t(step: torch.Tensor, init: float, end: float, steps: int, begin: int) -> torch.Tensor:
    t = step.to(torch.float64)
    if steps == 0:
        return torch.where(t >= begin, _f64(end, t), _f64(init, t))
    done = (t - begin).clamp(0, steps)
    mid = init + (end - init) * (done / steps)
    return torch.where(done == 0, _f64(init, t), torch.where(done == steps, _f64(end, t), mid))


def _cosine_t(step: torch.Tensor, init: float, end: float, steps: int) -> torch.Tensor:
    t = step.to(torch.float64)
    if steps == 0:
        return torch.where(t > 0, _f64(end, t), _f64(init, t))
    done = t.clamp(0, steps)
    mid = end + (init - end) * 0.5 * (1.0 + torch.cos(math.pi * done / steps))
    return torch.where(done == 0, _f64(init, t), torch.where(done == steps, _f64(end, t), mid))


class ScheduleLR(torch.optim.lr_scheduler.LRScheduler):
    """A torch ``LRScheduler`` that sets every param group's ``lr`` to ``schedule(step)`` (absolute values,
    not factors of the initial learning rate as ``LambdaLR``). Built by :func:`as_lr_scheduler`.

    ``state_dict()`` leaves the schedule out (a function is not data): rebuild the scheduler with the same
    schedule and ``step=`` when resuming.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Union[Schedule, Sequence[Schedule]],
                 step: int = 0):
        groups = optimizer.param_groups
        scheds = list(schedule) if isinstance(schedule, (list, tuple)) else [schedule] * len(groups)
        _check(len(scheds) == len(groups), f"as_lr_scheduler: {len(scheds)} schedules for {len(groups)} param groups; "
                                           f"pass one schedule, or one per param group")
        _check(all(callable(s) for s in scheds), "as_lr_scheduler: a schedule is a function of the step, "
                                                 "e.g. sp.optim.warmup_cosine(3e-4, 100, 10_000)")
        self.schedules = scheds
        super().__init__(optimizer)  # one initial step: step 0's learning rates
        if _steps("step", step):
            self.last_epoch = step
            self._apply()

    def get_lr(self) -> list[float]:
        return [float(s(self.last_epoch)) for s in self.schedules]

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            if isinstance(group["lr"], torch.Tensor):  # a captured step reads this tensor: update it in place
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "schedules")}


def as_lr_scheduler(optimizer: torch.optim.Optimizer, schedule: Union[Schedule, Sequence[Schedule]],
                    step: int = 0) -> ScheduleLR:
    """Drive a stock ``torch.optim`` optimizer's learning rate with a schedule: call ``.step()`` after each
    ``optimizer.step()``. ``step=`` starts at that step (resuming); one schedule, or one per param group.

    >>> lr_sched = sp.optim.as_lr_scheduler(opt, sp.optim.warmup_cosine(3e-4, 100, 10_000), step=start)
    >>> opt.step(); lr_sched.step()
    """
    return ScheduleLR(optimizer, schedule, step)
