"""Train the small GPT from examples/gpt.py with shardplan under torchrun.

    torchrun --nproc-per-node 2 examples/train_gpt.py            # CPU, gloo
    torchrun --nproc-per-node 4 examples/train_gpt.py --mesh replica=2,shard=2 --rules HSDP_RULES   # HSDP
    torchrun --nproc-per-node 4 examples/train_gpt.py --mesh dp=2,tp=2 --rules examples/gpt_rules_tp.py  # FSDP x TP
    torchrun --nproc-per-node 4 examples/train_gpt.py --mesh dp=2,cp=2   # context parallelism: sequences split over cp
    torchrun --nproc-per-node 8 examples/train_gpt.py --config 1B --dtype bf16   # GPUs, NCCL

    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 1000 --lr-schedule warmup_cosine --warmup 100 \\
        --checkpoint-dir ckpt --checkpoint-every 100 --keep 3 --resume auto --metrics out.jsonl
    torchrun --nproc-per-node 2 examples/train_gpt.py --eval-every 10 --wandb my-project     # WANDB_MODE=offline
    torchrun --nproc-per-node 8 examples/train_gpt.py --config 1B --dtype bf16 --profile-steps 4:5 --memory-snapshot mem

The text is generated here (sums written out, byte-level), so nothing is downloaded. Rank 0 prints the
plan, then every --log-every steps (numbered from 1): loss, grad norm, learning rate, step time, tokens/s
(all devices and per device), achieved TFLOP/s and MFU against the device's bf16 peak (n/a on CPU), peak
memory (the device's and its fraction of the device, or the plan's per-rank bytes on CPU), tokens seen
and the ETA to --steps; on a terminal a progress bar too (tqdm or rich). The same records go to
--metrics (JSON lines, with timestamps), --tensorboard, --wandb and --mlflow (docs/metrics.md).
A batch depends on (seed, step) only, and a checkpoint holds the lr scheduler, every rank's generators and
the tokens seen beside the model and optimizer, so a run resumed from one (--resume auto) reproduces the
losses of an uninterrupted run exactly; its metrics file gets a restart marker. --async-checkpoint saves
with sp.checkpoint.async_save: training goes on while each checkpoint is written, and the run waits for
the last one before it ends. --profile-steps A:B writes a torch.profiler trace per rank, --memory-snapshot
the CUDA allocator's history, --eval-every N a held-out loss every N steps.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional

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


def global_batch(data: torch.Tensor, batch: int, seq: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: a function of (seed, step) alone, so a resumed run reads exactly the
    batches an uninterrupted one would, without replaying the earlier ones."""
    g = torch.Generator().manual_seed((seed + 1) * 1_000_003 + step)
    idx = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g).tolist()
    x = torch.stack([data[i:i + seq] for i in idx])
    y = torch.stack([data[i + 1:i + seq + 1] for i in idx])
    return x, y


