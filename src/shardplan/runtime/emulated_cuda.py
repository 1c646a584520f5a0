"""The emulated network on a GPU: each process group's collectives run on its own comm stream, as NCCL's do,
each occupying it for its modelled time with kernels only (graph-capturable, no host sync): the copy that
writes the outputs (the memory traffic compute beside it sees) and a spin (``torch.cuda._sleep``) for the rest.

The spin is calibrated once per process and device: clock cycles per second of ``torch.cuda._sleep`` and the
device's copy bandwidth, both against CUDA events (:func:`calibration`).

>>> cal = calibration(torch.device("cuda", 0))          # doctest: +SKIP
>>> cal.cycles_per_s > 1e8                              # doctest: +SKIP
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import CollectiveError
from .emulated_spin import warm

_CALIBRATED: dict = {}


@dataclass(frozen=True)
class Calibration:
    """``torch.cuda._sleep``'s clock cycles per second and the device's copy bandwidth (bytes read plus
    written per second) on one device, measured against CUDA events."""

    cycles_per_s: float
    copy_bytes_per_s: float


def _timed(device: torch.device, work: Callable[[], None]) -> float:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        work()  # warm
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        work()
        b.record(stream)
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def calibration(device: torch.device) -> Calibration:
    """The spin's and the copy's rates on ``device``, measured once per process (not inside a graph capture:
    the first emulated collective on a device must run eagerly, as a capture's warm-up steps do)."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _CALIBRATED:
        if torch.cuda.is_current_stream_capturing():
            raise CollectiveError("the emulated network calibrates its spin on the first collective of a device, "
                                  "which cannot run inside a CUDA graph capture; run one eager step (or one "
                                  "collective) before capturing, as shardplan.capture's warm-up does")
        dev = torch.device("cuda", key)
        cycles = 20_000_000
        seconds = _timed(dev, lambda: torch.cuda._sleep(cycles))
        src = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        copy_s = _timed(dev, lambda: dst.copy_(src))
        _CALIBRATED[key] = Calibration(cycles / max(seconds, 1e-9), 2 * src.numel() / max(copy_s, 1e-9))
    return _CALIBRATED[key]


SPIN = {"ctas": 1}  # the SMs an emulated collective holds while it runs (NCCL's channels): ``configure(comm_ctas=)``


class CudaLink:
    """One process group's comm stream on one device: its ops spin on the GPU's global timer
    (:mod:`.emulated_spin`, wall-clock exact under any SM clock) where Triton is available, else on
    ``torch.cuda._sleep`` (clock cycles, calibrated idle: long under load)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.spin = None
        if not torch.cuda.is_current_stream_capturing():
            with torch.cuda.stream(self.stream):
                self.spin = warm(device, SPIN["ctas"])

    def run(self, fill: Callable[[], None], moved_bytes: int, seconds: float) -> torch.cuda.Event:
        """Queue one op on the comm stream after everything queued so far on the caller's current stream (as
        NCCL's work waits on it): ``fill`` (its copies move ``moved_bytes``, read plus written), then a spin
        for the rest of ``seconds``; the event recorded after it is what :meth:`wait` orders the caller on."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.spin is not None:
            with torch.cuda.stream(self.stream):
                self.spin.stamp()
                fill()
                self.spin.until(seconds)
                done = torch.cuda.Event()
                done.record(self.stream)
            return done
        cal = calibration(self.device)
        with torch.cuda.stream(self.stream):
            fill()
            # [Note: the copy's own time is estimated from the calibrated bandwidth, not measured (a measure
            # would sync the host or break a capture); beside compute it runs slower, so the op runs long by
            # the difference, as NCCL's would when its copies compete for HBM]
            left = seconds - moved_bytes / cal.copy_bytes_per_s
            if left > 0:
                torch.cuda._sleep(max(1, int(left * cal.cycles_per_s)))
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    @staticmethod
    def wait(done: torch.cuda.Event) -> None:
        """The caller's current stream waits for the op (``Work.wait()``, and at once for ``async_op=False``)."""
        torch.cuda.current_stream().wait_event(done)

    def drain(self) -> None:
        self.stream.synchronize()
