"""Train the small mixture-of-experts GPT of examples/moe.py with shardplan under torchrun: experts split
over an ``ep`` mesh axis (expert parallelism), everything else sharded over every data axis.

    torchrun --nproc-per-node 4 examples/train_moe.py --mesh dp=2,ep=2     # CPU, gloo
    torchrun --nproc-per-node 4 examples/train_moe.py --mesh ep=4
    torchrun --nproc-per-node 1 examples/train_moe.py                      # the same losses, one process

The flags are examples/train_gpt.py's; ``--rules rules`` (the default) means examples/moe.py's
``rules_for(mesh)``, a ``.py`` file gives its own ``rules`` (and ``UNITS``). The batch of a step depends on
(seed, step) only and is split over ``plan.data_size`` slices (``ep`` splits it like ``dp``), so every
mesh trains on the same global batch as one process does. The TFLOP/s it logs come from the first step's
FLOPs counted op by op (sp.metrics.count_flops: torch's FlopCounterMode), since the dense formula does not
describe routed experts.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe  # noqa: E402
import train_gpt as T  # noqa: E402

import shardplan as sp  # noqa: E402


def main(argv=None) -> list[float]:
    args = T.parse_args(argv)
    if args.config not in moe.CONFIGS:
        raise SystemExit(f"--config {args.config!r}: examples/moe.py has {sorted(moe.CONFIGS)}")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("run this under torchrun, e.g.: torchrun --nproc-per-node 4 examples/train_moe.py --mesh dp=2,ep=2")
    world = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and os.environ.get("SHARDPLAN_FORCE_CPU") != "1"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    mesh = sp.Mesh.parse(args.mesh) if args.mesh else sp.Mesh(dp=world)
    if args.rules == "rules":
        opts = dict(rules=moe.rules_for(mesh), units=moe.UNITS)
    else:
        opts = T.rules_of(args.rules)
    torch.manual_seed(args.seed)
    model = moe.build(args.config, max_seq=max(args.seq, moe.CONFIGS[args.config].max_seq)).init_weights(args.seed)
    if cuda:
        model = model.cuda()
    plan = sp.plan(model, mesh=mesh, strategy=args.strategy, compute_dtype=args.dtype, prefetch=args.prefetch,
                   order=args.order, **opts)
    if rank == 0 and not args.quiet_plan:
        print(plan, flush=True)
    model = sp.shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start, path = 0, T.resume_path(args)
    if path:
        start = sp.checkpoint.load(path, model, opt)
    lr_sched = sp.optim.as_lr_scheduler(opt, T.schedule_of(args), step=start)
    end = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    log = sp.metrics.TrainLog(args.steps, rank=rank, start_step=start, metrics_path=args.metrics,
                              tensorboard_dir=args.tensorboard, progress=args.progress)
    meter = sp.metrics.Meter(args.batch * args.seq, world, total_steps=args.steps, start_step=start)
    losses = []
    for step, x, y in T.local_batches(args, plan.data_index(rank), plan.data_size, start, cuda, end):
        lr = opt.param_groups[0]["lr"]
        if step == start:  # the dense formula does not describe routed experts: count this rank's first step
            loss, flops = sp.metrics.count_flops(lambda: _forward_backward(model, x, y))
            total = torch.tensor(float(flops), dtype=torch.float64, device=x.device)
            dist.all_reduce(total)  # every rank's share (each routes its own tokens)
            meter.flops_per_token = total.item() / (args.batch * args.seq)
        else:
            loss = _forward_backward(model, x, y)
        norm = sp.clip_grad_norm_(model, 1.0)
        opt.step()
        lr_sched.step()
        opt.zero_grad()
        if (step + 1) % args.log_every == 0 or step + 1 == end:
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            mean = mean.item() / world
            if not math.isfinite(mean):
                raise SystemExit(f"loss is {mean} at step {step}: lower --lr or raise --warmup")
            log.log(step + 1, loss=mean, grad_norm=norm.item(), lr=lr, **meter.update(step + 1))  # steps from 1
            losses.append(mean)
        if T.checkpoint_due(args, step + 1, end):
            sp.checkpoint.save(sp.checkpoint.step_dir(args.checkpoint_dir, step + 1), model, opt, step=step + 1)
            sp.checkpoint.prune(args.checkpoint_dir, keep=args.keep)
    log.close()
    if args.save:
        sp.checkpoint.save(args.save, model, opt, step=end)
    if rank == 0 and len(losses) > 1:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    dist.destroy_process_group()
    return losses


def _forward_backward(model, x, y):
    loss = model(x, y)
    loss.backward()
    return loss


if __name__ == "__main__":
    sp.run_main(main)
