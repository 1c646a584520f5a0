"""Rehearsal: one rank of an N-rank plan, trained for real on this machine with every collective a local
stand-in (torch's fake process group), measured beside what the plan says.

>>> r = shardplan.rehearse(gpt.tiny, plan, rank=3, batch=(2, 32), steps=2)
>>> print(r)        # per step: time, peak memory measured and planned; per unit: compute time

| module | holds |
|---|---|
| ``run.py`` | ``rehearse()``: checks, the fake world, meta start-up, the measured steps |
| ``init.py`` | ``RehearsalInit``: how meta start-up initialises each module; meta buffers filled |
| ``host.py`` | the host's memory: RSS, its high-water mark, glibc's mmap threshold fixed |
| ``timing.py`` | marks inside a step: CUDA events or the host clock, one unit's forward and backward |
| ``result.py`` | ``Rehearsal``: the figures, the table, JSON (with a compute model for the forecast) |
| ``cli.py`` | ``shardplan rehearse`` (the ``shardplan plan`` options, the same plan) |
"""

from .result import Rehearsal, UnitTime

__all__ = ["rehearse", "Rehearsal", "UnitTime"]


def __getattr__(name: str):
    # [Note: `shardplan --help` registers this package's CLI without torch: run.py (torch) loads on first use]
    if name == "rehearse":
        from .run import rehearse  # (torch-free until used: see the note above)
        return rehearse
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
