"""Single-rank cost of the context- and expert-parallel code paths (cp=1 / ep=1) against plain shardplan training.

    python benchmarks/cp_ep_overhead.py --gpt 1B --moe 350M --batch 4 --seq 2048 --dtype bf16 --out cp_ep.json  # 1 GPU
    python benchmarks/cp_ep_overhead.py --gpt tiny --moe tiny --batch 2 --seq 32 --steps 3 --warmup 1             # CPU

One process, world 1. Per model (examples/gpt.py for cp, examples/moe.py for ep) four systems train the
same weights on the same batches with AdamW, alternating over rounds, warm-up steps excluded:

- ``plain``: the model on ``Mesh(dp=1)`` (the parallelism-free path of the same runtime);
- ``cp1`` / ``ep1``: on ``Mesh(dp=1, cp=1)`` (rules over dp x cp) / ``Mesh(dp=1, ep=1)`` (experts split over ep):
  what a cp/ep-enabled script costs when its axis has one rank (both take the local path);
- ``plain_forced`` and ``cp1_forced`` / ``ep1_forced``: the same under ``SHARDPLAN_SINGLETON_GROUPS=1``, which
  makes groups of one real process groups, so the cp=1 run takes the path of cp>1 (K/V all-gathered over the
  group, attention under an explicit causal mask built from the chunk positions) and the ep=1 run the path
  of ep>1 (counts and rows through ``all_to_all_single``): the cost of the machinery itself.

Reported: median step ms per system, the ratios ``cp1/plain``, ``cp1_forced/plain_forced``, ``ep1/plain``,
``ep1_forced/plain_forced`` (goal: at most 1.02) and whether the first losses agree (they must: the paths
compute the same function).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
import gpt  # noqa: E402
import gpt_rules  # noqa: E402
import moe  # noqa: E402

import shardplan as sp  # noqa: E402
from _report import emit, start_world  # noqa: E402
from train_step import run_steps, sync  # noqa: E402,F401

SYSTEMS = ("plain", "cp1", "plain_forced", "cp1_forced")  # for moe: ep1 and ep1_forced in place of cp1*


def build(kind: str, config: str, seq: int, dev, state=None):
    """The model on ``dev`` with ``state`` (the first build's initial weights: every system starts alike)."""
    lib = gpt if kind == "gpt" else moe
    with torch.device(dev):
        model = lib.build(config, max_seq=max(seq, lib.CONFIGS[config].max_seq))
    if state is None:
        return model.init_weights(0)
    model.load_state_dict(state)
    return model


def plan_for(kind: str, system: str, model, dt):
    axis = "cp" if kind == "gpt" else "ep"
    mesh = sp.Mesh(dp=1, **{axis: 1}) if system.startswith(axis) else sp.Mesh(dp=1)
    if kind == "gpt":
        rules, units = gpt_rules.rules_over(mesh), gpt_rules.UNITS
    else:
        rules, units = moe.rules_for(mesh), moe.UNITS
    return sp.plan(model, rules, mesh, units=units, compute_dtype=dt, reduce_dtype=torch.float32 if dt else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpt", default="tiny", help="examples/gpt.py config for the cp systems ('' to skip)")
    ap.add_argument("--moe", default="tiny", help="examples/moe.py config for the ep systems ('' to skip)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dtype", default=None, help="bf16: compute in bfloat16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda, dev = start_world()
    if dist.get_world_size() != 1:
        raise SystemExit("cp_ep_overhead.py measures one rank: run it without torchrun (or with one process)")
    dt = torch.bfloat16 if args.dtype == "bf16" else None
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "dtype": args.dtype or "fp32", "batch": args.batch, "seq": args.seq, "models": {}}
    for kind, config in (("gpt", args.gpt), ("moe", args.moe)):
        if not config:
            continue
        lib = gpt if kind == "gpt" else moe
        systems = [s.replace("cp1", "ep1") if kind == "moe" else s for s in SYSTEMS]
        g = torch.Generator().manual_seed(123)
        data = []
        for _ in range(args.warmup + args.steps):
            x = torch.randint(0, lib.CONFIGS[config].vocab, (args.batch, args.seq + 1), generator=g)
            data.append((x[:, :-1].to(dev), x[:, 1:].to(dev)))
        state = {k: v.clone() for k, v in build(kind, config, args.seq, dev).state_dict().items()}
        res = {s: {"times": [], "losses": None} for s in systems}
        for _ in range(args.rounds):
            for s in systems:
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                os.environ["SHARDPLAN_SINGLETON_GROUPS"] = "1" if s.endswith("_forced") else "0"
                model = build(kind, config, args.seq, dev, state)
                sp.shard(model, plan_for(kind, s, model, dt))
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
                # (a cp group is the sharded model's: attention is context-parallel only while that model runs,
                # so an earlier cp1_forced system does not leak into the next)
                ctx = None
                forced = s.endswith("_forced") and not s.startswith("plain")
                eg = sp.expert_parallel.group_of(model.layers[0].moe.experts) if kind == "moe" else None
                took = sp.context_parallel.group_of(model) is not None if kind == "gpt" else \
                    eg is not None and eg.group.pg is not None   # the path the steps below will take
                assert took == forced, f"{kind} {s}: the cp/ep path taken ({took}) is not the one measured ({forced})"
                times, losses, _ = run_steps(model, opt, ctx, data, dev)
                res[s]["times"] += times[args.warmup:]
                res[s]["losses"] = res[s]["losses"] or losses[:3]
                del model, opt
        os.environ.pop("SHARDPLAN_SINGLETON_GROUPS", None)
        med = {s: 1000 * statistics.median(r["times"]) for s, r in res.items()}
        a = "cp1" if kind == "gpt" else "ep1"
        tol = 3e-2 if dt else 1e-4
        first = [r["losses"][0] for r in res.values()]
        out["models"][kind] = {
            "config": config, "median_step_ms": med, "first_losses": {s: r["losses"] for s, r in res.items()},
            "losses_agree": max(first) - min(first) <= tol * max(1.0, abs(first[0])),
            "ratios": {f"{a}/plain": med[a] / med["plain"], f"{a}_forced/plain_forced": med[f"{a}_forced"] /
                       med["plain_forced"]}}
    for kind, m in out["models"].items():
        rs = ", ".join(f"{k} {v:.3f}" for k, v in m["ratios"].items())
        print(f"{kind} {m['config']}: " + ", ".join(f"{s} {v:.1f} ms" for s, v in m["median_step_ms"].items())
              + f"; {rs}; losses agree {m['losses_agree']}", flush=True)
    emit(out, args.out)


if __name__ == "__main__":
    main()
