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
daemon; an ``atexit`` hook lets it finish the job it runs (never a half-written master at interpreter exit).
"""

from __future__ import annotations

import atexit
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


class HostWorker:
    """One thread running submitted jobs, the smallest priority among the ready ones first ([Note: host step
    order])."""

    def __init__(self, name: str = "shardplan-host-step"):
        self._cv = threading.Condition()
        self._jobs: list[Job] = []
        self._seq = 0
        self._stop = False
        self._name = name
        self._thread: Optional[threading.Thread] = None

    def submit(self, priority: int, fn: Callable, args: tuple = (), ready=None) -> Future:
        fut: Future = Future()
        with self._cv:
            self._seq += 1
            self._jobs.append(Job(priority, self._seq, fn, args, fut, ready))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
                ref = weakref.ref(self)
                atexit.register(lambda: ref() is not None and ref().shutdown())
            self._cv.notify()
        return fut

    def pending(self) -> int:
        with self._cv:
            return len(self._jobs)

    def shutdown(self) -> None:
        """Run what is queued, then stop the thread (idempotent)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    def _next(self) -> Job:
        ready = [j for j in self._jobs if j.is_ready()]
        pick = min(ready, key=lambda j: (j.priority, j.seq)) if ready else min(self._jobs, key=lambda j: j.seq)
        self._jobs.remove(pick)
        return pick

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stop:
                    self._cv.wait()
                if not self._jobs:
                    return
                job = self._next()
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(job.fn(*job.args))
            except BaseException as exc:  # noqa: BLE001 - re-raised where the future's result is read
                job.future.set_exception(exc)
