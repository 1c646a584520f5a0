"""A model this project did not write, side by side: Hugging Face LlamaForCausalLM (Llama-3.2-1B shapes,
1.24B parameters, tied embeddings) trained by shardplan and by FSDP2 in one launch.

    python benchmarks/hf_step.py --batch 4 --seq 2048 --out hf_llama.json          # one GPU
    python benchmarks/hf_step.py --tiny --steps 2 --rounds 1                        # CPU, a smoke run
    python benchmarks/hf_step.py --systems unsharded,unsharded_captured,shardplan,shardplan_captured,fsdp2,fsdp2_compile

Each system builds the model from the same seed, wraps every decoder layer as a unit (shardplan:
``units=[r"model\\.layers\\.\\d+"]``; FSDP2: ``fully_shard`` per layer, then the root), trains with bf16
compute, fp32 reduction and AdamW (foreach) on the same batches; systems alternate over rounds. Reported:
median step time, peak device memory (``max_memory_allocated`` after a reset, each system alone on the
device; ``peak_requested_gib``: the same peak in the bytes the tensors asked for, before the allocator's
rounding), and the losses, which must agree. ``--snapshot``: the last round records the allocator's trace
and reports what is live at each system's peak, by allocation site, and where two systems differ
(benchmarks/_memsnap.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))
import shardplan as sp  # noqa: E402
from _report import emit, start_world, top_kernels  # noqa: E402
import _memsnap  # noqa: E402
from forecast_gpu import _llama_3_2_1b  # noqa: E402


def build(args, dev):
    import transformers
    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(_llama_3_2_1b(args.tiny))
    if args.attention == "capturable":  # every system: eager and captured run the same attention kernel
        from shardplan.hf import capturable_attention
        capturable_attention(model)
    return model


def make(name, args, dev, world):
    """``(step(x) -> loss, info)``: one training step of system ``name`` (``*_captured``: the step captured once
    with ``sp.capture`` and replayed, over a capturable AdamW; ``unsharded``: the model alone, under autocast)."""
    base, _, mode = name.partition("_")
    captured = mode == "captured"
    model = build(args, dev)
    dt = torch.bfloat16 if args.dtype == "bf16" else None
    info = {}
    ctx = contextlib.nullcontext
    if base == "shardplan":
        plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"model\.layers\.\d+"],
                       compute_dtype=dt, reduce_dtype=torch.float32 if dt else None)
        sp.shard(model, plan)
        info.update(units=len(plan.units), plan_peak=plan.memory().peak)
    elif base == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=torch.float32) if dt else MixedPrecisionPolicy()
        if mode == "compile":  # each decoder layer compiled, before sharding (torchtitan's order)
            for layer in model.model.layers:
                layer.compile()
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    elif base == "unsharded":
        if world > 1:
            raise SystemExit("unsharded runs at world 1 only")
        if dt:  # autocast's cast cache cannot outlive a step that is replayed
            ctx = lambda: torch.autocast(dev.type, dtype=dt, cache_enabled=not captured)  # noqa: E731
    else:
        raise SystemExit(f"unknown system {name}")
    kind = {"fused": True} if args.adamw == "fused" else {"foreach": True}
    if captured:
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-4, device=dev), capturable=True, **kind)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **kind)

    sdpa = _sdpa_backend(args.sdpa)

    def step(x):
        with ctx(), sdpa():
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return (sp.capture(step) if captured else step), info


def _sdpa_backend(name):
    """``--sdpa``: the attention kernels torch's SDPA may pick (``default``: its own choice)."""
    if name == "default":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]
    return lambda: sdpa_kernel(backend)


