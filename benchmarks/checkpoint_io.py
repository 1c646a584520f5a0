"""Checkpoint save/load throughput: shardplan vs FSDP2 + DCP, same model, same run, same disk.

    torchrun --standalone --nproc-per-node 2 benchmarks/checkpoint_io.py --config 1B --out ckpt.json

Saves and loads model parameters plus AdamW state (initialised by one step) with each system,
alternating, and reports GB/s of checkpoint bytes (fp32 params + 2 fp32 states).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
import gpt  # noqa: E402

import shardplan as sp  # noqa: E402
from _report import emit  # noqa: E402


def build(config):
    torch.manual_seed(0)
    return gpt.build(config)


def one_step(model, opt, config):
    x = torch.randint(0, gpt.CONFIGS[config].vocab, (1, 8))
    model(x, x).backward()
    opt.step()
    opt.zero_grad()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1B")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--order", default="shardplan,fsdp2", help="which system runs first (disk caches favour the second)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = args.dir or tempfile.gettempdir()
    base = os.path.join(root, "shardplan_ckpt_bench")
    with torch.device("meta"):
        n = sum(p.numel() for p in build(args.config).parameters())
    nbytes = n * 4 * 3
    times = {}
    # One system at a time (a 1B model with AdamW state twice over does not fit two CPU ranks here);
    # both start on the meta device so no rank ever holds the full model.
    for s in args.order.split(","):
        with torch.device("meta"):
            m = build(args.config)
        if s == "shardplan":
            plan = sp.plan(m, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"layers\.\d+"])
            sp.shard(m, plan)
        else:
            from torch.distributed.fsdp import fully_shard
            for layer in m.layers:
                fully_shard(layer)
            fully_shard(m)
            m.to_empty(device="cpu")
            with torch.no_grad():
                for p in m.parameters():
                    p.normal_(0, 0.02)
        o = torch.optim.AdamW(m.parameters())
        one_step(m, o, args.config)
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        times[s] = {"save": [], "load": []}
        for r in range(args.rounds):
            path = f"{base}_{s}_{r}"
            dist.barrier()
            t = time.perf_counter()
            if s == "shardplan":
                sp.checkpoint.save(path, m, o, step=1)
            else:
                msd, osd = get_state_dict(m, o)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
            dist.barrier()
            times[s]["save"].append(time.perf_counter() - t)
            t = time.perf_counter()
            if s == "shardplan":
                sp.checkpoint.load(path, m, o)
            else:
                msd, osd = get_state_dict(m, o)
                sd = {"model": msd, "optim": osd}
                dcp.load(sd, checkpoint_id=path)
                set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            dist.barrier()
            times[s]["load"].append(time.perf_counter() - t)
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        del m, o
        gc.collect()  # FSDP2's module/state cycles must go before the next system is built
    out = {"config": args.config, "params": n, "world": world, "checkpoint_bytes": nbytes, "systems": {}}
    for s, t in times.items():
        save, load = statistics.median(t["save"]), statistics.median(t["load"])
        out["systems"][s] = {"save_s": save, "load_s": load, "save_GBps": nbytes / save / 1e9, "load_GBps": nbytes / load / 1e9}
    out["ratios"] = {k: out["systems"]["shardplan"][k] / out["systems"]["fsdp2"][k] for k in ("save_s", "load_s")}
    emit(out, args.out, print_it=rank == 0)


if __name__ == "__main__":
    main()
