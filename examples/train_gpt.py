"""Train the small GPT from examples/gpt.py with shardplan under torchrun.

    torchrun --nproc-per-node 2 examples/train_gpt.py            # CPU, gloo
    torchrun --nproc-per-node 4 examples/train_gpt.py --mesh replica=2,shard=2 --rules HSDP_RULES   # HSDP
    torchrun --nproc-per-node 4 examples/train_gpt.py --mesh dp=2,tp=2 --rules examples/gpt_rules_tp.py  # FSDP x TP
    torchrun --nproc-per-node 8 examples/train_gpt.py --config 1B --dtype bf16   # GPUs, NCCL

The text is generated here (sums written out, byte-level), so nothing is downloaded. Rank 0
prints the plan and the loss of every step.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402
import gpt_rules  # noqa: E402

import shardplan as sp  # noqa: E402


def corpus(n_chars: int, seed: int = 0) -> torch.Tensor:
    """Byte-level text of additions, e.g. '17+25=42;': learnable structure, a falling loss."""
    g = torch.Generator().manual_seed(seed)
    parts, total = [], 0
    while total < n_chars:
        a, b = torch.randint(0, 100, (2,), generator=g).tolist()
        s = f"{a}+{b}={a + b};"
        parts.append(s)
        total += len(s)
    return torch.tensor(list("".join(parts).encode()), dtype=torch.long)


def batches(data: torch.Tensor, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([data[i:i + seq] for i in idx.tolist()])
        y = torch.stack([data[i + 1:i + seq + 1] for i in idx.tolist()])
        yield x, y


def local_batches(args, index: int, count: int, start: int, cuda: bool):
    """(step, x, y): slice ``index`` of ``count`` of each global batch, in the data order of an uninterrupted
    run (``plan.data_index(rank)`` of ``plan.data_size``: tensor-parallel ranks share their slice)."""
    if args.batch % count:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {count} data-parallel slices")
    rank, per = index, args.batch // count
    stream = batches(corpus(200_000, seed=args.seed), args.batch, args.seq, seed=args.seed + 1)
    for _ in range(start):
        next(stream)
    for step in range(start, args.steps):
        x, y = next(stream)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        yield (step, x.cuda(), y.cuda()) if cuda else (step, x, y)


def common_args(doc: str) -> argparse.ArgumentParser:
    """The options both examples share (model, data, mesh, rules, checkpoints)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", choices=sorted(gpt.CONFIGS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over ranks)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--strategy", default="optim_grads_params")
    ap.add_argument("--mesh", default=None, help="e.g. dp=2 or replica=2,shard=2 (default: dp=world size)")
    ap.add_argument("--rules", default="rules", help="a rules list of examples/gpt_rules.py (rules or HSDP_RULES), or a "
                                                     "rules file such as examples/gpt_rules_tp.py (its rules, UNITS "
                                                     "and compute_axes)")
    ap.add_argument("--dtype", default=None, help="compute dtype, e.g. bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="checkpoint directory to save into at the end")
    ap.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    return ap


def parse_args(argv=None):
    ap = common_args(__doc__)
    ap.add_argument("--order", default="static", choices=("static", "dynamic"))
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--quiet-plan", action="store_true")
    return ap.parse_args(argv)


def rules_of(name: str) -> dict:
    """``--rules`` as plan() keywords: a list of examples/gpt_rules.py, or a rules file with its options."""
    if name.endswith(".py"):
        from shardplan.cli import _load_file
        mod = _load_file(name, "_example_rules")
        return dict(rules=mod.rules, units=getattr(mod, "UNITS", gpt_rules.UNITS),
                    compute_axes=getattr(mod, "compute_axes", ()), styles=getattr(mod, "styles", None))
    rules = getattr(gpt_rules, name, None)
    if not isinstance(rules, list):
        raise SystemExit(f"--rules {name!r}: examples/gpt_rules.py has no such rules list (try rules or HSDP_RULES, "
                         f"or a file like examples/gpt_rules_tp.py)")
    return dict(rules=rules, units=gpt_rules.UNITS)


def launch(args, script: str):
    """Checks before anything starts, then the process group: ``(cuda, rank, world, plan keywords)``."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit(f"run this under torchrun, e.g.: torchrun --nproc-per-node 2 examples/{script}")
    world = int(os.environ["WORLD_SIZE"])
    rules = rules_of(args.rules)
    cuda = torch.cuda.is_available() and os.environ.get("SHARDPLAN_FORCE_CPU") != "1"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    return cuda, dist.get_rank(), world, rules


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    cuda, rank, world, rules = launch(args, "train_gpt.py")
    torch.manual_seed(args.seed)
    model = gpt.build(args.config, max_seq=max(args.seq, gpt.CONFIGS[args.config].max_seq)).init_weights(args.seed)
    if cuda:
        model = model.cuda()
    mesh = sp.Mesh.parse(args.mesh) if args.mesh else sp.Mesh(dp=world)
    plan = sp.plan(model, mesh=mesh, strategy=args.strategy, compute_dtype=args.dtype, prefetch=args.prefetch,
                   order=args.order, **rules)
    if rank == 0 and not args.quiet_plan:
        print(plan, flush=True)
    model = sp.shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start = 0
    if args.resume:
        start = sp.checkpoint.load(args.resume, model, opt)
        if rank == 0:
            print(f"resumed from {args.resume} at step {start}", flush=True)
            if start >= args.steps:
                print(f"the checkpoint is at step {start}, at or past --steps {args.steps}: nothing to train", flush=True)
    losses, times = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step, x, y in local_batches(args, plan.data_index(rank), plan.data_size, start, cuda):
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        norm = sp.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        mean = mean.item() / world
        dt = time.perf_counter() - t0
        losses.append(mean)
        times.append(dt)
        if not math.isfinite(mean):
            raise SystemExit(f"loss is {mean} at step {step}")
        if rank == 0:
            mem = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if cuda else \
                f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB RSS"
            print(f"step {step:4d}  loss {mean:.4f}  grad_norm {norm.item():.3f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"{1000 * dt:.1f} ms  {args.batch * args.seq / dt:,.0f} tok/s  peak {mem}", flush=True)
    if args.save:
        sp.checkpoint.save(args.save, model, opt, step=args.steps)
        if rank == 0:
            print(f"saved checkpoint to {args.save}", flush=True)
    if rank == 0 and len(losses) > 1:
        steady = times[1:] if len(times) > 2 else times  # the first step includes warm-up
        mean_t = sum(steady) / len(steady)
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; mean step {1000 * mean_t:.1f} ms, "
              f"{args.batch * args.seq / mean_t:,.0f} tok/s over {world} ranks", flush=True)
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