def run(step, data, dev):
    times, losses = [], []
    for x in data:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = step(x)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(loss.float().item())
    return times, losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--systems", default="shardplan,fsdp2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="a two-layer model of the same kind (CPU smoke runs)")
    ap.add_argument("--snapshot", action="store_true", help="GPU: what is live at each system's peak (last round)")
    ap.add_argument("--adamw", choices=("foreach", "fused"), default="foreach", help="AdamW's implementation (all systems)")
    ap.add_argument("--sdpa", choices=("default", "flash", "cudnn", "efficient"), default="default",
                    help="the SDPA kernels the model's attention may use (all systems)")
    ap.add_argument("--attention", choices=("capturable", "sdpa"), default="capturable",
                    help="capturable: shardplan.hf.capturable_attention on every system (transformers 5.0-5.17 "
                         "build a causal mask under capture only); sdpa: transformers' own")
    ap.add_argument("--kernels", action="store_true", help="GPU: each system's top kernels over two steps (last round)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda, dev = start_world()
    world, rank = dist.get_world_size(), dist.get_rank()
    vocab = _llama_3_2_1b(args.tiny).vocab_size
    g = torch.Generator().manual_seed(123)
    per = args.batch // world
    data = [torch.randint(0, vocab, (args.batch, args.seq), generator=g)[rank * per:(rank + 1) * per].to(dev)
            for _ in range(args.warmup + args.steps)]
    systems = args.systems.split(",")
    res = {s: {"times": [], "peak": [], "requested": [], "losses": None} for s in systems}
    for k in range(args.rounds):
        for s in systems:
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            snap = cuda and args.snapshot and k == args.rounds - 1
            with _memsnap.recording() if snap else contextlib.nullcontext():
                step, info = make(s, args, dev, world)
                times, losses = run(step, data, dev)
                if cuda and args.kernels and k == args.rounds - 1:
                    res[s]["kernels"] = top_kernels(lambda x=data[-1]: step(x), calls=2)
                if snap:
                    res[s]["live_at_peak"] = _memsnap.live_at_peak(torch.cuda.memory._snapshot())
            r = res[s]
            r["times"] += times[args.warmup:]
            r["losses"] = losses
            r.update(info)
            if cuda:
                r["peak"].append(torch.cuda.max_memory_allocated())
                r["requested"].append(torch.cuda.memory_stats()["requested_bytes.all.peak"])
            del step
    out = {"model": "HF LlamaForCausalLM, Llama-3.2-1B shapes" + (" (tiny)" if args.tiny else ""),
           "world": world, "adamw": args.adamw, "sdpa": args.sdpa, "attention": args.attention, "batch": args.batch, "seq": args.seq, "dtype": args.dtype, "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if cuda else "cpu", "systems": {}}
    for s, r in res.items():
        out["systems"][s] = {"median_step_ms": 1e3 * statistics.median(r["times"]),
                             "peak_gib": max(r["peak"]) / 2**30 if r["peak"] else None,
                             "peak_requested_gib": max(r["requested"]) / 2**30 if r["requested"] else None,
                             "losses": r["losses"], **{k: r[k] for k in ("units", "plan_peak", "live_at_peak", "kernels") if k in r}}
    for ref in ("fsdp2", "unsharded"):  # every system's step time against the references that ran
        if ref in out["systems"]:
            out[f"x_{ref}"] = {k: v["median_step_ms"] / out["systems"][ref]["median_step_ms"]
                               for k, v in out["systems"].items()}
    if "shardplan" in res and "fsdp2" in res:
        a, b = out["systems"]["shardplan"], out["systems"]["fsdp2"]
        out["shardplan/fsdp2"] = {"step": a["median_step_ms"] / b["median_step_ms"],
                                  "peak": a["peak_gib"] / b["peak_gib"] if a["peak_gib"] else None}
        if "live_at_peak" in a and "live_at_peak" in b:  # by allocation site: shardplan's bytes (a) minus FSDP2's (b)
            out["peak_diff_by_site"] = _memsnap.diff(a["live_at_peak"], b["live_at_peak"])
        out["losses_agree"] = all(abs(x - y) <= 2e-2 * max(1.0, abs(y)) for x, y in zip(a["losses"], b["losses"]))
    emit(out, args.out if rank == 0 else None, print_it=rank == 0)


if __name__ == "__main__":
    main()
