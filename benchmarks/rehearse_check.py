"""Rehearsal vs plan on one GPU: rank 0 of Llama-3 8B shapes at dp=8, of 70B shapes at dp=64 and at dp=16 x tp=8
(examples/gpt_rules_tp.py), batch 1x4096 per rank, bf16 compute, with and without activation checkpointing. For each case: the measured peak
(``torch.cuda.max_memory_allocated``) against ``plan.memory(0, recompute=...).peak`` (goal: within 5%), and the
step time. A comparison row runs torch FSDP2 under the same fake process group for the 8B case (``--no-fsdp2``
skips it). Each case runs in a process of its own (fresh process group and memory statistics).

    python3 benchmarks/rehearse_check.py                      # on one H200: ~5-8 minutes
    python3 benchmarks/rehearse_check.py --tiny --out /tmp/r.json   # the same cases at toy sizes, on a CPU

Writes JSON to benchmarks/results/rehearse_check_<device>.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

FULL = [("8B", 8, 1), ("70B", 64, 1), ("70B", 16, 8)]   # (config, dp, tp): tp > 1 with examples/gpt_rules_tp.py
TINY = [("small", 8, 1), ("small", 16, 1)]


def one_case(config: str, dp: int, checkpoint: bool, batch: tuple[int, int], steps: int, dtype: str, tp: int = 1) -> dict:
    import torch
    import gpt
    import gpt_rules_tp
    import shardplan as sp
    from shardplan.step_call import token_inputs
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = gpt.build(config)
    tokens = torch.zeros(*batch, dtype=torch.long, device="meta")
    if tp > 1:
        rules, mesh, kw = gpt_rules_tp.rules, sp.Mesh(dp=dp, tp=tp), {"compute_axes": gpt_rules_tp.compute_axes}
    else:
        rules, mesh, kw = [(r".*", sp.P("dp"))], sp.Mesh(dp=dp), {}
    plan = sp.plan(model, rules, mesh, units=[r"layers\.\d+"], compute_dtype=dtype, trace=token_inputs(model, tokens), **kw)
    plan_s = time.perf_counter() - t0
    out = {"config": config, "dp": dp, "tp": tp, "rank": 0, "checkpoint": checkpoint, "batch": list(batch), "plan_s": plan_s}
    try:
        r = sp.rehearse(lambda: gpt.build(config), plan, rank=0, batch=batch, steps=steps, checkpoint=checkpoint)
    except sp.errors.RehearsalError as exc:
        return {**out, "refused": str(exc), "planned_peak": plan.memory(0, recompute=checkpoint).peak}
    d = r.to_dict()
    keep = ("device", "step_s", "median_step_s", "measured_peak", "measured_peaks", "planned_peak",
            "planned_states_peak", "planned_activations", "peak_ratio", "library_workspace", "peak_ratio_with_workspace", "states_peak_measured", "states_peak_planned",
            "host_s_per_unit", "optimizer_s", "notes")
    return {**out, **{k: d[k] for k in keep}, "units": d["units"][:3] + d["units"][-1:]}


def fsdp2_case(config: str, dp: int, batch: tuple[int, int], steps: int) -> dict:
    """torch's FSDP2 (fully_shard per block and the root, bf16 compute) for rank 0 under the fake process group."""
    import torch
    import torch.distributed as dist
    import gpt
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
    try:
        with torch.device("meta"):
            model = gpt.build(config)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for layer in model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        model.to_empty(device=dev)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
        times, peaks = [], []
        for _ in range(steps):
            x = torch.randint(0, model.config.vocab, batch, device=dev)
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            model(x, x).backward()
            opt.step()
            opt.zero_grad()
            if dev.type == "cuda":
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated())
            times.append(time.perf_counter() - t)
        return {"config": config, "dp": dp, "rank": 0, "fsdp2": True, "step_s": times,
                "median_step_s": sorted(times[1:] or times)[len(times[1:] or times) // 2],
                "measured_peak": max(peaks[1:] or peaks) if peaks else None}
    finally:
        dist.destroy_process_group()


def spawn(kind: str, spec: dict, timeout: float) -> dict:
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", json.dumps({"kind": kind, **spec})],
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        return {**spec, "kind": kind, "error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def gib(n):
    return "-" if n is None else f"{n / 2 ** 30:7.2f} GiB"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="toy sizes (examples/gpt.py 'small', batch 2x32), CPU-fast")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-fsdp2", action="store_true", help="skip the FSDP2 comparison row")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        spec = json.loads(args.one)
        kind = spec.pop("kind")
        res = one_case(**spec) if kind == "shardplan" else fsdp2_case(**spec)
        print(json.dumps(res))
        return
    import torch
    cases = TINY if args.tiny else FULL
    batch = (2, 32) if args.tiny else (1, 4096)
    dtype = "bfloat16"
    steps = 2 if args.tiny else args.steps
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "batch": list(batch), "compute_dtype": dtype, "cases": [], "fsdp2": []}
    t0 = time.perf_counter()
    for config, dp, tp in cases:
        for ck in (False, True):
            r = spawn("shardplan", dict(config=config, dp=dp, tp=tp, checkpoint=ck, batch=batch, steps=steps, dtype=dtype),
                      420)
            results["cases"].append(r)
            status = r.get("refused") or r.get("error") or (
                f"measured {gib(r['measured_peak'])}  planned {gib(r['planned_peak'])}  "
                + (f"ratio {r['peak_ratio']:.3f}  " if r.get("peak_ratio") else "")
                + (f"(with {r['library_workspace'] / 2 ** 20:.0f} MiB library workspace {r['peak_ratio_with_workspace']:.3f})  "
                   if r.get("peak_ratio_with_workspace") else "")
                + f"step {r['median_step_s'] * 1e3:8.1f} ms  (runtime states {gib(r['states_peak_measured'])} vs "
                  f"planned {gib(r['states_peak_planned'])})")
            print(f"{config:>5} dp={dp:<3} tp={tp} checkpoint={ck!s:<5} {status}", flush=True)
    if not args.no_fsdp2 and not args.tiny:
        config, dp, _ = cases[0]
        r = spawn("fsdp2", dict(config=config, dp=dp, batch=batch, steps=steps), 300)
        results["fsdp2"].append(r)
        print(f"FSDP2 {config} dp={dp}: " + (r.get("error") or
              f"measured {gib(r['measured_peak'])}  step {r['median_step_s'] * 1e3:8.1f} ms"), flush=True)
    results["wall_s"] = time.perf_counter() - t0
    ok = [c for c in results["cases"] if c.get("peak_ratio")]
    if ok:
        worst = max(abs(c["peak_ratio"] - 1) for c in ok)
        results["worst_peak_error"] = worst
        print(f"worst |measured/planned - 1| = {100 * worst:.1f}% over {len(ok)} case(s) (goal: 5%)")
        under = [c for c in ok if c["peak_ratio"] > 1]
        if under:
            print(f"{len(under)} case(s) measured above the plan: "
                  + ", ".join(f"{c['config']} dp={c['dp']} checkpoint={c['checkpoint']} by "
                              f"{(c['measured_peak'] - c['planned_peak']) / 2 ** 20:.0f} MiB" for c in under))
    out = args.out or os.path.join(HERE, "results", f"rehearse_check_{'tiny' if args.tiny else 'gpu'}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {out} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
