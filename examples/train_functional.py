"""Train the small GPT of examples/gpt.py the JAX way: pure functions over a pytree of local shards.

    torchrun --nproc-per-node 2 examples/train_functional.py            # CPU, gloo
    torchrun --nproc-per-node 8 examples/train_functional.py --config 1B --dtype bf16   # GPUs, NCCL

Same data, model and rules as examples/train_gpt.py; the module is never changed: parameters live in
a dict of local shards, a pure optimizer returns new ones each step (see docs/functional.md).
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402
from train_gpt import common_args, launch, local_batches  # noqa: E402

import shardplan as sp  # noqa: E402


def parse_args(argv=None):
    return common_args(__doc__).parse_args(argv)


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    cuda, rank, world, rules = launch(args, "train_functional.py")
    model = gpt.build(args.config, max_seq=max(args.seq, gpt.CONFIGS[args.config].max_seq)).init_weights(args.seed)
    if cuda:
        model = model.cuda()
    mesh = sp.Mesh.parse(args.mesh) if args.mesh else sp.Mesh(dp=world)
    plan = sp.plan(model, mesh=mesh, strategy=args.strategy, compute_dtype=args.dtype, **rules)

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
    losses = []
    for step, x, y in local_batches(args, plan.data_index(rank), plan.data_size, start, cuda):
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
