"""One code path for CPU and CUDA: side streams and events on CUDA, nothing on CPU.

Buffers are always allocated on the compute stream; a side stream waits for the compute stream
before a collective reads them, and the compute stream waits for the side stream's event before
it reads a result. We keep Python references to every tensor a collective uses until the compute
stream has waited on that collective, so the caching allocator never recycles a buffer in use
(no ``record_stream``, as in FSDP2).
"""

from __future__ import annotations

import contextlib

import torch


class Streams:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.gather = torch.cuda.Stream(device)
            self.reduce = torch.cuda.Stream(device)

    def on(self, which: str):
        """Context: run on the ``gather`` or ``reduce`` side stream, after all compute queued so far."""
        if not self.cuda:
            return contextlib.nullcontext()
        side = getattr(self, which)
        side.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(side)

    def event(self, which: str):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(getattr(self, which))
        return ev

    def side_waits(self, which: str, event) -> None:
        """The ``gather`` or ``reduce`` side stream waits for ``event`` (work on another stream: a host copy)."""
        if self.cuda and event is not None:
            getattr(self, which).wait_event(event)

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


def join(side) -> None:
    """The current CUDA stream waits for everything queued on ``side`` so far, also while a graph is captured."""
    # [Note: joining a side stream under capture] a capturing stream may wait only on work of the same capture:
    # waiting on a side stream that has run nothing since the capture (or the segment, [Note: a step in
    # segments]) began fails with cudaErrorStreamCaptureIsolation ("dependency created on uncaptured work in
    # another stream"). Under capture the side stream first waits on the current one, which pulls it into the
    # capture (the work it ran before is settled: a capture starts with nothing in flight); the wait back then
    # joins it, as a capture must end.
    cur = torch.cuda.current_stream()
    if torch.cuda.is_current_stream_capturing():
        side.wait_stream(cur)
    cur.wait_stream(side)
