"""Forecast vs measurement on this machine (CPU, gloo): is ``plan.forecast`` within 25% of the step that
examples/train_gpt.py measures at world W?

    python benchmarks/forecast_check.py --world 2 --configs tiny,small --out benchmarks/results/forecast_cpu_w2.json

Per config and round:
1. the network: ``torchrun --nproc-per-node W benchmarks/collectives.py`` measures α and β here (once);
2. compute at world 1: W independent single-rank runs of train_gpt.py's model, plan (``Mesh(dp=1)``, the same
   units) and step, side by side (the W ranks will share the cores the same way), timing each unit's
   forward and backward with tensor hooks, and the rest of the step (clip, AdamW, the logged loss); each
   segment taken as the slowest of the W runs step by step (the blocking collective after it waits for
   the slowest rank), then the median over steps;
3. the real thing: ``torchrun --nproc-per-node W examples/train_gpt.py``, its printed per-step times;
4. the forecast of the world-W plan with that network and those unit times (two scalar all-reduces per
   step: ``sp.clip_grad_norm_`` and the example's logged mean loss).
Reported: the medians over steps, per round; the forecast / measured ratio. A single process measures
no communication at all, so ``compute_only`` (the world-1 step) is reported beside it: the part the
network model has to add.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT_DIR = os.path.join(HERE, "..")
sys.path.insert(0, os.path.join(ROOT_DIR, "src"))
sys.path.insert(0, os.path.join(ROOT_DIR, "examples"))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--batch", type=int, default=8, help="global batch, as train_gpt.py's --batch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--network", default=None, help="a preset file already measured (default: measure one now)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one world-1 compute measurement
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# -- world 1: per-unit compute ------------------------------------------------------------------------

def compute_worker(args) -> None:
    """One single-rank run of train_gpt.py's step with per-unit timing; writes JSON to ``args.worker_out``."""
    import torch
    import torch.distributed as dist

    import gpt
    import gpt_rules
    import shardplan as sp
    from shardplan.units import ROOT

    torch.set_num_threads(1)  # torchrun gives each of several ranks one thread (OMP_NUM_THREADS=1)
    store = dist.FileStore(args.worker_out + ".store", 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    per = args.batch // args.world
    model = gpt.build(args.config, max_seq=max(args.seq, gpt.CONFIGS[args.config].max_seq)).init_weights(0)
    plan = sp.plan(model, mesh=sp.Mesh(dp=1), rules=gpt_rules.rules, units=gpt_rules.UNITS, prefetch=1)
    model = sp.shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    mods = dict(model.named_modules())
    marks: list[tuple[str, str, float]] = []

    def mark(unit, what):
        marks.append((unit, what, time.perf_counter()))

    for u in plan.units[1:]:
        first, last = mods[u.module_paths[0]], mods[u.module_paths[-1]]

        def pre(mod, inputs, u=u.name):
            mark(u, "fwd0")
            x = inputs[0]
            if torch.is_tensor(x) and x.requires_grad:
                x.register_hook(lambda g, u=u: mark(u, "bwd1"))   # the unit's input gradient: its backward is over

        def post(mod, inputs, out, u=u.name):
            mark(u, "fwd1")
            if torch.is_tensor(out) and out.requires_grad:
                out.register_hook(lambda g, u=u: mark(u, "bwd0"))  # its output gradient arrives: its backward starts
        first.register_forward_pre_hook(pre)
        last.register_forward_hook(post)

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, model.config.vocab, (per, args.seq), generator=g)
    rows = []
    for step in range(args.steps):
        marks.clear()
        t0 = time.perf_counter()
        loss = model(x, x)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        sp.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        mean.item()
        t3 = time.perf_counter()
        at = {(u, w): t for u, w, t in marks}
        units = {}
        for u in plan.units[1:]:
            units[u.name] = (at[(u.name, "fwd1")] - at[(u.name, "fwd0")], at[(u.name, "bwd1")] - at[(u.name, "bwd0")])
        fwd, bwd = t1 - t0, t2 - t1
        units[ROOT] = (fwd - sum(f for f, _ in units.values()), bwd - sum(b for _, b in units.values()))
        rows.append({"units": units, "optimizer_s": t3 - t2, "step_s": t3 - t0})
    steady = rows[2:]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    out = {"units": [[u, med([r["units"][u][0] for r in steady]), med([r["units"][u][1] for r in steady])]
                     for u in rows[0]["units"]],
           "optimizer_s": med([r["optimizer_s"] for r in steady]), "step_s": med([r["step_s"] for r in steady]),
           "batch": [per, args.seq], "rows": steady}
    with open(args.worker_out, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def measure_compute(args, config: str, tmp: str) -> dict:
    """``args.world`` single-rank runs at once; the median of their medians."""
    procs, outs = [], []
    for k in range(args.world):
        out = os.path.join(tmp, f"compute_{config}_{k}_{time.time_ns()}.json")
        outs.append(out)
        cmd = [sys.executable, __file__, "--worker", "compute", "--config", config, "--worker-out", out,
               "--world", str(args.world), "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
        procs.append(subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    for p in procs:
        if p.wait(timeout=900):
            raise SystemExit(f"compute measurement failed ({p.returncode})")
    runs = [json.load(open(o)) for o in outs]
    # [Note: rank skew. At world W with gloo every collective blocks, so each unit's forward and backward
    # and the optimizer step end at a synchronisation that waits for the slowest rank. The W runs side by
    # side are W independent samples of each segment per step: the segment the world-W step sees is their
    # maximum, step by step (then the median over steps), not the median of their medians. This is the
    # same machine's measurement, read as the synchronised step reads it]
    n = min(len(r["rows"]) for r in runs)
    med = statistics.median

    def slowest(get):
        return med(max(get(r["rows"][s]) for r in runs) for s in range(n))
    names = [u for u, _, _ in runs[0]["units"]]
    units = [[u, slowest(lambda row, u=u: row["units"][u][0]), slowest(lambda row, u=u: row["units"][u][1])]
             for u in names]
    return {"units": units, "optimizer_s": slowest(lambda row: row["optimizer_s"]),
            "step_s": med(r["step_s"] for r in runs), "batch": runs[0]["batch"],
            "median_units": [[u, med(r["units"][i][1] for r in runs), med(r["units"][i][2] for r in runs)]
                             for i, u in enumerate(names)], "median_optimizer_s": med(r["optimizer_s"] for r in runs)}


# -- world W: the real step -------------------------------------------------------------------------

# "step 3  ... 12.4 ms ..." or, since train_gpt.py logs through sp.metrics, "step 3/12  ... 12.4 ms ..."
# [Note: the figures in benchmarks/results/forecast_cpu_* were measured before that change, when the
# printed time was the step's own (forward to the logged loss); sp.metrics times from log to log]
STEP = re.compile(r"^step\s+(\d+)(?:/\d+)?\s.*?\s([\d.]+) ms\s", re.M)


def measure_step(args, config: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world), os.path.join(ROOT_DIR, "examples", "train_gpt.py"),
           "--config", config, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--quiet-plan"]
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT_DIR, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if out.returncode:
        raise SystemExit(f"train_gpt.py failed:\n{out.stderr[-3000:]}")
    times = [float(ms) / 1e3 for s, ms in STEP.findall(out.stdout) if int(s) >= 2]
    return {"step_s": statistics.median(times), "steps": times}


def measure_network(args, tmp: str) -> str:
    path = os.path.join(tmp, f"net_w{args.world}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world), os.path.join(HERE, "collectives.py"),
           "--out", path, "--iters", "30"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if out.returncode:
        raise SystemExit(f"collectives.py failed:\n{out.stderr[-3000:]}")
    return path


def forecast_of(args, config: str, network: str, compute: dict):
    import torch

    import gpt
    import gpt_rules
    import shardplan as sp
    from shardplan.forecast import ComputeModel

    with torch.device("meta"):
        model = gpt.build(config, max_seq=max(args.seq, gpt.CONFIGS[config].max_seq))
    plan = sp.plan(model, mesh=sp.Mesh(dp=args.world), rules=gpt_rules.rules, units=gpt_rules.UNITS, prefetch=1)
    cm = ComputeModel(name=f"measured at world 1 ({config})", units=tuple(tuple(u) for u in compute["units"]),
                      optimizer_s=compute["optimizer_s"], batch=tuple(compute["batch"]))
    return plan.forecast(network, cm, batch=tuple(compute["batch"]), scalar_all_reduces=2)


def main(argv=None):
    args = parse_args(argv)
    if args.worker == "compute":
        return compute_worker(args)
    from shardplan.forecast import network
    result = {"world": args.world, "batch": args.batch, "seq": args.seq, "steps": args.steps, "configs": {},
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}

    def save():  # after every round: a run cut short still leaves what it measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.network or measure_network(args, tmp)
        with open(path) as f:
            measured = json.load(f)
        net = network(path)
        result["network"] = net.to_dict()
        result["network_measurement"] = measured.get("measured")
        for config in args.configs.split(","):
            rounds = []
            for r in range(args.rounds):
                compute = measure_compute(args, config, tmp)
                step = measure_step(args, config)
                f = forecast_of(args, config, net, compute)
                g = forecast_of(args, config, net, {**compute, "units": compute["median_units"],
                                                    "optimizer_s": compute["median_optimizer_s"]})
                rounds.append({"measured_step_s": step["step_s"], "forecast_step_s": f.step_s,
                               "ratio": f.step_s / step["step_s"], "ratio_without_skew": g.step_s / step["step_s"], "compute_only_s": compute["step_s"],
                               "forecast_compute_s": f.compute_s, "forecast_exposed_s": f.exposed_s,
                               "comm_bytes": f.comm_bytes(), "units": len(compute["units"]),
                               "measured_steps_s": step["steps"]})
                print(f"{config} round {r}: measured {step['step_s'] * 1e3:.2f} ms, forecast {f.step_s * 1e3:.2f} ms "
                      f"(compute {f.compute_s * 1e3:.2f} + exposed {f.exposed_s * 1e3:.2f}), ratio "
                      f"{f.step_s / step['step_s']:.3f} (medians of the ranks, no skew: {g.step_s / step['step_s']:.3f}); "
                      f"world-1 step {compute['step_s'] * 1e3:.2f} ms", flush=True)
                ratios = [x["ratio"] for x in rounds]
                result["configs"][config] = {"rounds": rounds, "median_ratio": statistics.median(ratios),
                                             "within_25pct": all(abs(x - 1) <= 0.25 for x in ratios)}
                save()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
