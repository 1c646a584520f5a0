"""Where a training step's time goes: torch.profiler over a few steps of each system, CPU side and
device timeline, summarised as JSON (and Chrome traces to open in Perfetto).

    python benchmarks/profile_step.py --config tiny200 --batch 8 --seq 1024 --dtype bf16 --out-dir prof/
    python benchmarks/profile_step.py --config small --systems shardplan,unsharded --out-dir prof/   # CPU

Per system: the step's wall time, the CPU time of each runtime op (the executor's
``shardplan.<kind> <what>`` ranges, summed per kind), the host time spent in module hooks, the top
operators by self CPU time, and (CUDA) the device's busy time and its top kernels. The same model,
batches and options as ``benchmarks/train_step.py``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_step as T  # noqa: E402


def _profile(name, args, dev, world):
    from torch.profiler import ProfilerActivity, profile
    model, opt, ctx, info = T.make_system(name, args, dev, world)
    data = T.batches(args, dev, dist.get_rank(), world, args.warmup + args.steps)
    T.run_steps(model, opt, ctx, data[:args.warmup], dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts, record_shapes=False) as prof:
        t0 = time.perf_counter()
        T.run_steps(model, opt, ctx, data[args.warmup:], dev)
        wall = (time.perf_counter() - t0) / args.steps
    events = prof.key_averages()
    runtime = collections.Counter()
    for e in events:
        if e.key.startswith("shardplan."):
            runtime[" ".join(e.key.split(" ")[:2])] += e.cpu_time_total / args.steps
    top_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    out = {"system": name, "step_ms": wall * 1e3, "units": info.get("units"),
           "runtime_ops_cpu_us_per_step": dict(runtime.most_common()),
           "runtime_ops_cpu_us_per_unit": (sum(runtime.values()) / info["units"]) if info.get("units") else None,
           "top_self_cpu_us_per_step": {e.key: e.self_cpu_time_total / args.steps for e in top_cpu}}
    if dev.type == "cuda":
        kernels = [e for e in events if getattr(e, "self_device_time_total", 0) > 0]
        out["device_busy_ms_per_step"] = sum(e.self_device_time_total for e in kernels) / args.steps / 1e3
        out["top_kernels_us_per_step"] = {e.key: e.self_device_time_total / args.steps for e in
                                          sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:args.top]}
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.out_dir, f"{args.config}_{name}_rank{dist.get_rank()}.trace.json"))
    del model, opt
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--systems", default="shardplan,unsharded")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--min-unit-bytes", type=int, default=None)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out-dir", default=None, help="Chrome traces and profile.json go here")
    args = ap.parse_args()
    for k, v in vars(T.parser().parse_args([])).items():  # train_step's other options, at their defaults
        if not hasattr(args, k):
            setattr(args, k, v)
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    results = []
    for name in args.systems.split(","):
        if name == "unsharded" and world > 1:
            continue
        results.append(_profile(name, args, dev, world))
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        text = json.dumps({"config": args.config, "world": world, "torch": torch.__version__,
                           "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "results": results}, indent=1)
        print(text)
        if args.out_dir:
            with open(os.path.join(args.out_dir, f"profile_{args.config}.json"), "w") as f:
                f.write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
