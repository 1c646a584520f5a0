"""The plan's vocabularies as enums: op kinds and subjects, events, conditions, strategies, orders and
layout choices. Each member *is* its string (``OpKind.ALL_GATHER == "all_gather"``), so JSON, fingerprints
and printed plans read exactly as they did when these were plain strings.

>>> choose(Order, "dynamic", "order")
'dynamic'
>>> choose(Order, "sideways", "order")        # PlanError: order must be one of ('static', 'dynamic'); got 'sideways'
"""

from __future__ import annotations

import enum
from typing import TypeVar

from ..errors import PlanError


class Name(str, enum.Enum):
    """A string-valued enum that prints, formats and reprs as its value.

    [Note: Python 3.11 formats ``(str, Enum)`` members as ``Cls.MEMBER`` in f-strings; the overrides keep
    every rendered plan, error message and ``plan.to_source()`` (which writes ``strategy='optim'``) as they
    were. Hashing and equality are the string's, so ``{"all_gather": n}[OpKind.ALL_GATHER]`` works.]
    """

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


class OpKind(Name):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    WAIT = "wait"
    FREE = "free"
    PREPARE = "prepare"  # grads: the unsharded gradient exists for this window and the full parameters'
    #                      ``.grad`` point into it (gradients accumulate straight into the flat buffer)
    COPY_D2H = "copy_d2h"  # grads: a reduced local gradient shard goes to host memory (CPU offload)
    COPY_H2D = "copy_h2d"  # params: a shard the host stepped (or holds) is on the device before its gather
    OPTIM_STEP = "optim_step"  # params: the host steps an offloaded buffer's master shard, overlapping backward
    ALL_TO_ALL = "all_to_all"  # activations: an expert module's tokens to their experts' ranks and back


class Offload(Name):
    """``plan(offload=...)``: what lives in host memory (see :mod:`shardplan.planner.offload`)."""

    OPTIMIZER = "optimizer"  # the master shard copy and the optimizer state; the step runs on the host
    PARAMS = "params"        # also the parameter shard itself (ZeRO-3): copied in ahead of each gather


class Subject(Name):
    """What an op moves: the parameters, the gradients, or the used-parameter flags."""

    PARAMS = "params"
    GRADS = "grads"
    USED = "used"
    SCALES = "scales"  # FP8 compute: the float8 weights' absmaxes, all-reduced (max) over the gather's group before
    #                    their all-gather (planner/float8.py; the scales of the float8 codes come from them)
    PARTIAL_GRADS = "partial_grads"  # the gradients of replicated parameters that read tensor-parallel-sharded
    #                                  activations (a per-head q_norm): each compute rank's is a partial sum, summed
    #                                  over the compute axis before the unit's reduction (planner/tensor_parallel.py)
    ACTIVATIONS = "activations"  # moved inside a module's call: a tensor-parallel module's input gradient or
    #                              output (planner/tensor_parallel.py), context-parallel attention's keys and values
    #                              (planner/context_parallel.py), an expert module's tokens (planner/expert_parallel.py)


class Event(Name):
    BEFORE_FORWARD = "before_forward"
    PRE_FORWARD = "pre_forward"
    POST_FORWARD = "post_forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"
    END_BACKWARD = "end_backward"
    BEGIN_BACKWARD = "begin_backward"  # the first event of a backward pass, whichever it is
    MODULE_FORWARD = "module_forward"    # a tensor-parallel module's forward ends (``at``: its path)
    MODULE_BACKWARD = "module_backward"  # the gradient of a tensor-parallel module's input is formed


class Condition(Name):
    """When an op runs (see :mod:`shardplan.planner.schedule`); ``ALWAYS`` is ``""`` and so falsy."""

    ALWAYS = ""
    STALE = "stale"
    SYNC = "sync"
    NO_GRAD = "no_grad"
    RECOMPUTE = "recompute"  # a forward recomputed in backward (activation checkpointing of the unit)
    RECOMPUTE_WHOLE = "recompute_whole"  # ... only when the whole unit is recomputed: torch's checkpoint early stop
    #                                      (its default) ends the recompute before this op (planner/tensor_parallel.py)


class Phase(Name):
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"


class Strategy(Name):
    """ZeRO levels 0..3, in order: what is sharded besides the optimizer state."""

    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"


class Order(Name):
    STATIC = "static"
    DYNAMIC = "dynamic"


class LayoutChoice(Name):
    """``plan(layout=...)``: the planner's choice, or ``torch.chunk`` pieces everywhere (DTensor-describable)."""

    AUTO = "auto"
    CHUNKED = "chunked"


ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, WAIT, FREE, PREPARE, COPY_D2H, COPY_H2D, OPTIM_STEP, ALL_TO_ALL = OpKind
COPIES = (COPY_D2H, COPY_H2D)
HOST_OPS = (COPY_D2H, COPY_H2D, OPTIM_STEP)  # CPU offload's ops: local, no process group
COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL)
KINDS = tuple(OpKind)
PARAMS, GRADS, USED, SCALES, PARTIAL_GRADS, ACTIVATIONS = Subject
(BEFORE_FORWARD, PRE_FORWARD, POST_FORWARD, PRE_BACKWARD, POST_BACKWARD, END_BACKWARD, BEGIN_BACKWARD, MODULE_FORWARD,
 MODULE_BACKWARD) = Event
BACKWARD_EVENTS = (BEGIN_BACKWARD, PRE_BACKWARD, POST_BACKWARD, END_BACKWARD, MODULE_BACKWARD)
EVENTS = tuple(Event)
ALWAYS, STALE, SYNC, NO_GRAD, RECOMPUTE, RECOMPUTE_WHOLE = Condition
CONDITIONS = tuple(Condition)
FORWARD, BACKWARD, STEP = Phase
STRATEGIES = tuple(Strategy)
ORDERS = tuple(Order)
LAYOUTS = tuple(LayoutChoice)

E = TypeVar("E", bound=Name)


def choose(cls: type[E], value, what: str) -> E:
    """``value`` (a member or its string) as a member of ``cls``, else a :class:`PlanError` naming the choices."""
    try:
        return cls(value)
    except ValueError:
        raise PlanError(f"{what} must be one of {cls.values()}; got {value!r}") from None


def strategy_level(strategy) -> int:
    """0..3 from a strategy name or number (ZeRO level).

    >>> strategy_level("optim_grads"), strategy_level(3)
    (2, 3)
    """
    if isinstance(strategy, int) and not isinstance(strategy, bool) and 0 <= strategy <= 3:
        return strategy
    if isinstance(strategy, str) and strategy in Strategy.values():
        return STRATEGIES.index(Strategy(strategy))
    raise PlanError(f"unknown strategy {strategy!r}; use one of {Strategy.values()} or 0..3")
