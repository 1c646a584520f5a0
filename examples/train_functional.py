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

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402
from train_gpt import checkpoint_due, common_args, launch, local_batches, resume_path, schedule_of  # noqa: E402

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
    sched = schedule_of(args)                                          # the learning rate, a function of the step
    opt = sp.optim.adamw(lr=sched, weight_decay=0.0, mask=sp.optim.trainable(plan))
    state = opt.init(params)
    start, path = 0, resume_path(args)
    if path:
        tree, start = sp.checkpoint.load_tree(path, plan, {"params": params, "opt": state})
        params, state = tree["params"], tree["opt"]
    end = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    log = sp.metrics.TrainLog(args.steps, rank=rank, start_step=start, progress="none")
    if path:
        log.print(f"resumed from {path} at step {start}")

    def loss_fn(params, x, y):
        return sp.functional_call(model, plan, params, (x, y))

    step_fn = sp.value_and_grad(loss_fn, plan)
    losses = []
    for step, x, y in local_batches(args, plan.data_index(rank), plan.data_size, start, cuda, end):
        t0 = time.perf_counter()
        lr = sched(step)  # what opt.update uses at this step (its state counts the steps)
        loss, grads = step_fn(params, x, y)
        grads, norm = sp.optim.clip_by_global_norm(grads, 1.0, plan)
        params, state = opt.update(grads, state, params)
        mean = loss.float().clone()
        dist.all_reduce(mean)
        mean = mean.item() / world
        losses.append(mean)
        if not math.isfinite(mean):
            raise SystemExit(f"loss is {mean} at step {step}: lower --lr or raise --warmup")
        dt = time.perf_counter() - t0
        log.log(step + 1, loss=mean, grad_norm=norm.item(), lr=lr, step_time_s=dt, tokens_per_s=args.batch * args.seq / dt,
                tokens_per_s_per_device=args.batch * args.seq / dt / world)
        if checkpoint_due(args, step + 1, end):
            sp.checkpoint.save_tree(sp.checkpoint.step_dir(args.checkpoint_dir, step + 1), plan,
                                    {"params": params, "opt": state}, step=step + 1)
            sp.checkpoint.prune(args.checkpoint_dir, keep=args.keep)
    log.close()
    if args.save:
        sp.checkpoint.save_tree(args.save, plan, {"params": params, "opt": state}, step=end)
    if rank == 0 and len(losses) > 1:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    sp.run_main(main)
