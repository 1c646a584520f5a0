"""One record for every compute axis's in-module collectives on this rank (tensor, context and expert parallelism
alike): the ops the plan placed inside module calls, by (key, phase), and the executor that runs them.

A style hook, ``attention()`` or ``dispatch()`` does not call its collective and append the op to a recording:
it asks :meth:`AxisOps.run` to run the op the plan placed, and the executor runs it through its handler table
(``Executor.run_in_module``): recorded (``record_ops``), named under the profiler and accounted like every op.
Where the plan places no op for the call (an untraced plan, a call the trace did not see) the collective runs
as is.

>>> ops = AxisOps.of(plan, exe, lambda o: o.axes == ("cp",))   # K/V gathers by (attention module, phase)
>>> keys = ops.run("layers.0.attn", AxisOps.phase(), 0, lambda: gather(k))
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from ..planner.kinds import MODULE_BACKWARD, RECOMPUTE, RECOMPUTE_WHOLE

FORWARD, RECOMPUTING, BACKWARD = "forward", "recompute", "backward"


@dataclass(frozen=True)
class AxisOps:
    """The plan's in-module ops of one axis by (key: usually the calling module's path, phase: ``forward``,
    ``recompute`` or ``backward``), in the order a call issues them; ``engine``: a weak reference to the executor
    that runs them (weak: the record lives on modules and tensors' hooks, out of the collector's sight)."""

    ops: Mapping[tuple[Any, str], tuple] = field(default_factory=dict)
    engine: Optional[Callable[[], object]] = None

    @classmethod
    def of(cls, plan, exe, select: Callable, key: Callable = lambda o: o.at, per_key: int = 0) -> "AxisOps":
        """The in-module ops of ``plan`` that ``select`` keeps, by (``key(op)``, phase), each list cut to its first
        ``per_key`` (0: all): a module called several times runs its first call's ops."""
        out: dict = {}
        for o in plan.schedule:
            if o.in_module and select(o):
                phase = BACKWARD if o.event == MODULE_BACKWARD else \
                    RECOMPUTING if o.when in (RECOMPUTE, RECOMPUTE_WHOLE) else FORWARD
                got = out.setdefault((key(o), phase), [])
                if not per_key or len(got) < per_key:
                    got.append(o)
        return cls({k: tuple(v) for k, v in out.items()}, weakref.ref(exe) if exe is not None else None)

    @staticmethod
    def phase(backward: bool = False) -> str:
        """The phase a call runs in now. [Note: a forward inside a backward pass is activation checkpointing's
        recompute]"""
        return BACKWARD if backward else RECOMPUTING if torch._C._current_graph_task_id() != -1 else FORWARD

    def op(self, key, phase: str, i: int = 0):
        got = self.ops.get((key, phase), ())
        return got[i] if i < len(got) else None

    def run(self, key, phase: str, i: int, collective: Callable[[], Any]) -> Any:
        """Run the ``i``-th op the plan placed for (``key``, ``phase``) through the executor's handler table, which
        calls ``collective`` (the op's work) and returns its result; without such an op, ``collective()``."""
        exe = self.engine() if self.engine is not None else None
        op = self.op(key, phase, i) if exe is not None else None
        if op is None:
            return collective()
        return exe.run_in_module(op, collective)
