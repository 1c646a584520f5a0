"""The compute side of the forecast on one GPU: the achievable rate of transformer blocks, and a whole
world-1 step against its forecast.

    python benchmarks/forecast_gpu.py --out benchmarks/results/forecast_h200_w1.json

1. Blocks: one examples/gpt.py block of the 1B, Llama-3-8B and 70B shapes, bf16, forward + backward at
   the batch a run would use; achieved TFLOP/s counted as the forecast counts them
   (shardplan.forecast.flops: 2 FLOPs per matrix weight per token, 4 T d per token for attention, backward
   twice the forward), and the bytes their other ops move (shardplan.optraffic, on the meta device).
   The fit of t = 3F/R + bytes/BW over them (``calibration``) is where the H100/H200 compute presets'
   ``tflops`` and ``elementwise_gbs`` come from.
2. Steps: GPT 1B (examples/gpt.py) and Hugging Face LlamaForCausalLM with Llama-3.2-1B shapes (1.24B
   parameters) with shardplan at world 1 (bf16 compute, fp32 reduce, AdamW foreach, batch 8 x 1024),
   forward / backward / optimizer timed with synchronisation, each in a process of its own, against
   ``plan.forecast`` with the h200-sxm-bf16 preset, of the plan traced on the meta device (memory-bound
   ops counted op by op; ``forecast_untraced``: the width estimate): predicted compute vs measured
   (goal: within 10%).

    python benchmarks/forecast_gpu.py --tiny --out /tmp/f.json     # toy sizes on a CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import gpt  # noqa: E402

import shardplan as sp  # noqa: E402
from shardplan.forecast.flops import unit_flops  # noqa: E402

BLOCKS = [("1B", 8, 1024), ("8B", 2, 8192), ("8B", 1, 4096), ("70B", 1, 4096)]


def cuda_time(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def block_bytes(config: str, b: int, t: int) -> float:
    """Bytes one block's memory-bound ops move, forward + backward, counted on the meta device as a traced
    plan counts them (shardplan.optraffic; attention routed to the fused kernels)."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardplan import activations
    from shardplan.optraffic import moved_bytes
    c = gpt.CONFIGS[config]
    with torch.device("meta"):
        block = gpt.Block(c).to(torch.bfloat16)
    x = torch.empty(b, t, c.dim, device="meta", dtype=torch.bfloat16, requires_grad=True)
    total = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            total[0] += moved_bytes(func, args, kwargs or {}, out)
            return out
    activations._SDPA[:] = [F.scaled_dot_product_attention]
    F.scaled_dot_product_attention = activations._fused_attention
    try:
        with Count():
            block(x).sum().backward()
    finally:
        F.scaled_dot_product_attention = activations._SDPA[0]
    return float(total[0])


def calibrate(blocks: list) -> dict:
    """The least-squares fit of ``t = 3F / R + bytes / BW`` over the blocks (relative errors): the presets'
    ``tflops`` (R) and ``elementwise_gbs`` (BW), and, with both fixed, ``elementwise_bytes`` for untraced plans."""
    import numpy as np
    t = np.array([r["forward_backward_s"] for r in blocks])
    x = np.array([[3 * r["forward_flops"], r["moved_bytes"]] for r in blocks]) / t[:, None]
    inv, *_ = np.linalg.lstsq(x, np.ones(len(blocks)), rcond=None)
    rate, bw = 1 / inv[0], 1 / inv[1]
    tw = np.array([r["batch"][0] * r["batch"][1] * gpt.CONFIGS[r["config"]].dim for r in blocks])
    rest = (t - 3 * np.array([r["forward_flops"] for r in blocks]) / rate) / t
    e = float(np.sum(rest * tw / bw / t) / np.sum((tw / bw / t) ** 2))
    return {"tflops": rate / 1e12, "elementwise_gbs": bw / 1e9, "elementwise_bytes": e,
            "block_ratios": [float((3 * r["forward_flops"] / rate + r["moved_bytes"] / bw) / r["forward_backward_s"])
                             for r in blocks]}


