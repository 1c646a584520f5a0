"""Own work per unit: 200 tiny blocks (d 32) where the runtime's per-unit cost dominates, world 1.

    python benchmarks/hook_overhead.py --out overhead.json

Forward + backward only (no optimizer), fp32, CPU or the current GPU; reports the time per unit per
step that shardplan and FSDP2 add over the unsharded model (in wall time, and in CPU time of the training
thread, which other processes on the machine move less), and shardplan's own hook time (forward module
hooks; backward hooks and callbacks).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
import gpt  # noqa: E402

import shardplan as sp  # noqa: E402
from _report import emit  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the runtime's parts per unit and step (inclusive: nested parts count in both)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29700 + os.getpid() % 200))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda" if cuda else "cpu")
    torch.set_num_threads(1)
    units = 201

    def make():
        return gpt.build("tiny200", dim=32, ffn=64, vocab=256, heads=2, kv_heads=2, max_seq=16).init_weights(0).to(dev)

    x = torch.randint(0, 256, (1, 8), device=dev)

    cpu = {}

    def bench(m, name):
        for _ in range(2):
            m(x, x).backward()
        if cuda:
            torch.cuda.synchronize()
        t, c = time.perf_counter(), time.thread_time()
        for _ in range(args.steps):
            m(x, x).backward()
        cpu[name] = (time.thread_time() - c) / args.steps  # this thread's CPU time: robust to a busy machine
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / args.steps

    base = bench(make(), "unsharded")
    m = make()
    sp.shard(m, sp.plan(m, [(r".*", sp.P("dp"))], sp.Mesh(dp=1), units=[r"layers\.\d+"], min_unit_bytes=0))
    eng = sp.runtime.engine_of(m)
    ts = bench(m, "shardplan")
    hooks = eng.hook_seconds / (args.steps + 2) / units
    bwd_hooks = eng.backward_seconds / (args.steps + 2) / units
    parts = breakdown(m, x, args.steps, units) if args.breakdown else None
    from torch.distributed.fsdp import fully_shard
    f = make()
    for layer in f.layers:
        fully_shard(layer)
    fully_shard(f)
    tf = bench(f, "fsdp2")
    out = {"device": str(dev), "unsharded_ms": base * 1e3, "shardplan_ms": ts * 1e3, "fsdp2_ms": tf * 1e3,
           "shardplan_us_per_unit": (ts - base) / units * 1e6, "fsdp2_us_per_unit": (tf - base) / units * 1e6,
           "shardplan_hook_us_per_unit": hooks * 1e6, "shardplan_backward_hook_us_per_unit": bwd_hooks * 1e6,
           # the same differences in CPU time (time.thread_time of the training thread): what each system's own
           # work costs the host per unit and step, unmoved by other processes on the machine
           "shardplan_cpu_us_per_unit": (cpu["shardplan"] - cpu["unsharded"]) / units * 1e6,
           "fsdp2_cpu_us_per_unit": (cpu["fsdp2"] - cpu["unsharded"]) / units * 1e6}
    if parts:
        out["shardplan_parts_us_per_unit"] = parts
    emit(out, args.out)


# the runtime's parts, by what they do (executor events and ops, the comm engine, buffers, the module face)
PARTS = {"executor": ("pre_forward", "post_forward", "pre_backward", "on_grad", "_run_step"),
         "comm": ("gather", "finish_gather", "reduce", "finish_reduce"),
         "buffers": ("gather_output", "gather_input", "collect_grads", "land_grads", "assign_local_grads",
                     "release_full", "release_grads"),
         "faces": ("bind", "unbind", "deliver")}


def breakdown(m, x, steps: int, units: int) -> dict:
    """Wall time inside each runtime part per unit and step (timers wrapped around the methods, so the
    figures include the timers' own ~0.2 us a call; inclusive: a part's callees count in it too)."""
    import functools
    from collections import Counter

    from shardplan.runtime import buffers, comm, executor, faces
    owners = {"executor": executor.Executor, "comm": comm.CommEngine, "buffers": buffers.BufferState,
              "faces": faces.ModuleFace}
    spent, calls, saved = Counter(), Counter(), []
    for part, names in PARTS.items():
        cls = owners[part]
        for name in names:
            fn = getattr(cls, name)
            key = f"{cls.__name__}.{name}"

            def timed(*a, _fn=fn, _key=key, **k):
                t = time.perf_counter_ns()
                try:
                    return _fn(*a, **k)
                finally:
                    spent[_key] += time.perf_counter_ns() - t
                    calls[_key] += 1
            saved.append((cls, name, fn))
            setattr(cls, name, functools.wraps(fn)(timed))
    try:
        m(x, x).backward()
        spent.clear()
        calls.clear()
        for _ in range(steps):
            m(x, x).backward()
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)
    return {k: {"us": v / 1e3 / steps / units, "calls": calls[k] / steps / units}
            for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    main()
