"""Train the small GPT of examples/gpt.py the JAX way: pure functions over a pytree of local shards.

    torchrun --nproc-per-node 2 examples/train_functional.py            # CPU, gloo
    torchrun --nproc-per-node 8 examples/train_functional.py --config 1B --dtype bf16   # GPUs, NCCL

Same data, model and rules as examples/train_gpt.py; the module is never changed: parameters live in
a dict of local shards, a pure optimizer returns new ones each step (see docs/functional.md).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402
import gpt_rules  # noqa: E402
from train_gpt import batches, corpus  # noqa: E402

import shardplan as sp  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", choices=sorted(gpt.CONFIGS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over ranks)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--strategy", default="optim_grads_params")
    ap.add_argument("--mesh", default=None, help="e.g. dp=2 or replica=2,shard=2 (default: dp=world size)")
    ap.add_argument("--rules", default="rules", help="a rules list of examples/gpt_rules.py: rules or HSDP_RULES")
    ap.add_argument("--dtype", default=None, help="compute dtype, e.g. bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="directory to save (params, optimizer state) into at the end")
    ap.add_argument("--resume", default=None, help="directory to resume from")
    return ap.parse_args(argv)


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("run this under torchrun, e.g.: torchrun --nproc-per-node 2 examples/train_functional.py")
    world = int(os.environ["WORLD_SIZE"])
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the world size {world}")
    cuda = torch.cuda.is_available() and os.environ.get("SHARDPLAN_FORCE_CPU") != "1"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    model = gpt.build(args.config, max_seq=max(args.seq, gpt.CONFIGS[args.config].max_seq)).init_weights(args.seed)
    if cuda:
        model = model.cuda()
    mesh = sp.Mesh.parse(args.mesh) if args.mesh else sp.Mesh(dp=world)
    plan = sp.plan(model, getattr(gpt_rules, args.rules), mesh, strategy=args.strategy, units=gpt_rules.UNITS,
                   compute_dtype=args.dtype)

    params = sp.shard_tree(dict(model.named_parameters()), plan)     # this rank's shards, a plain dict
    opt = sp.optim.adamw(lr=args.lr, weight_decay=0.0, mask=sp.optim.trainable(plan))
    state = opt.init(params)
    start = 0
    if args.resume:
        tree, start = sp.checkpoint.load_tree(args.resume, plan, {"params": params, "opt": state})
        params, state = tree["params"], tree["opt"]

    def loss_fn(params, x, y):
        return sp.functional_call(model, plan, params, (x, y))

    step_fn = sp.value_and_grad(loss_fn, plan)
    per = args.batch // world
    stream = batches(corpus(200_000, seed=args.seed), args.batch, args.seq, seed=args.seed + 1)
    for _ in range(start):
        next(stream)
    losses = []
    for step in range(start, args.steps):
        x, y = next(stream)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        if cuda:
            x, y = x.cuda(), y.cuda()
        t0 = time.perf_counter()
        loss, grads = step_fn(params, x, y)
        grads, norm = sp.clip_by_global_norm(grads, 1.0, plan)
        params, state = opt.update(grads, state, params)
        mean = loss.float().clone()
        dist.all_reduce(mean)
        mean = mean.item() / world
        losses.append(mean)
        if not math.isfinite(mean):
            raise SystemExit(f"loss is {mean} at step {step}")
        if rank == 0:
            dt = time.perf_counter() - t0
            print(f"step {step:4d}  loss {mean:.4f}  grad_norm {norm.item():.3f}  {1000 * dt:.1f} ms  "
                  f"{args.batch * args.seq / dt:,.0f} tok/s", flush=True)
    if args.save:
        sp.checkpoint.save_tree(args.save, plan, {"params": params, "opt": state}, step=args.steps)
    if rank == 0 and len(losses) > 1:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
