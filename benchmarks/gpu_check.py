"""One-GPU checks for the runtime (NCCL, world 1): parity for every strategy, schedule fidelity, and a
torch.profiler trace showing which CUDA streams the collectives and the compute ran on.

    SHARDPLAN_SINGLETON_GROUPS=1 python benchmarks/gpu_check.py --trace trace.json --out gpu_check.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
import gpt  # noqa: E402
from models import Toy, batches, toy_rules  # noqa: E402

import shardplan as sp  # noqa: E402
from _report import emit  # noqa: E402


def parity(strategy, dev, dtype=None):
    data = [(x.to(dev), y.to(dev)) for x, y in batches(3)]
    ref = Toy().to(dev)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for x, y in data:
        ref(x, y).backward()
        ropt.step()
        ropt.zero_grad()
    model = Toy().to(dev)
    plan = sp.plan(model, toy_rules(), sp.Mesh(dp=1), strategy=strategy, units=[r"blocks\.\d+"], compute_dtype=dtype, min_unit_bytes=0)
    sp.shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with sp.record_ops(model) as ops:
        for x, y in data:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    full = sp.checkpoint.full_state_dict(model, cpu=False)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return {"max_param_diff": diff, "ops_equal_schedule": ops == list(plan.ops()) * len(data), "ops": len(ops)}


def dynamic(dev):
    """Data-dependent use on CUDA streams: experts as units, a skipped block, a block called twice
    (order="dynamic"), reentrant checkpointing; parity with the same model trained unsharded."""
    from models import Dynamic, rank_batches
    out = {}
    for mode, units, order in [("moe", r"blocks\.\d+\.experts\.\d+", "static"), ("skip", r"blocks\.\d+", "static"),
                               ("twice", r"blocks\.\d+", "dynamic"), ("reentrant", r"blocks\.\d+", "static")]:
        data = [(x.to(dev), y.to(dev)) for x, y in rank_batches(4, 1)]
        ref, model = Dynamic(mode).to(dev), Dynamic(mode).to(dev)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        plan = sp.plan(model, [(r"gain", sp.P()), (r".*", sp.P("dp"))], sp.Mesh(dp=1), units=[units], order=order, min_unit_bytes=0)
        sp.shard(model, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step, (x, y) in enumerate(data):
            for m, o in ((ref, ropt), (model, opt)):
                m.step = step
                m(x, y).backward()
                o.step()
                o.zero_grad()
        full = sp.checkpoint.full_state_dict(model, cpu=False)
        out[f"{mode}/{order}"] = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return out


def trace(path, dev):
    model = gpt.build("small").init_weights(0).to(dev)
    plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=1), units=[r"layers\.\d+"], compute_dtype=torch.bfloat16, min_unit_bytes=0)
    sp.shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 512, (8, 128), device=dev)
    for _ in range(2):
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    streams = collections.defaultdict(collections.Counter)
    ranges = collections.Counter()
    for e in events:
        if e.get("cat") == "gpu_memcpy":
            streams["memcpy"][e.get("args", {}).get("stream", e.get("tid"))] += 1
        if e.get("cat") == "kernel":
            name = e["name"].lower()
            kind = "nccl" if "nccl" in name else ("gemm" if "gemm" in name or "sm90" in name or "cutlass" in name else "other")
            streams[kind][e.get("args", {}).get("stream", e.get("tid"))] += 1
        if e.get("name", "").startswith("shardplan."):
            ranges[e["name"].split(" ")[0]] += 1
    return {"kernel_streams": {k: dict(v) for k, v in streams.items()}, "shardplan_ranges": dict(ranges)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="trace.json")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "singleton_groups": os.environ.get("SHARDPLAN_SINGLETON_GROUPS") == "1"}
    out["parity_fp32"] = {s: parity(s, dev) for s in ["no_shard", "optim", "optim_grads", "optim_grads_params"]}
    out["parity_bf16_zero3"] = parity("optim_grads_params", dev, torch.bfloat16)
    out["dynamic_max_param_diff"] = dynamic(dev)
    out["trace"] = trace(args.trace, dev)
    emit(out, args.out)


if __name__ == "__main__":
    main()
