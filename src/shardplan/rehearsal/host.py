"""The host's memory during a rehearsal (Linux): the process's RSS and its high-water mark from ``/proc``,
the mark's reset, and glibc's mmap threshold fixed so that freed tensors go back to the system."""

from __future__ import annotations

from typing import Optional


def _host_rss(field: str = "VmRSS") -> Optional[int]:
    """This process's resident memory (``VmRSS``) or its high-water mark (``VmHWM``) in bytes (Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_host_peak() -> bool:
    """Reset the process's RSS high-water mark (``VmHWM``), so that it measures from now (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


HOST_MMAP_THRESHOLD = 128 * 1024  # glibc's initial M_MMAP_THRESHOLD, kept fixed


def fix_host_allocator() -> Optional[str]:
    """On glibc, fix malloc's mmap threshold at its initial 128 KiB for the rest of this process, so that a
    freed tensor's memory goes back to the system; returns a note saying so (``None``: not glibc, nothing done).

    [Note: glibc keeps the model] glibc raises its mmap threshold to the size of each mmapped block freed
    (up to 32 MiB). After the first unit's full tensors are freed, tensors of that size come from the heap,
    and the next unit's, interleaved with the shards and states that stay, cannot be handed back: rank 0 of
    64 of a GPT whose fp32 parameters take 673 MB grew by 1.7 GB (by the model during start-up, and again in
    the first step) while the runtime held 124 MiB and the plan's peak was 145 MiB; with the threshold fixed
    it grows by 135 MB. ``malloc_trim`` shows the memory was free, not held: the allocator's, not the
    runtime's. [A setting of the whole process, as ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment
    would make it; only a CPU rehearsal, whose host memory is the device memory it measures, sets it.]"""
    import ctypes
    import sys
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # glibc only (musl has no dynamic threshold to fix)
    except (OSError, AttributeError):
        return None
    M_MMAP_THRESHOLD = -3  # malloc.h
    if libc.mallopt(M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD) != 1:
        return None
    return ("host allocator: glibc's mmap threshold is fixed at 128 KiB in this process (mallopt M_MMAP_THRESHOLD), "
            "so freed tensors go back to the system; its dynamic threshold kept each unit's freed full tensors in "
            "the heap, and the process grew by about the model's size")