def local_batches(args, index: int, count: int, start: int, cuda: bool, end: Optional[int] = None):
    """(step, x, y) for steps ``start`` to ``end`` (``--steps``): slice ``index`` of ``count`` of each global
    batch (``plan.data_index(rank)`` of ``plan.data_size``: tensor-parallel ranks share their slice)."""
    if args.batch % count:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {count} data-parallel slices")
    rank, per = index, args.batch // count
    data = corpus(200_000, seed=args.seed)
    for step in range(start, args.steps if end is None else end):
        x, y = global_batch(data, args.batch, args.seq, args.seed, step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        yield (step, x.cuda(), y.cuda()) if cuda else (step, x, y)


def common_args(doc: str) -> argparse.ArgumentParser:
    """The options both examples share (model, data, mesh, rules, schedule, checkpoints)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--config", default="tiny", choices=sorted(gpt.CONFIGS))
    ap.add_argument("--steps", type=int, default=40, help="steps of the whole run (the schedule and ETA span them)")
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over ranks)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--lr-schedule", default="warmup_cosine", choices=sp.optim.SCHEDULES)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: a tenth of --steps)")
    ap.add_argument("--lr-end", type=float, default=None, help="learning rate at the end of the cosine (default: --lr / 10)")
    ap.add_argument("--strategy", default="optim_grads_params")
    ap.add_argument("--mesh", default=None, help="e.g. dp=2 or replica=2,shard=2 (default: dp=world size)")
    ap.add_argument("--rules", default="rules", help="a rules list of examples/gpt_rules.py (rules or HSDP_RULES), or a "
                                                     "rules file such as examples/gpt_rules_tp.py (its rules, UNITS "
                                                     "and compute_axes)")
    ap.add_argument("--dtype", default=None, help="compute dtype, e.g. bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (DIR/step_00000100), at the end "
                                                           "and every --checkpoint-every steps")
    ap.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="save every N steps (0: at the end only)")
    ap.add_argument("--keep", type=int, default=3, metavar="K", help="keep the last K complete checkpoints")
    ap.add_argument("--save", default=None, help="one checkpoint directory to save into at the end")
    ap.add_argument("--resume", default=None, help="a checkpoint directory, or 'auto': the newest complete one in "
                                                   "--checkpoint-dir (a fresh start if there is none)")
    ap.add_argument("--stop-after", type=int, default=None, metavar="N",
                    help="stop after N steps of this run (a job with a time limit: checkpoint, then --resume auto); "
                         "the schedule still spans --steps")
    return ap


def schedule_of(args):
    """``--lr-schedule`` as a function of the step."""
    warmup = args.steps // 10 if args.warmup is None else args.warmup
    end = args.lr / 10 if args.lr_end is None else args.lr_end
    return sp.optim.by_name(args.lr_schedule, args.lr, warmup=min(warmup, args.steps), total=args.steps, end=end)


def resume_path(args) -> Optional[str]:
    """The checkpoint to start from: ``--resume DIR``, or with ``--resume auto`` the newest complete one in
    ``--checkpoint-dir`` (``None``: start at step 0)."""
    if args.checkpoint_every and not args.checkpoint_dir:
        raise SystemExit("--checkpoint-every needs --checkpoint-dir (where to save)")
    if args.resume != "auto":
        return args.resume
    if not args.checkpoint_dir:
        raise SystemExit("--resume auto picks the newest checkpoint in --checkpoint-dir: pass --checkpoint-dir too")
    return sp.checkpoint.latest(args.checkpoint_dir)


def checkpoint_due(args, done: int, end: int) -> bool:
    """Whether to save after ``done`` steps (``end``: the last step of this run)."""
    if not args.checkpoint_dir:
        return False
    return done == end or bool(args.checkpoint_every and done % args.checkpoint_every == 0)


def parse_args(argv=None):
    ap = common_args(__doc__)
    ap.add_argument("--order", default="static", choices=("static", "dynamic"))
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--async-checkpoint", action="store_true",
                    help="save checkpoints with sp.checkpoint.async_save: training goes on while they are written")
    ap.add_argument("--quiet-plan", action="store_true")
    ap.add_argument("--log-every", type=int, default=1, metavar="N", help="log every N steps (rank 0)")
    ap.add_argument("--metrics", default=None, metavar="FILE", help="write one JSON object per logged step (JSON lines)")
    ap.add_argument("--tensorboard", default=None, metavar="DIR", help="write TensorBoard scalars (needs tensorboard)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's peak TFLOP/s for MFU (default: the bf16 dense peak of known GPUs; n/a on CPU)")
    ap.add_argument("--progress", default="auto", choices=("auto", "tqdm", "rich", "none"),
                    help="a progress bar on a terminal (auto: tqdm or rich if installed)")
    ap.add_argument("--wandb", default=None, metavar="PROJECT",
                    help="log to Weights & Biases (needs wandb; WANDB_MODE=offline writes locally)")
    ap.add_argument("--mlflow", default=None, metavar="EXPERIMENT",
                    help="log to MLflow (needs mlflow; the tracking URI from --mlflow-uri or MLFLOW_TRACKING_URI)")
    ap.add_argument("--mlflow-uri", default=None, metavar="URI", help="MLflow tracking URI, e.g. file:./mlruns")
    ap.add_argument("--flops", default="formula", choices=("formula", "count"),
                    help="FLOPs per token: 6 x weights + attention (formula), or counted op by op on the first "
                         "step by torch's FlopCounterMode (count)")
    ap.add_argument("--profile-steps", default=None, metavar="A:B",
                    help="write a torch.profiler trace of steps A to B (from 1) to --profile-dir/rank<r>.trace.json")
    ap.add_argument("--profile-dir", default="profile", metavar="DIR")
    ap.add_argument("--memory-snapshot", default=None, metavar="DIR",
                    help="write the CUDA allocator's history up to --snapshot-step to DIR/rank<r>.pickle (GPU only)")
    ap.add_argument("--snapshot-step", type=int, default=3, metavar="N")
    ap.add_argument("--eval-every", type=int, default=0, metavar="N", help="held-out loss every N steps (0: never)")
    ap.add_argument("--eval-batches", type=int, default=2, metavar="K", help="held-out batches per evaluation")
    return ap.parse_args(argv)


def rules_of(name: str) -> dict:
    """``--rules`` as plan() keywords: a list of examples/gpt_rules.py, or a rules file (``FILE.py``: its
    ``rules``; ``FILE.py:NAME``: its ``NAME``, e.g. ``examples/gpt_rules_tp.py:cp_rules``) with its options."""
    path, _, var = name.partition(":") if ".py:" in name else (name, "", "")
    if path.endswith(".py"):
        from shardplan.cli_inputs import _load_file
        mod = _load_file(path, "_example_rules")
        if not isinstance(getattr(mod, var or "rules", None), list):
            raise SystemExit(f"--rules {name!r}: {path} has no rules list named {var or 'rules'!r}")
        return dict(rules=getattr(mod, var or "rules"), units=getattr(mod, "UNITS", gpt_rules.UNITS),
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


def evaluate(model, args, index: int, count: int, cuda: bool, cp: int, mesh, rank: int) -> float:
    """The mean loss over --eval-batches held-out global batches (their own stream: seed + 1), every rank's
    slice, without gradients (the plan's inference program gathers and frees each unit)."""
    data = corpus(200_000, seed=args.seed + 1)
    per = args.batch // count
    total = torch.zeros((), device="cuda" if cuda else "cpu")
    model.eval()
    with torch.no_grad():
        for k in range(args.eval_batches):
            x, y = global_batch(data, args.batch, args.seq, args.seed + 1, k)
            x, y = x[index * per:(index + 1) * per], y[index * per:(index + 1) * per]
            if cuda:
                x, y = x.cuda(), y.cuda()
            if cp > 1:
                pos = sp.context_parallel.positions(args.seq, cp, mesh.axis_index(rank, ("cp",)), device=x.device)
                total += model(x[:, pos], y[:, pos], positions=pos).float()
            else:
                total += model(x, y).float()
    model.train()
    dist.all_reduce(total)
    return total.item() / (args.eval_batches * dist.get_world_size())


def sinks_of(args, rank: int) -> list:
    """--wandb and --mlflow as metric sinks (rank 0 builds them; every rank checks the package first, so a
    missing one stops the whole run with one message)."""
    for flag, module in (("wandb", "wandb"), ("mlflow", "mlflow")):
        if getattr(args, flag) and not sp.metrics.sink_available(module):
            raise SystemExit(f"--{flag}: the {module} package is not installed (pip install {module}, or "
                             f"pip install shardplan[{flag}])")
    if rank != 0:
        return []
    sinks = []
    config = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
    if args.wandb:
        sinks.append(sp.metrics.WandbSink(project=args.wandb, config=config))
    if args.mlflow:
        sinks.append(sp.metrics.MLflowSink(experiment=args.mlflow, tracking_uri=args.mlflow_uri, params=config))
    return sinks


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    cuda, rank, world, rules = launch(args, "train_gpt.py")
    torch.manual_seed(args.seed)
    model = gpt.build(args.config, max_seq=max(args.seq, gpt.CONFIGS[args.config].max_seq)).init_weights(args.seed)
    c = model.config
    flops_per_token = sp.metrics.flops_per_token(model, seq=args.seq, layers=c.layers, dim=c.dim)  # full shapes
    if cuda:
        model = model.cuda()
    mesh = sp.Mesh.parse(args.mesh) if args.mesh else sp.Mesh(dp=world)
    cp = mesh.shape.get("cp", 1)
    if cp > 1 and args.rules == "rules":  # context parallelism: ZeRO over the data axes and cp together
        rules = dict(rules, rules=gpt_rules.rules_over(mesh))
    plan = sp.plan(model, mesh=mesh, strategy=args.strategy, compute_dtype=args.dtype, prefetch=args.prefetch,
                   order=args.order, **rules)
    if rank == 0 and not args.quiet_plan:
        print(plan, flush=True)
    model = sp.shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    lr_sched = sp.optim.as_lr_scheduler(opt, schedule_of(args))  # the learning rate is a function of the step
    train_state = {"tokens_seen": 0}  # user state a checkpoint carries (extra=)
    run_state = dict(lr_scheduler=lr_sched, rng=True, extra=train_state)  # what a checkpoint holds besides
    start, path = 0, resume_path(args)
    if path:
        saved_world = (sp.checkpoint.checkpoint_info(path) or {}).get("world_size")
        if saved_world != world:  # generators are per rank: on another world size they start afresh
            run_state["rng"] = False
            if rank == 0:
                print(f"{path} was saved by {saved_world} ranks, this run has {world}: the checkpoint's random "
                      f"generators are not restored (rng=False)", flush=True)
        start = sp.checkpoint.load(path, model, opt, **run_state)  # train_state is filled in place
        run_state["rng"] = True
    elif args.resume == "auto" and rank == 0:
        print(f"no complete checkpoint in {args.checkpoint_dir}: starting at step 0", flush=True)
    end = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    peak = args.peak_tflops or (sp.metrics.peak_tflops() if cuda else None)
    meter = sp.metrics.Meter(args.batch * args.seq, world, flops_per_token=flops_per_token, peak_tflops=peak,
                             total_steps=args.steps, start_step=start)
    log = sp.metrics.TrainLog(args.steps, rank=rank, start_step=start, metrics_path=args.metrics,
                              tensorboard_dir=args.tensorboard, sinks=sinks_of(args, rank), progress=args.progress)
    if path:
        log.print(f"resumed from {path} at step {start}")
        log.restart(start, path)  # the metrics' restart marker: records after it come from this run
    if start >= args.steps:
        log.print(f"the checkpoint is at step {start}, at or past --steps {args.steps}: nothing to train")
    profiler = sp.metrics.StepProfiler(args.profile_steps, args.profile_dir, rank) if args.profile_steps else None
    snapshot = None
    if args.memory_snapshot:
        if not cuda:
            raise SystemExit("--memory-snapshot records the CUDA caching allocator and needs a GPU (on CPU, "
                             "the plan's memory per rank is what `shardplan plan` prints)")
        snapshot = sp.metrics.MemorySnapshot(args.memory_snapshot, rank, at_step=args.snapshot_step)
    losses, times = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step, x, y in local_batches(args, plan.data_index(rank), plan.data_size, start, cuda, end):
        done = step + 1  # steps are numbered from 1: this is step `done`
        if profiler:
            profiler.begin(done)
        lr = opt.param_groups[0]["lr"]

        def forward_backward():
            if cp > 1:  # this rank's two chunks of each sequence, at their full-sequence positions
                pos = sp.context_parallel.positions(args.seq, cp, mesh.axis_index(rank, ("cp",)), device=x.device)
                out = model(x[:, pos], y[:, pos], positions=pos)
            else:
                out = model(x, y)
            out.backward()
            return out

        if args.flops == "count" and done == start + 1:  # every op of this rank's first step, counted
            loss, flops = sp.metrics.count_flops(forward_backward)
            total = torch.tensor(float(flops), dtype=torch.float64, device=x.device)
            dist.all_reduce(total)  # every rank's share
            meter.flops_per_token = total.item() / (args.batch * args.seq)
        else:
            loss = forward_backward()
        norm = sp.clip_grad_norm_(model, 1.0)
        opt.step()
        lr_sched.step()
        opt.zero_grad()
        train_state["tokens_seen"] += args.batch * args.seq
        eval_due = bool(args.eval_every and done % args.eval_every == 0)  # the evaluation hook
        if done % args.log_every == 0 or done == end or eval_due:  # by step number: a resumed run logs the same steps
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)  # reading it synchronises the device: the meter's clock is honest
            mean = mean.item() / world
            if not math.isfinite(mean):
                raise SystemExit(f"loss is {mean} at step {done}: lower --lr or raise --warmup")
            timing = meter.update(done)
            fields = dict(loss=mean, grad_norm=norm.item(), lr=lr, **timing, **sp.metrics.memory(plan, rank),
                          tokens_seen=train_state["tokens_seen"])
            if eval_due:
                fields["eval_loss"] = evaluate(model, args, plan.data_index(rank), plan.data_size, cuda, cp, mesh, rank)
                meter.reset_clock()  # the evaluation is not a training step
            log.log(done, **fields)
            losses.append(mean)
            times.append(timing["step_time_s"])
        if profiler and profiler.end(done):  # after the step's timing: writing the trace is not a step
            log.print(f"profiler trace of steps {args.profile_steps}: {profiler.path} (open in https://ui.perfetto.dev)")
            meter.reset_clock()
        if snapshot and snapshot.end(done):
            log.print(f"memory snapshot after step {done}: {snapshot.path} (drag onto https://pytorch.org/memory_viz)")
            meter.reset_clock()
        if checkpoint_due(args, done, end):
            where = sp.checkpoint.step_dir(args.checkpoint_dir, done)
            if args.async_checkpoint:  # waits for the previous one, copies the state, writes in the background
                sp.checkpoint.async_save(where, model, opt, step=done, **run_state)
            else:
                sp.checkpoint.save(where, model, opt, step=done, **run_state)
            removed = sp.checkpoint.prune(args.checkpoint_dir, keep=args.keep)
            log.print(("saving checkpoint {} in the background" if args.async_checkpoint else "saved checkpoint {}")
                      .format(where) + (f" (removed {len(removed)} older)" if removed else ""))
            meter.reset_clock()  # the save is not a training step
    log.close()
    if profiler and profiler.close():  # the run ended inside --profile-steps
        print(f"profiler trace (cut short at step {end}): {profiler.path}", flush=True)
    if args.async_checkpoint and sp.checkpoint.wait():  # the last one written and published (or its error)
        sp.checkpoint.prune(args.checkpoint_dir, keep=args.keep)
    if args.save:
        sp.checkpoint.save(args.save, model, opt, step=end, **run_state)
        if rank == 0:
            print(f"saved checkpoint to {args.save}", flush=True)
    if rank == 0 and len(losses) > 1:
        steady = times[1:] if len(times) > 2 else times  # the first window includes warm-up
        mean_t = sum(steady) / len(steady)
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; mean step {1000 * mean_t:.1f} ms, "
              f"{args.batch * args.seq / mean_t:,.0f} tok/s over {world} ranks", flush=True)
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    sp.run_main(main)  # a shardplan error is printed once, by rank 0, with its fix; the exit status is 1
