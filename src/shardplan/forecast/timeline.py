"""The predicted timeline of one step: compute on one stream, collectives on theirs, links shared.

:func:`simulate` walks a list of items in program order, as the executor does: ``Issue`` a collective on
its stream (gathers, reductions and the used-parameter exchange each have one and run in issue order),
``Wait`` for collectives (the compute stream stalls until they end: that stall is the exposed
communication), ``Run`` compute. Pure: items in, spans out.

>>> tl = simulate([Issue(c), Run(Work("fwd layers.0", "layers.0", "forward", 0.01)), Wait((c.id,))], overlap=True)
>>> tl.step_s, tl.exposed_s

Collectives on the same link (``resource``) share it. [Note: sharing is modelled as preemptive priority:
the link serves the collective whose wait comes first in the program (ties: issue order), each at the
link's full bandwidth; latency (α) terms are delays that occupy no bandwidth. NCCL's concurrent kernels
share a link roughly fairly instead; in the common ZeRO-3 case (a prefetch gather and the previous
unit's reduce-scatter waited at the same point) both models end at the same time, and the priority model
makes the forecast monotone: a faster link, or a gather issued earlier (deeper prefetch), never delays
anything.]
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

EPS = 1e-12  # seconds: below a picosecond a transfer is done (and float time steps stay representable)


@dataclass(frozen=True)
class Comm:
    """One collective to simulate: ``latency_s`` of delay, then ``transfer_s`` of its ``resource``'s time."""

    id: int
    name: str
    stream: str            # gather | reduce | used | compute (blocking)
    resource: Optional[str]  # the link it occupies (None: no transfer)
    latency_s: float
    transfer_s: float


@dataclass(frozen=True)
class Work:
    """Compute on the compute stream."""

    name: str
    unit: str
    phase: str             # forward | backward | optimizer
    seconds: float


@dataclass(frozen=True)
class Issue:
    comm: Comm


@dataclass(frozen=True)
class Wait:
    ids: tuple[int, ...]
    name: str = ""


@dataclass(frozen=True)
class Run:
    work: Work


Item = Union[Issue, Wait, Run]


@dataclass(frozen=True)
class CommSpan:
    id: int
    name: str
    stream: str
    issued_s: float
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Span:
    """A stretch of the compute stream: compute (``kind="compute"``) or a stall on collectives (``"stall"``)."""

    kind: str
    name: str
    unit: str
    phase: str
    start_s: float
    end_s: float
    waits_for: tuple[int, ...] = ()


@dataclass(frozen=True)
class Timeline:
    step_s: float
    compute: tuple[Span, ...]
    comms: tuple[CommSpan, ...]

    @property
    def compute_s(self) -> float:
        return sum(s.end_s - s.start_s for s in self.compute if s.kind == "compute")

    @property
    def exposed_s(self) -> float:
        return sum(s.end_s - s.start_s for s in self.compute if s.kind == "stall")


@dataclass
class _State:  # mutable, private to one simulation
    comm: Comm
    order: int
    priority: float
    issued: float
    start: Optional[float] = None
    latency_end: float = 0.0
    left: float = 0.0
    end: Optional[float] = None


@dataclass
class _Links:
    """The collectives in flight, advanced in time only as far as a wait needs."""

    priority: dict[int, float]
    now: float = 0.0
    states: dict[int, _State] = field(default_factory=dict)
    queues: dict[str, deque] = field(default_factory=dict)
    free_at: dict[str, float] = field(default_factory=dict)

    def issue(self, c: Comm, t: float) -> None:
        # [Note: issue times never precede self.now: a wait advances the links to the end of what it waits
        # for and the compute clock to at least that time, and later issues happen at the compute clock]
        self.states[c.id] = _State(c, len(self.states), self.priority.get(c.id, float("inf")), t, left=c.transfer_s)
        self.queues.setdefault(c.stream, deque()).append(c.id)

    def finish(self, cid: int) -> float:
        s = self.states[cid]
        while s.end is None:
            self._advance()
        return s.end

    def _heads(self) -> list[_State]:
        out = []
        for stream, q in self.queues.items():
            if q:
                s = self.states[q[0]]
                if s.start is None:
                    s.start = max(s.issued, self.free_at.get(stream, 0.0))
                    s.latency_end = s.start + s.comm.latency_s
                out.append(s)
        return out

    def _advance(self) -> None:
        heads = self._heads()
        serving: dict[str, _State] = {}
        for s in heads:
            if s.latency_end <= self.now + EPS and s.left > EPS and s.comm.resource is not None:
                cur = serving.get(s.comm.resource)
                if cur is None or (s.priority, s.order) < (cur.priority, cur.order):
                    serving[s.comm.resource] = s
        times = [s.latency_end for s in heads if s.latency_end > self.now + EPS]
        times += [self.now for s in heads if s.latency_end <= self.now + EPS and (s.left <= EPS or s.comm.resource is None)]
        times += [self.now + s.left for s in serving.values()]
        t = min(times)
        for s in serving.values():
            s.left = max(0.0, s.left - (t - self.now))
        self.now = t
        for s in heads:
            if s.latency_end <= self.now + EPS and (s.left <= EPS or s.comm.resource is None):
                s.end = self.now
                self.queues[s.comm.stream].popleft()
                self.free_at[s.comm.stream] = self.now


def simulate(items: Sequence[Item], *, overlap: bool = True) -> Timeline:
    """Run ``items`` in order; ``overlap=False``: every collective blocks the compute stream where it is issued."""
    priority: dict[int, float] = {}
    for i, item in enumerate(items):
        if isinstance(item, Wait):
            for cid in item.ids:
                priority.setdefault(cid, float(i))
    links = _Links(priority)
    clock = 0.0
    spans: list[Span] = []
    issued: list[Comm] = []

    def stall(ids: tuple[int, ...], name: str) -> None:
        nonlocal clock
        end = max([links.finish(c) for c in ids], default=clock)
        if end > clock:
            spans.append(Span("stall", name, "", "", clock, end, ids))
            clock = end

    for item in items:
        if isinstance(item, Issue):
            links.issue(item.comm, clock)
            issued.append(item.comm)
            if not overlap or item.comm.stream == "compute":
                stall((item.comm.id,), item.comm.name)
        elif isinstance(item, Wait):
            stall(item.ids, item.name)
        else:
            w = item.work
            spans.append(Span("compute", w.name, w.unit, w.phase, clock, clock + w.seconds))
            clock += w.seconds
    comms = []
    for c in issued:  # [Note: a valid schedule waits for every collective; any left over still gets its span]
        end = links.finish(c.id)
        s = links.states[c.id]
        comms.append(CommSpan(c.id, c.name, c.stream, s.issued, s.start, end))
    return Timeline(clock, tuple(spans), tuple(comms))
