"""The emulated network's clock: what one collective of an emulated process group costs (the forecast's α–β
network model, :mod:`shardplan.forecast.network`), the per-process ledger of what ran, and the CPU's comm
thread, which plays a group's stream on a host (one FIFO thread per process group).

>>> from shardplan.forecast.network import network
>>> t = op_seconds(network("h100-8x-ib400"), "all_gather", 2**30, group_placement(network("h100-8x-ib400"), range(8)))
>>> round(t * 1e3, 2)                          # 1 GiB gathered over the 8 GPUs of one node, ms
2.62
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from ..errors import CollectiveError
from ..forecast.network import Network, Placement, collective_time

OP_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "barrier", "send", "recv")
"""The ledger's op kinds (coalesced and ``_into_tensor`` forms count under their collective's kind)."""

SPANS_KEPT = 100_000
"""The ledger keeps the last this many spans of the CPU comm threads (for a Chrome trace of a step)."""


def group_placement(net: Network, global_ranks: Sequence[int]) -> Placement:
    """Where a group of ``global_ranks`` sits on ``net``'s nodes (rank ``r`` on node ``r // gpus_per_node``)."""
    ranks = list(global_ranks)
    counts: dict[int, int] = {}
    for r in ranks:
        counts[r // net.gpus_per_node] = counts.get(r // net.gpus_per_node, 0) + 1
    link = "local" if len(ranks) <= 1 else "intra" if len(counts) == 1 else "inter"
    return Placement(("group",), len(ranks), max(len(counts), 1), min(counts.values(), default=1), link)


def op_seconds(net: Network, kind: str, payload: int, where: Placement) -> float:
    """Modelled seconds of one ``kind`` op of ``payload`` bytes (the gathered output, the reduce-scatter's
    input, the all-reduce's tensor, the all-to-all's input, the broadcast's or a send's tensor) over ``where``.

    All-gather, reduce-scatter, all-reduce and all-to-all are :func:`~shardplan.forecast.network.collective_time`
    (rings, and NCCL's tree for an all-reduce across nodes). A broadcast and a send move ``payload`` bytes at
    the link's bus bandwidth (nccl-tests' busbw of a broadcast is its algbw): timed as the all-gather whose
    ring sends ``payload`` bytes per rank. A barrier is NCCL's: an all-reduce of one element.
    """
    n = where.size
    if n <= 1:
        return 0.0
    if kind in ("broadcast", "send", "recv"):
        return collective_time(net, "all_gather", int(payload * n / (n - 1)), where).seconds
    if kind == "barrier":
        return collective_time(net, "all_reduce", 4, where).seconds
    return collective_time(net, kind, int(payload), where).seconds


@dataclass(frozen=True)
class LedgerEntry:
    """One op kind's total since the last reset: ops ``count``, payload ``bytes`` (as :func:`op_seconds`
    counts them), ``modelled_s`` (the time each op was given, summed), and ``waited_s``: the host time callers
    spent blocked in ``Work.wait()`` on a CPU comm thread until the op's modelled end (measured; the threads'
    own wake-up delays left out; ``0.0`` where every op ran on CUDA streams, whose waits are stream waits the
    host does not see)."""

    count: int = 0
    bytes: int = 0
    modelled_s: float = 0.0
    waited_s: float = 0.0


@dataclass(frozen=True)
class Span:
    """One op on a CPU comm thread: ``kind``, the group's name, its payload bytes, and its start and end on
    ``time.perf_counter``'s clock (the thread's FIFO order: it starts when the previous op of its group ends)."""

    kind: str
    group: str
    bytes: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Ledger:
    """What the emulated network ran in this process since the last :func:`reset_ledger`, per op kind.

    >>> led = Ledger({"all_gather": LedgerEntry(2, 1024, 0.5, 0.1)}, "h100-8x-ib400")
    >>> led.modelled_s, led["all_gather"].count
    (0.5, 2)
    """

    by_kind: dict
    network: str = ""

    def __getitem__(self, kind: str) -> LedgerEntry:
        return self.by_kind.get(kind, LedgerEntry())

    @property
    def modelled_s(self) -> float:
        return sum(e.modelled_s for e in self.by_kind.values())

    @property
    def waited_s(self) -> float:
        return sum(e.waited_s for e in self.by_kind.values())

    def to_dict(self) -> dict[str, Any]:
        return {"network": self.network, "by_kind": {k: dataclasses.asdict(e) for k, e in sorted(self.by_kind.items())}}


class _Book:
    """The process's ledger (thread-safe: comm threads and callers write it), and which op kinds are timed
    (``timed``: ``None``, all; else the kinds given their modelled time, the others none)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.entries: dict[str, LedgerEntry] = {}
        self.spans: collections.deque = collections.deque(maxlen=SPANS_KEPT)
        self.network = ""
        self.timed: Optional[frozenset] = None

    def scale(self, kind: str) -> float:
        return 1.0 if self.timed is None or kind in self.timed else 0.0

    def issued(self, kind: str, nbytes: int, seconds: float) -> None:
        with self.lock:
            e = self.entries.get(kind, LedgerEntry())
            self.entries[kind] = LedgerEntry(e.count + 1, e.bytes + int(nbytes), e.modelled_s + seconds, e.waited_s)

    def waited(self, kind: str, seconds: float) -> None:
        with self.lock:
            e = self.entries.get(kind, LedgerEntry())
            self.entries[kind] = dataclasses.replace(e, waited_s=e.waited_s + seconds)

    def span(self, s: Span) -> None:
        with self.lock:
            self.spans.append(s)

    def snapshot(self) -> Ledger:
        with self.lock:
            return Ledger(dict(self.entries), self.network)

    def reset(self) -> None:
        with self.lock:
            self.entries.clear()
            self.spans.clear()


BOOK = _Book()


def ledger() -> Ledger:
    """What the emulated network ran in this process since the last :func:`reset_ledger`: per op kind its
    count, bytes, modelled seconds and (CPU) seconds waited.

    >>> reset_ledger(); ledger().modelled_s
    0.0
    """
    return BOOK.snapshot()


def reset_ledger() -> None:
    """Empty the ledger and the kept spans (:func:`ledger`, :func:`spans`).

    >>> reset_ledger()
    """
    BOOK.reset()


@contextlib.contextmanager
def timed_kinds(kinds: Optional[Sequence[str]] = None) -> Iterator[None]:
    """Inside, only ops of ``kinds`` take their modelled time (``()``: none, the network switched off; ``None``:
    all); the others complete at once, with the same outputs. The ledger counts the time each op was given.
    A rehearsal measures its exposed communication with it (the same steps, timed and not).

    >>> with timed_kinds(()):
    ...     pass
    """
    before = BOOK.timed
    BOOK.timed = None if kinds is None else frozenset(kinds)
    try:
        yield
    finally:
        BOOK.timed = before


def spans(since: float = float("-inf")) -> list[Span]:
    """The CPU comm threads' spans that ended after ``since`` (``time.perf_counter`` seconds), in end order.

    >>> spans(since=time.perf_counter())
    []
    """
    with BOOK.lock:
        return [s for s in BOOK.spans if s.end_s > since]


# -- the CPU's comm thread ---------------------------------------------------------------------------------

@dataclass
class Job:
    """One op queued on a comm thread: its ledger ``kind``, payload ``nbytes``, ``seconds`` (modelled) and
    ``fill`` (writes the outputs, as torch's fake process group does); ``done`` is set when it has ended."""

    kind: str
    nbytes: int
    seconds: float
    fill: Callable[[], None]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: Optional[BaseException] = None
    issued_s: float = dataclasses.field(default_factory=time.perf_counter)
    end_s: float = 0.0


class CommThread:
    """A process group's stream on a host: one daemon thread runs its jobs in issue order, each for its
    modelled time (the outputs written first, then a sleep for the rest), so compute on the caller's thread
    overlaps the communication for real. :meth:`stop` drains it."""

    def __init__(self, name: str):
        self.name = name
        self.clock = 0.0  # the modelled end of the last op: the stream's own time
        self.queue: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"shardplan-emulated-{name}", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Job:
        self.queue.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            # [Note: the stream's clock] an op starts when it was issued or when the previous op of this group
            # ended (FIFO, as a stream), and ends its modelled time later: writing the outputs counts inside it
            # (only an op whose copy alone takes longer than the network would runs late). Both are the model's
            # times, not when this thread happened to wake up, so a loaded host's scheduling delays neither
            # shift the later ops nor count as time compute waited on the network (wait_job)
            start = max(job.issued_s, self.clock)
            try:
                job.fill()
            except BaseException as exc:  # handed to the waiter, which names the op
                job.error = exc
            job.end_s = self.clock = max(start + job.seconds, time.perf_counter())
            left = job.end_s - time.perf_counter()
            if left > 0:
                time.sleep(left)
            BOOK.span(Span(job.kind, self.name, job.nbytes, start, job.end_s))
            job.done.set()

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join()


def wait_job(job: Job, timeout_s: Optional[float] = None) -> None:
    """Block until ``job`` has ended; the time from the call to the op's modelled end goes to the ledger as
    ``waited_s`` of its kind (the threads' own wake-up delays left out: [Note: the stream's clock])."""
    t0 = time.perf_counter()
    finished = job.done.wait(timeout_s)
    BOOK.waited(job.kind, max(0.0, min(job.end_s, time.perf_counter()) - t0) if finished else time.perf_counter() - t0)
    if not finished:
        raise CollectiveError(f"emulated {job.kind} of {job.nbytes} bytes did not end within {timeout_s} s "
                              f"(modelled {job.seconds:.6f} s); its comm thread is stuck or the timeout is shorter "
                              f"than the modelled time")
    if job.error is not None:
        raise CollectiveError(f"emulated {job.kind} of {job.nbytes} bytes failed writing its outputs: "
                              f"{job.error}") from job.error
