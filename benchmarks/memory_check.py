"""Plan vs reality on GPU: measured peak memory against ``plan.memory().peak``, activations made
negligible (batch 1 x 16), AdamW fused (no foreach temporaries), for each strategy.

    python3 benchmarks/memory_check.py --config 1B --out memory_check.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
import gpt  # noqa: E402

import shardplan as sp  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1B")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29720")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    out = {"config": args.config, "world": world, "device": torch.cuda.get_device_name(), "runs": []}
    for strategy in ("optim_grads_params", "optim_grads", "optim", "no_shard"):
        for dtype in (torch.bfloat16, None):
            gc.collect()
            torch.cuda.empty_cache()
            with torch.device("meta"):
                model = gpt.build(args.config)
            plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), strategy=strategy, units=[r"layers\.\d+"],
                           compute_dtype=dtype, min_unit_bytes=0)
            sp.shard(model, plan)  # meta init: only shards are materialised
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            x = torch.randint(0, gpt.CONFIGS[args.config].vocab, (1, 16), device=dev)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(3):
                model(x, x).backward()
                opt.step()
                opt.zero_grad()
            torch.cuda.synchronize()
            measured = torch.cuda.max_memory_allocated()
            mem = plan.memory(dist.get_rank())
            out["runs"].append({"strategy": strategy, "compute_dtype": str(dtype), "measured_peak": measured,
                                "planned_peak": mem.peak, "ratio": measured / mem.peak, "after_shard": base,
                                "planned_params": mem.params})
            print(f"{strategy:<20} {str(dtype):<15} measured {measured / 2**30:7.2f} GiB  planned {mem.peak / 2**30:7.2f} GiB"
                  f"  ratio {measured / mem.peak:.3f}", flush=True)
            del model, opt
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
