"""Profiling a training run's steps (:mod:`shardplan.metrics` re-exports these): a ``torch.profiler`` trace of a
range of steps (:class:`StepProfiler`), the CUDA caching allocator's history up to a step (:class:`MemorySnapshot`),
and the ``FIRST:LAST`` steps they take (:func:`parse_steps`). torch is imported only when used."""

from __future__ import annotations

import os
from typing import Optional

from .errors import ShardingError


def parse_steps(text: str) -> tuple[int, int]:
    """``"3:5"`` -> ``(3, 5)``: steps 3 to 5, both included, numbered from 1; ``"4"`` is ``(4, 4)``."""
    a, _, b = str(text).partition(":")
    try:
        first, last = int(a), int(b or a)
    except ValueError:
        raise ShardingError(f"steps {text!r}: write FIRST:LAST, e.g. 3:5 (steps numbered from 1)") from None
    if first < 1 or last < first:
        raise ShardingError(f"steps {text!r}: need 1 <= FIRST <= LAST (steps are numbered from 1), e.g. 3:5")
    return first, last


class StepProfiler:
    """A ``torch.profiler`` trace of steps ``first`` to ``last`` (numbered from 1), one Chrome-trace JSON per
    rank (``out_dir/rank<r>.trace.json``; CPU ops, and CUDA kernels and memory copies on a GPU). Open it in
    https://ui.perfetto.dev (or ``chrome://tracing``).

    >>> prof = sp.metrics.StepProfiler("3:4", "profile", rank)
    >>> for step in range(1, steps + 1):
    ...     prof.begin(step); train_step(); prof.end(step)     # end() returns the trace's path after `last`
    """

    def __init__(self, steps, out_dir: str, rank: int = 0, *, record_shapes: bool = True, with_stack: bool = False):
        self.first, self.last = parse_steps(steps) if not isinstance(steps, tuple) else steps
        self.path = os.path.join(out_dir, f"rank{rank}.trace.json")
        self.record_shapes, self.with_stack = record_shapes, with_stack
        self._prof = self._range = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def begin(self, step: int) -> None:
        """Before step ``step`` runs: starts the profiler at ``first``; each traced step is a range named
        ``ProfilerStep#<step>`` (torch's own name for steps, which trace viewers and analysers group by)."""
        import torch
        if step == self.first and self._prof is None:
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=activities, record_shapes=self.record_shapes, with_stack=self.with_stack)
            self._prof.__enter__()
        if self._prof is not None and self._range is None:
            self._range = torch.profiler.record_function(f"ProfilerStep#{step}")
            self._range.__enter__()

    def end(self, step: int) -> Optional[str]:
        """After step ``step`` ran: closes the step's range; at ``last`` stops and writes the trace (its path)."""
        if self._prof is None:
            return None
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        return self.close() if step >= self.last else None

    def close(self) -> Optional[str]:
        """Stop and write the trace now (a run that ends inside the range); its path, or ``None``."""
        if self._prof is None:
            return None
        prof, self._prof = self._prof, None
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        prof.__exit__(None, None, None)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        prof.export_chrome_trace(self.path)
        return self.path


class MemorySnapshot:
    """The CUDA caching allocator's history (every allocation and free, with its Python stack) from when it is
    built to step ``at_step``, written as ``out_dir/rank<r>.pickle`` (``torch.cuda.memory._dump_snapshot``).
    Drag the file onto https://pytorch.org/memory_viz, or render it offline:
    ``python -m torch.cuda._memory_viz trace_plot rank0.pickle -o rank0.html``. Needs a CUDA device
    (the CPU allocator keeps no history): elsewhere it raises :class:`~shardplan.errors.ShardingError`.

    >>> snap = sp.metrics.MemorySnapshot("memory", rank, at_step=3)    # before the first step
    >>> snap.end(step)     # after each step; writes (and stops recording) after step 3
    """

    def __init__(self, out_dir: str, rank: int = 0, *, at_step: int = 3, max_entries: int = 100_000):
        import torch
        if not torch.cuda.is_available():
            raise ShardingError("a memory snapshot records the CUDA caching allocator's history and needs a GPU; on "
                                "a CPU the plan's per-rank memory is in plan.memory(rank) (shardplan plan ... --memory)")
        if at_step < 1:
            raise ShardingError(f"at_step={at_step}: the snapshot is written after a step, numbered from 1")
        self.path, self.at_step = os.path.join(out_dir, f"rank{rank}.pickle"), at_step
        torch.cuda.memory._record_memory_history(max_entries=max_entries)
        self._recording = True

    def end(self, step: int) -> Optional[str]:
        """After step ``step``: at ``at_step`` writes the snapshot and stops recording (its path)."""
        return self.close() if self._recording and step >= self.at_step else None

    def close(self) -> Optional[str]:
        if not self._recording:
            return None
        import torch
        self._recording = False
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        torch.cuda.memory._dump_snapshot(self.path)
        torch.cuda.memory._record_memory_history(enabled=None)
        return self.path
