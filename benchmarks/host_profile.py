"""Where the runtime's host time goes, function by function: cProfile over training steps of one system.

    python3 benchmarks/host_profile.py --config tiny200 --batch 8 --seq 1024 --dtype bf16 [--face module|functional] [--out prof.txt]

World 1 (NCCL on a GPU, gloo on CPU), default units, AdamW. Prints the functions with the most own time
(cProfile's tottime; profiling slows Python calls, so read the shares, not the absolute figures) and
the same restricted to shardplan's own code.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
import gpt  # noqa: E402

import shardplan as sp  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny200")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--face", default="module", choices=["module", "functional"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29800 + os.getpid() % 100))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda" if cuda else "cpu")
    dt = torch.bfloat16 if args.dtype == "bf16" else None
    with torch.device("meta"):
        model = gpt.build(args.config, max_seq=max(args.seq, gpt.CONFIGS[args.config].max_seq))
    model.to_empty(device=dev)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=1), units=[r"layers\.\d+"], compute_dtype=dt,
                   reduce_dtype=torch.float32 if dt else None)
    x = torch.randint(0, gpt.CONFIGS[args.config].vocab, (args.batch, args.seq + 1), device=dev)
    if args.face == "module":
        sp.shard(model, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

        def step():
            model(x[:, :-1], x[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        box = [sp.shard_tree(dict(model.named_parameters()), plan)]
        from train_step import meta_params
        meta_params(model)  # the module's own parameters are not used by the functional face
        popt = sp.optim.adamw(lr=1e-4, mask=sp.optim.trainable(plan))
        box.append(popt.init(box[0]))
        vg = sp.value_and_grad(lambda p, a, b: sp.functional_call(model, plan, p, (a, b)), plan)

        def step():
            _, g = vg(box[0], x[:, :-1], x[:, 1:])
            box[0], box[1] = popt.update(g, box[1], box[0], donate=True)
    for _ in range(2):
        step()
    if cuda:  # where the peak is: allocated and peak memory after each phase of one more step
        phases = []

        def mark(name):
            torch.cuda.synchronize()
            phases.append((name, torch.cuda.memory_allocated() / 2**30, torch.cuda.max_memory_allocated() / 2**30))
            torch.cuda.reset_peak_memory_stats()
        mark("start")
        if args.face == "module":
            loss = model(x[:, :-1], x[:, 1:])
            mark("forward")
            loss.backward()
            del loss
            mark("backward")
            opt.step()
            mark("optimizer")
            opt.zero_grad(set_to_none=True)
        else:
            _, g = vg(box[0], x[:, :-1], x[:, 1:])
            mark("value_and_grad")
            box[0], box[1] = popt.update(g, box[1], box[0], donate=True)
            del g
            mark("update")
        for name, now, peak in phases:
            print(f"memory after {name:<15} allocated {now:8.2f} GiB, peak during it {peak:8.2f} GiB")
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    prof.disable()
    wall = (time.perf_counter() - t) / args.steps
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    buf.write(f"{args.config} {args.face}: {len(plan.units)} units, {wall * 1e3:.1f} ms per step under cProfile, "
              f"{st.total_calls / args.steps:.0f} calls per step\n")
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumtime").print_stats("shardplan", 40)
    text = buf.getvalue()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