def block_rate(config: str, b: int, t: int, iters: int) -> dict:
    c = gpt.CONFIGS[config]
    block = gpt.Block(c).cuda().to(torch.bfloat16)
    x = torch.randn(b, t, c.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.device("meta"):
        one = torch.nn.Sequential(gpt.Block(c))
    plan = sp.plan(one, [(r".*", sp.P("dp"))], sp.Mesh(dp=1), units=[r"0"], min_unit_bytes=0)
    fwd_flops = unit_flops(plan, (b, t))["0"]

    def fwd():
        with torch.no_grad():
            block(x)

    def fwd_bwd():
        block(x).sum().backward()

    f = cuda_time(fwd, iters)
    fb = cuda_time(fwd_bwd, iters)
    del block, x
    torch.cuda.empty_cache()
    return {"config": config, "batch": [b, t], "forward_s": f, "forward_backward_s": fb, "backward_over_forward": (fb - f) / f,
            "moved_bytes": block_bytes(config, b, t),
            "forward_flops": fwd_flops, "tflops": 3 * fwd_flops / fb / 1e12, "forward_tflops": fwd_flops / f / 1e12}


def _llama_3_2_1b(tiny: bool):
    """Hugging Face LlamaForCausalLM with Llama-3.2-1B shapes (1.24B parameters, tied embeddings)."""
    import transformers
    if tiny:
        return transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        tie_word_embeddings=True)
    return transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                                    rope_theta=500000.0, tie_word_embeddings=True)


