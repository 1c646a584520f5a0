"""The host AdamW of CPU offload, alone: per-element cost of torch's CPU AdamW kernels, by thread count.

    python benchmarks/host_adamw.py                               # 16M fp32 elements, every variant, 1..N threads
    python benchmarks/host_adamw.py --numel 60000000 --threads 4,8,12,16 --worker --out host_adamw.json

The offloaded optimizer (runtime/offload/) steps one flat host tensor per buffer with
``torch.optim.adamw.adamw``; which kernel runs is ``fused`` (torch's ``_fused_adamw_``, CPU since 2.4),
``foreach`` (``_foreach_*`` over a list of tensors: here the buffer cut into ``--pieces`` views, as the
per-parameter state would be) or ``single`` (the for-loop over tensors). Each step reads param, grad and
both moments and writes param and moments: 28 bytes per fp32 element, so ``GB/s`` says how close a
kernel is to the host's memory bandwidth. ``--worker`` also runs the fused kernel in a second Python
thread (as the overlapped host step does) while the main thread spins in Python, to show what the
step costs when it shares the CPU with the training loop. Absolute times depend on the host; ratios between
kernels and thread counts are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch
from torch.optim.adamw import adamw


def tensors(numel: int, pieces: int):
    g = torch.Generator().manual_seed(0)
    flat = [torch.randn(numel, generator=g) for _ in range(2)] + [torch.zeros(numel), torch.zeros(numel)]
    if pieces <= 1:
        return [[t] for t in flat]
    return [list(t.chunk(pieces)) for t in flat]


def step(state, steps, variant: str) -> None:
    p, g, m, v = state
    kw = dict(fused=variant == "fused", foreach=variant == "foreach") if variant != "single" else \
        dict(fused=False, foreach=False)
    adamw(p, g, m, v, [], steps, amsgrad=False, beta1=0.9, beta2=0.95, lr=1e-4, weight_decay=0.1, eps=1e-8,
          maximize=False, **kw)


def timed(numel: int, variant: str, pieces: int, reps: int) -> float:
    state = tensors(numel, 1 if variant == "fused" else pieces)
    steps = [torch.tensor(0.0) for _ in state[0]]
    with torch.no_grad():
        step(state, steps, variant)  # warm-up
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step(state, steps, variant)
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def in_worker(numel: int, reps: int) -> float:
    """The fused step in a second thread while the main thread runs Python (the training loop's share)."""
    result = {}
    done = threading.Event()

    def work():
        result["s"] = timed(numel, "fused", 1, reps)
        done.set()

    t = threading.Thread(target=work)
    t.start()
    n = 0
    while not done.is_set():
        n += 1  # the main thread keeps the GIL busy, as a training loop launching kernels does
    t.join()
    return result["s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=16 * 2**20)
    ap.add_argument("--pieces", type=int, default=64, help="views the foreach/single variants step (per-parameter)")
    ap.add_argument("--threads", default="", help="comma list (default: 1 and torch's default)")
    ap.add_argument("--variants", default="fused,foreach,single")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help="also time the fused step in a second thread")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    default = torch.get_num_threads()
    threads = [int(x) for x in a.threads.split(",") if x] or sorted({1, default})
    rows = []
    for n in threads:
        torch.set_num_threads(n)
        for variant in a.variants.split(","):
            s = timed(a.numel, variant, a.pieces, a.reps)
            rows.append(dict(threads=n, variant=variant, s=s))
        if a.worker:
            rows.append(dict(threads=n, variant="fused_in_worker", s=in_worker(a.numel, a.reps)))
    torch.set_num_threads(default)
    base = {r["threads"]: r["s"] for r in rows if r["variant"] == "fused"}
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, numel {a.numel:,d} fp32 (28 B/element per step)")
    print(f"{'threads':>7} {'variant':>16} {'ms':>9} {'ns/elem':>8} {'GB/s':>7} {'x fused':>8}")
    for r in rows:
        r.update(ns_per_elem=r["s"] / a.numel * 1e9, gb_s=28 * a.numel / r["s"] / 1e9,
                 vs_fused=r["s"] / base[r["threads"]] if r["threads"] in base else None)
        vs = f"{r['vs_fused']:.2f}" if r["vs_fused"] else "-"
        print(f"{r['threads']:>7} {r['variant']:>16} {r['s'] * 1e3:9.2f} {r['ns_per_elem']:8.3f} {r['gb_s']:7.1f} "
              f"{vs:>8}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(torch=torch.__version__, cpus=os.cpu_count(), numel=a.numel, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
