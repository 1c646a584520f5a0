"""What is live at a system's peak of allocated device memory, from torch's allocator trace, and how two
systems' peaks differ: the tool for a peak that differs by a few MiB where no tensor count explains it.

    with recording():                    # torch.cuda.memory._record_memory_history around the steps
        train()
    summary = live_at_peak(torch.cuda.memory._snapshot())
    diff(summary_a, summary_b)           # the groups whose bytes differ

The trace is replayed as the allocator's ``allocated_bytes`` counts it: a block counts from its ``alloc``
to its ``free_completed`` (a free whose stream uses are still pending counts until they complete), at its
block size (rounded by the allocator: a large block that is not split keeps the remainder of its segment,
which ``requested`` does not count). Blocks are grouped by where they were allocated: the first frame
outside torch's own files.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict


def _site(frames: list) -> str:
    """The first frame outside torch (the model's or the runtime's line that asked for the memory)."""
    for f in frames or ():
        name = f.get("filename", "")
        if "/torch/" not in name and not name.startswith("??"):
            return f"{'/'.join(name.rsplit('/', 2)[-2:])}:{f.get('line')} {f.get('name')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return "(no frames: allocated before recording)"


def live_at_peak(snapshot: dict, device: int = 0, top: int = 40) -> dict:
    """Replay ``snapshot['device_traces'][device]``: the peak of allocated bytes over the trace, the trace
    entry that reached it, and the blocks live then, grouped by site (bytes, count, sizes), largest first."""
    trace = snapshot["device_traces"][device]
    live: dict[int, tuple] = {}
    total = peak = 0
    peak_at = -1
    peak_live: dict[int, tuple] = {}
    for k, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], e.get("stream", 0), _site(e.get("frames")))
            total += e["size"]
            if total > peak:
                peak, peak_at = total, k
                peak_live = dict(live)
        elif action == "free_completed":
            got = live.pop(e["addr"], None)
            if got is not None:
                total -= got[0]
    groups: dict[str, dict] = defaultdict(lambda: {"bytes": 0, "count": 0, "streams": set()})
    for size, stream, site in peak_live.values():
        g = groups[site]
        g["bytes"] += size
        g["count"] += 1
        g["streams"].add(stream)
    rows = sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])
    reached = trace[peak_at] if peak_at >= 0 else {}
    return {"peak_bytes_traced": peak, "entries": len(trace),
            "peak_reached_by": {"site": _site(reached.get("frames")), "size": reached.get("size")},
            "groups": [{"site": s, "bytes": g["bytes"], "count": g["count"], "streams": sorted(g["streams"])}
                       for s, g in rows[:top]],
            "by_site": {s: g["bytes"] for s, g in rows}}


def diff(a: dict, b: dict, top: int = 30) -> list[dict]:
    """Sites whose live bytes at the peak differ between two :func:`live_at_peak` summaries, largest first."""
    sites = set(a["by_site"]) | set(b["by_site"])
    rows = [{"site": s, "a": a["by_site"].get(s, 0), "b": b["by_site"].get(s, 0)} for s in sites]
    rows = [dict(r, delta=r["a"] - r["b"]) for r in rows if r["a"] != r["b"]]
    return sorted(rows, key=lambda r: -abs(r["delta"]))[:top]


@contextlib.contextmanager
def recording(max_entries: int = 2_000_000):
    """Record the allocator's trace (with Python stacks) inside the block; take the snapshot inside it."""
    import torch
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
