"""The thread that runs CPU offload's host optimizer steps, the one the next forward needs first, first.

>>> w = HostWorker()
>>> fut = w.submit(priority=0, fn=step, args=(hb,), ready=d2h_event)   # a concurrent.futures.Future

[Note: host step order] Gradients arrive in backward order (the last unit's first, the root's last), but the
next forward needs the root first. A first-in-first-out worker would step the root last, so the next
forward's first all-gather would wait for every host step of the step before. Here a job's priority is its
unit's position in the forward (the root 0): whenever the worker is free it takes, among the jobs whose
input is ready (``ready``: the CUDA event of the gradient's copy to the host; ``None``: ready), the one with
the smallest priority. The worker never idles while a job is ready, so the host work ends when it would
have in any order; what changes is which units are still pending when backward ends: the ones the forward
needs last. When no job is ready it waits for the oldest one's copy (the copies land in issue order on their
one stream). The order changes nothing in the math: each job steps its own buffer's tensors.

One thread: torch's CPU AdamW kernels use the intra-op pool themselves and release the GIL. The thread is a
daemon; a finalizer, run at exit and when the worker is collected, lets it finish the jobs queued (never a
half-written master at interpreter exit) and stops it.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(eq=False)
class Job:
    priority: int
    seq: int
    fn: Callable
    args: tuple
    future: Future
    ready: Any = None  # CUDA event: the job's input landed (None: ready now)

    def is_ready(self) -> bool:
        return self.ready is None or self.ready.query()


class _Queue:
    """What the worker's thread shares with its :class:`HostWorker`: the jobs and the lock (not the worker
    itself: [Note: the worker's thread holds no worker])."""

    def __init__(self):
        self.cv = threading.Condition()
        self.jobs: list[Job] = []
        self.stop = False

    def next(self) -> Job:
        ready = [j for j in self.jobs if j.is_ready()]
        pick = min(ready, key=lambda j: (j.priority, j.seq)) if ready else min(self.jobs, key=lambda j: j.seq)
        self.jobs.remove(pick)
        return pick


def _run(q: _Queue) -> None:
    # [Note: the worker's thread holds no worker] a job's arguments are the offloaded buffers, and through
    # them the executor with every device tensor of the model. The thread waits for the next job for as long
    # as the process lives; had it run a bound method of the worker, or kept its last job in a local, a model
    # and its optimizer deleted (a sweep building one after another) would keep their device memory and this
    # thread for good. The thread holds only the queue and no job between jobs; the worker's collection stops
    # it (``weakref.finalize`` in :meth:`HostWorker.submit`).
    while True:
        with q.cv:
            while not q.jobs and not q.stop:
                q.cv.wait()
            if not q.jobs:
                return
            job = q.next()
        if job.future.set_running_or_notify_cancel():
            try:
                job.future.set_result(job.fn(*job.args))
            except BaseException as exc:  # noqa: BLE001 - re-raised where the future's result is read
                job.future.set_exception(exc)
        job = None  # (nothing of it held while waiting for the next)


def _shutdown(q: _Queue, t: threading.Thread) -> None:
    with q.cv:
        q.stop = True
        q.cv.notify()
    if t is not threading.current_thread():
        t.join()


class HostWorker:
    """One thread running submitted jobs, the smallest priority among the ready ones first ([Note: host step
    order])."""

    def __init__(self, name: str = "shardplan-host-step"):
        self._q = _Queue()
        self._seq = 0
        self._name = name
        self._thread: Optional[threading.Thread] = None

    def submit(self, priority: int, fn: Callable, args: tuple = (), ready=None) -> Future:
        fut: Future = Future()
        q = self._q
        with q.cv:
            self._seq += 1
            q.jobs.append(Job(priority, self._seq, fn, args, fut, ready))
            if self._thread is None:
                self._thread = t = threading.Thread(target=_run, args=(q,), name=self._name, daemon=True)
                t.start()
                # run what is queued, then stop: at the worker's collection, and at exit (never a half-written
                # master at interpreter exit)
                weakref.finalize(self, _shutdown, q, t).atexit = True
            q.cv.notify()
        return fut

    def pending(self) -> int:
        with self._q.cv:
            return len(self._q.jobs)

    def shutdown(self) -> None:
        """Run what is queued, then stop the thread (idempotent)."""
        if self._thread is None:
            with self._q.cv:
                self._q.stop = True
            return
        _shutdown(self._q, self._thread)