def step(model_name: str, steps: int, batch: tuple[int, int], tiny: bool = False) -> dict:
    """A training step at world 1 with shardplan (bf16 compute, fp32 reduce, AdamW foreach), forward /
    backward / optimizer timed with synchronisation, against ``plan.forecast`` with the h200-sxm-bf16 preset
    (the h200-8x-ib400 network's device). ``model_name``: "gpt-1B" (examples/gpt.py) or "hf-llama-1.24B"."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    tmp = tempfile.mkdtemp()
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1),
                            rank=0, world_size=1)
    torch.manual_seed(0)
    b, t = batch
    if model_name == "gpt-1B":
        with torch.device("meta"):
            model = gpt.build("tiny" if tiny else "1B")
            meta_model = gpt.build("tiny" if tiny else "1B")
        model.to_empty(device=dev)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, 0.02)
        vocab = model.config.vocab
        rules, units = [(r".*", sp.P("dp"))], [r"layers\.\d+"]
        x = torch.randint(0, vocab, (b, t + 1), device=dev)

        def call():
            return model(x[:, :-1], x[:, 1:])
    elif model_name == "hf-llama-1.24B":
        import transformers
        cfg = _llama_3_2_1b(tiny)
        with torch.device(dev):  # built where it runs: the rotary table is computed, not left on meta
            model = transformers.LlamaForCausalLM(cfg)
        with torch.device("meta"):
            meta_model = transformers.LlamaForCausalLM(cfg)
        vocab = cfg.vocab_size
        rules, units = [(r".*norm\.weight", sp.P()), (r".*", sp.P("dp"))], [r"model\.layers\.\d+"]
        x = torch.randint(0, vocab, (b, t), device=dev)

        def call():
            return model(input_ids=x, labels=x).loss
    else:
        raise ValueError(f"unknown model {model_name!r}")
    plan = sp.plan(model, rules, sp.Mesh(dp=1), units=units, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                   min_unit_bytes=0 if tiny else None)
    # the same plan traced on the meta device: its memory-bound ops counted op by op (forecast, not sharding)
    token_call = (lambda t: ((), {"input_ids": t, "labels": t})) if model_name.startswith("hf") else (lambda t: (t, t))
    traced = sp.plan(meta_model, rules, sp.Mesh(dp=1), units=units, compute_dtype=torch.bfloat16,
                     reduce_dtype=torch.float32, min_unit_bytes=0 if tiny else None,
                     trace=token_call(torch.zeros(b, t, dtype=torch.long, device="meta")))
    sp.shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    parts = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        loss = call()
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t3 = time.perf_counter()
        parts.append((t1 - t0, t2 - t1, t3 - t2))
    steady = parts[2:] if len(parts) > 2 else parts
    med = [statistics.median(p[i] for p in steady) for i in range(3)]
    dist.destroy_process_group()
    n = sum(p.numel for p in plan.params)

    def summary(f):
        return {"forward_s": f.forward_s, "backward_s": f.backward_s, "optimizer_s": f.optimizer_s, "step_s": f.step_s,
                "matmul_s": f.matmul_s, "memory_bound_s": f.memory_s, "memory_bound_bytes": f.memory_bytes,
                "copies_s": f.copies_s, "memory_traffic": f.traffic, "compute_ratio": f.compute_s / sum(med)}
    f = traced.forecast("h200-8x-ib400", batch=batch)
    g = plan.forecast("h200-8x-ib400", batch=batch)
    return {"model": model_name, "parameters": n, "batch": list(batch),
            "measured": {"forward_s": med[0], "backward_s": med[1], "optimizer_s": med[2], "step_s": sum(med)},
            "forecast": {**summary(f), "compute": f.compute.to_dict()}, "forecast_untraced": summary(g),
            "compute_ratio": f.compute_s / sum(med)}


def spawn_step(model_name: str, steps: int, batch: tuple[int, int], tiny: bool) -> dict:
    """``step`` in a process of its own (a fresh process group and allocator)."""
    import subprocess
    spec = json.dumps({"model_name": model_name, "steps": steps, "batch": list(batch), "tiny": tiny})
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", spec], capture_output=True, text=True,
                       timeout=900)
    if p.returncode != 0:
        return {"model": model_name, "error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--tiny", action="store_true", help="toy sizes on a CPU: checks the script, measures nothing useful")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        spec = json.loads(args.one)
        print(json.dumps(step(spec["model_name"], spec["steps"], tuple(spec["batch"]), spec["tiny"])))
        return
    cuda = torch.cuda.is_available()
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "blocks": []}
    if cuda and not args.tiny:
        for config, b, t in BLOCKS:
            r = block_rate(config, b, t, args.iters)
            out["blocks"].append(r)
            print(f"{config} block at {b}x{t}: {r['forward_backward_s'] * 1e3:.2f} ms fwd+bwd, {r['tflops']:.1f} TFLOP/s "
                  f"(forward alone {r['forward_tflops']:.1f}), backward/forward {r['backward_over_forward']:.2f}", flush=True)
    if out["blocks"]:
        out["calibration"] = cal = calibrate(out["blocks"])
        print(f"calibration: tflops {cal['tflops']:.0f}, elementwise_gbs {cal['elementwise_gbs']:.0f}, elementwise_bytes "
              f"{cal['elementwise_bytes']:.0f}; blocks forecast/measured {[round(x, 3) for x in cal['block_ratios']]}",
              flush=True)
    batch = (2, 32) if args.tiny else (8, 1024)
    steps = 3 if args.tiny else args.steps
    out["steps"] = []
    for name in ("gpt-1B", "hf-llama-1.24B"):
        s = spawn_step(name, steps, batch, args.tiny)
        out["steps"].append(s)
        if "error" in s:
            print(f"{name} step at world 1: {s['error']}", flush=True)
            continue
        m, f = s["measured"], s["forecast"]
        print(f"{name} ({s['parameters'] / 1e9:.2f}B) step at world 1, batch {batch[0]}x{batch[1]}: measured "
              f"{m['step_s'] * 1e3:.1f} ms (forward {m['forward_s'] * 1e3:.1f}, backward {m['backward_s'] * 1e3:.1f}, "
              f"optimizer {m['optimizer_s'] * 1e3:.1f}); forecast {f['step_s'] * 1e3:.1f} ms (forward "
              f"{f['forward_s'] * 1e3:.1f}, backward {f['backward_s'] * 1e3:.1f}, optimizer {f['optimizer_s'] * 1e3:.1f}; "
              f"matmuls {f['matmul_s'] * 1e3:.1f}, memory-bound {f['memory_bound_s'] * 1e3:.1f} for "
              f"{f['memory_bound_bytes'] / 1e9:.1f} GB traced, copies {f['copies_s'] * 1e3:.1f}); "
              f"compute ratio {s['compute_ratio']:.3f} (goal: within 10%; untraced plan: "
              f"{s['forecast_untraced']['compute_ratio']:.3f})", flush=True)
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
