"""The compute side of the forecast on one GPU: the achievable rate of transformer blocks, and a whole
world-1 step against its forecast.

    python benchmarks/forecast_gpu.py --out benchmarks/results/forecast_h200_w1.json

1. Blocks: one examples/gpt.py block of the 1B, Llama-3-8B and 70B shapes, bf16, forward + backward at
   the batch a run would use; achieved TFLOP/s counted as the forecast counts them
   (shardplan.forecast.flops: 2 FLOPs per matrix weight per token, 4 T d per token for attention, backward
   twice the forward). This is where the H100/H200 compute presets' ``tflops`` comes from.
2. A step: GPT 1B with shardplan at world 1 (bf16 compute, fp32 reduce, AdamW foreach, batch 8 x 1024),
   forward / backward / optimizer timed with synchronisation, against ``plan.forecast`` with the
   h200-sxm-bf16 preset: predicted compute vs measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import gpt  # noqa: E402

import shardplan as sp  # noqa: E402
from shardplan.forecast.flops import unit_flops  # noqa: E402

BLOCKS = [("1B", 8, 1024), ("8B", 2, 8192), ("8B", 1, 4096), ("70B", 1, 4096)]


def cuda_time(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def block_rate(config: str, b: int, t: int, iters: int) -> dict:
    c = gpt.CONFIGS[config]
    block = gpt.Block(c).cuda().to(torch.bfloat16)
    x = torch.randn(b, t, c.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.device("meta"):
        one = torch.nn.Sequential(gpt.Block(c))
    plan = sp.plan(one, [(r".*", sp.P("dp"))], sp.Mesh(dp=1), units=[r"0"], min_unit_bytes=0)
    fwd_flops = unit_flops(plan, (b, t))["0"]

    def fwd():
        with torch.no_grad():
            block(x)

    def fwd_bwd():
        block(x).sum().backward()

    f = cuda_time(fwd, iters)
    fb = cuda_time(fwd_bwd, iters)
    del block, x
    torch.cuda.empty_cache()
    return {"config": config, "batch": [b, t], "forward_s": f, "forward_backward_s": fb, "backward_over_forward": (fb - f) / f,
            "forward_flops": fwd_flops, "tflops": 3 * fwd_flops / fb / 1e12, "forward_tflops": fwd_flops / f / 1e12}


def step_1b(steps: int) -> dict:
    tmp = tempfile.mkdtemp()
    dist.init_process_group("nccl", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = gpt.build("1B")
    model.to_empty(device="cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, 0.02)
    plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=1), units=[r"layers\.\d+"], compute_dtype=torch.bfloat16,
                   reduce_dtype=torch.float32)
    sp.shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x = torch.randint(0, 32000, (8, 1025), device="cuda")
    parts = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(x[:, :-1], x[:, 1:])
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        parts.append((t1 - t0, t2 - t1, t3 - t2))
    steady = parts[2:]
    med = [statistics.median(p[i] for p in steady) for i in range(3)]
    f = plan.forecast("h200-8x-ib400", batch=(8, 1024))
    dist.destroy_process_group()
    return {"measured": {"forward_s": med[0], "backward_s": med[1], "optimizer_s": med[2], "step_s": sum(med)},
            "forecast": {"forward_s": f.forward_s, "backward_s": f.backward_s, "optimizer_s": f.optimizer_s,
                         "step_s": f.step_s, "compute": f.compute.to_dict()},
            "compute_ratio": f.compute_s / sum(med)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "blocks": []}
    for config, b, t in BLOCKS:
        r = block_rate(config, b, t, args.iters)
        out["blocks"].append(r)
        print(f"{config} block at {b}x{t}: {r['forward_backward_s'] * 1e3:.2f} ms fwd+bwd, {r['tflops']:.1f} TFLOP/s "
              f"(forward alone {r['forward_tflops']:.1f}), backward/forward {r['backward_over_forward']:.2f}", flush=True)
    out["step_1b"] = step_1b(args.steps)
    s = out["step_1b"]
    print(f"1B step at world 1: measured {s['measured']['step_s'] * 1e3:.1f} ms, forecast compute "
          f"{s['forecast']['step_s'] * 1e3:.1f} ms, ratio {s['compute_ratio']:.3f}", flush=True)
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
