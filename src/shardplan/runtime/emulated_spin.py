"""The wall-clock spin of an emulated collective on a GPU: kernels that hold the comm stream (and ``ctas`` SMs,
as NCCL's channels hold theirs) until a set time on the GPU's global timer has passed since the op began.

[Note: why the global timer, not ``torch.cuda._sleep``] ``_sleep`` spins a number of SM clock cycles, and the SM
clock moves with load: calibrated on an idle H200 (1980 MHz) a 10 ms spin took 14.5 ms beside bf16 matmuls
(the clock down to about 1500 MHz), so every emulated collective ran 44% long exactly when it overlapped
compute. ``%globaltimer`` counts nanoseconds whatever the clock: the same spin took 10.07 ms idle and 10.30 ms
loaded. The op stamps the timer when it starts on its stream and spins until ``start + seconds``, so its copies
(the outputs, the memory traffic) count inside its time, however fast they ran beside compute.]

>>> spin = Spin(torch.device("cuda", 0), ctas=1)      # doctest: +SKIP
>>> spin.stamp(); out.copy_(inp); spin.until(2e-3)    # the op takes 2 ms, the copy included   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Optional

import torch

_KERNELS: dict = {}


def _kernels():
    """``(stamp, spin)``: the two Triton kernels, compiled on first use; ``None`` without Triton."""
    if "k" in _KERNELS:
        return _KERNELS["k"]
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _KERNELS["k"] = None
        return None

    @triton.jit
    def _now(dummy):
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [dummy], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def stamp(slot_ptr):
        x = tl.load(slot_ptr)
        tl.store(slot_ptr, _now(x))

    @triton.jit
    def spin(slot_ptr, ns):
        start = tl.load(slot_ptr)
        t = _now(start)
        while t - start < ns:
            t = _now(start)

    _KERNELS["k"] = (stamp, spin)
    return _KERNELS["k"]


def available() -> bool:
    """Whether the global-timer spin can run here (Triton importable); else the caller falls back to
    ``torch.cuda._sleep``."""
    return _kernels() is not None


class Spin:
    """One comm stream's timer slot: :meth:`stamp` when an op starts on the stream, :meth:`until` to hold the
    stream (on ``ctas`` SMs) until ``seconds`` after the stamp. Both are enqueued on the current stream."""

    def __init__(self, device: torch.device, ctas: int = 1):
        self.slot = torch.zeros(1, dtype=torch.int64, device=device)
        self.ctas = max(1, int(ctas))

    def stamp(self) -> None:
        _kernels()[0][(1,)](self.slot)

    def until(self, seconds: float) -> None:
        _kernels()[1][(self.ctas,)](self.slot, max(0, int(seconds * 1e9)))


def warm(device: torch.device, ctas: int = 1) -> Optional[Spin]:
    """Compile both kernels and run them once on ``device`` (not inside a capture); ``None`` without Triton."""
    if not available():
        return None
    s = Spin(device, ctas)
    s.stamp()
    s.until(1e-6)
    torch.cuda.synchronize(device)
    return s
