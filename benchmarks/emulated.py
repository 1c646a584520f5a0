"""Several GPUs, emulated: one rank of an N-rank job on this GPU, every collective taking the time a network
model gives it on the stream it runs on (docs/emulated.md). shardplan and torch FSDP2 side by side, one launch.

    python benchmarks/emulated.py --model hf:llama3_8b --world 8 --batch 2 --seq 8192 --ac selective \
        --systems fsdp2,fsdp2_compile,shardplan,shardplan_compile --network h100-8x-ib400 --out 8b.json
    python benchmarks/emulated.py --model gpt:1B --world 8,64,512 --batch 4 --seq 2048 --out 1b.json
    python benchmarks/emulated.py --model hf:llama3_70b:8 --world 64 --batch 1 --seq 8192 --ac full
    python benchmarks/emulated.py --model gpt:tiny --world 8 --batch 2 --seq 64 --steps 3   # CPU (comm thread)

Every system trains the same model (built on the meta device: only rank 0's shards exist) on the same random
tokens with AdamW; each step is timed with CUDA events (the host clock on a CPU). For each system the same
steps also run with every collective free (``--network none``'s fake process group), so

    exposed communication = step under the network - step with free collectives
    overlap               = 1 - exposed / (the network's modelled seconds of the step's collectives)

The systems: ``fsdp2`` (torch ``fully_shard`` per block and the root, torchtitan's order: blocks resharded
after forward but the last, bf16 parameters, fp32 reductions), ``fsdp2_compile`` (each block
``torch.compile``d before sharding: torchtitan's), ``shardplan`` (one unit per block, ``prefetch``,
the same dtypes), ``shardplan_compile`` (``sp.compile_units``), ``shardplan_captured`` (the step captured into
a CUDA graph: ``sp.rehearse(capture=True)``). ``--ac selective`` is torchtitan's op-level selective activation
checkpointing (every block: every other matmul and the attention's output saved), ``full`` every block.

Nothing here ran on several GPUs: each figure is one GPU playing rank 0 under the network model named in the
JSON (``network``), and says so.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
import shardplan as sp  # noqa: E402
from shardplan.step_call import scalar_of, token_inputs  # noqa: E402
from shardplan.metatrace import training_call  # noqa: E402
from shardplan.units import trace_args  # noqa: E402

SYSTEMS = ("fsdp2", "fsdp2_compile", "shardplan", "shardplan_compile", "shardplan_captured")


# -- models ------------------------------------------------------------------------------------------

def model_fn(spec: str):
    """``gpt:NAME`` (shardplan's example GPT), ``hf:NAME[:LAYERS]`` (a shipped Hugging Face config, optionally
    truncated to its first LAYERS blocks): a function that builds it (under the caller's meta device)."""
    kind, _, rest = spec.partition(":")
    if kind == "gpt":
        from shardplan.models.gpt import build
        return lambda: build(rest)
    if kind == "hf":
        import transformers
        name, _, layers = rest.partition(":")
        path = os.path.join(os.path.dirname(sp.__file__), "models", "hf", f"{name}.json")
        with open(path) as f:
            d = json.load(f)
        if layers:
            d["num_hidden_layers"] = int(layers)
        d["use_cache"] = False
        cfg = transformers.AutoConfig.for_model(**d)
        cfg._attn_implementation = "sdpa"

        def build():
            return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        return build
    raise SystemExit(f"--model {spec!r}: use gpt:NAME or hf:NAME[:LAYERS]")


def blocks_of(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The repeated blocks: ``(path, ModuleList)`` of the list holding the most parameters."""
    best = max(((p, m) for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1),
               key=lambda pm: sum(x.numel() for x in pm[1].parameters()))
    return best


def unit_pattern(model: nn.Module) -> str:
    path, _ = blocks_of(model)
    return path.replace(".", r"\.") + r"\.\d+"


# -- activation checkpointing (torchtitan's) --------------------------------------------------------------

def _sac_context():
    """torchtitan's op-level selective activation checkpointing policy: save every compute op's output in its
    list (matmuls, attention, reductions' outputs) except every second matmul."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_cudnn_attention.default,
            aten.max.default}
    counts = collections.Counter()

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            counts[mode] += 1
        keep = func in save and not (func == aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def apply_ac(model: nn.Module, mode: str) -> None:
    """Checkpoint each block inside its own call (its hooks stay outside, as torchtitan's wrapper leaves
    FSDP2's)."""
    if mode == "none":
        return
    from torch.utils.checkpoint import checkpoint
    _, blocks = blocks_of(model)
    for block in blocks:
        kw = {"context_fn": _sac_context} if mode == "selective" else {}
        block.forward = (lambda *a, _f=block.forward, _kw=kw, **k:
                         checkpoint(_f, *a, use_reentrant=False, **_kw, **k))


def init_weights(model: nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_meta:
                continue
            if name.endswith("norm.weight") or p.ndim == 1 and "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)


# -- one system -----------------------------------------------------------------------------------------

def fill_buffers(model: nn.Module) -> None:
    """Every floating-point buffer (RoPE's inverse frequencies, left uninitialised by ``to_empty``) filled with
    ones, as a rehearsal fills the buffers it built on meta: the same values under every system."""
    with torch.no_grad():
        for b in model.buffers():
            if b.is_floating_point():
                b.fill_(1.0)


def init_local(model: nn.Module) -> None:
    """Each local shard (a DTensor's local tensor) filled: norms with ones, the rest N(0, 0.02); no collective."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            if t.is_meta:
                continue
            t.fill_(1.0) if "norm" in name else t.normal_(0, 0.02)


def vocab_of(model: nn.Module) -> int:
    return next(m for m in model.modules() if isinstance(m, nn.Embedding)).num_embeddings


def setup_fsdp2(name: str, args, dev, world: int):
    """torch FSDP2 as torchtitan applies it: each block (compiled first for ``fsdp2_compile``), then the root;
    blocks resharded after forward but the last; bf16 parameters, fp32 reductions; fused AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    with torch.device("meta"):
        model = model_fn(args.model)()
    apply_ac(model, args.ac)
    _, blocks = blocks_of(model)
    if name == "fsdp2_compile":
        for block in blocks:
            block.compile()
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    model.to_empty(device=dev)
    init_local(model)
    fill_buffers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    return model, opt


def shardplan_plan(args, world: int):
    with torch.device("meta"):
        twin = model_fn(args.model)()
    return sp.plan(twin, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[unit_pattern(twin)],
                   compute_dtype="bf16", reduce_dtype="fp32", prefetch=args.prefetch, layout=args.layout,
                   min_unit_bytes=args.min_unit_bytes)


def setup_shardplan(name: str, args, dev, world: int):
    """shardplan with the same dtypes: one unit per block, ``--prefetch``; built on meta and started up one unit
    at a time (as a rehearsal does: only rank 0's shards exist); ``shardplan_compile``: ``sp.compile_units``."""
    from shardplan.rehearsal.init import RehearsalInit, _fill_meta_buffers
    plan = shardplan_plan(args, world)
    with torch.device("meta"):
        model = model_fn(args.model)()
    apply_ac(model, args.ac)
    model.train()
    sp.shard(model, plan, init_fn=RehearsalInit(model, None))
    _fill_meta_buffers(model, dev)
    fill_buffers(model)
    if name == "shardplan_compile":
        sp.compile_units(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    return model, opt


class Clock:
    def __init__(self, dev):
        self.dev = dev

    def now(self):
        if self.dev.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


def step_fn(model, opt, args, dev):
    """One training step on fresh random tokens, timed: forward (the model's loss, or the mean of its output),
    backward, AdamW."""
    clock, vocab = Clock(dev), vocab_of(model)
    gen = torch.Generator().manual_seed(0)

    def step() -> float:
        tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(dev)
        a, k = training_call(model, *trace_args(token_inputs(model, tokens)), where="the benchmark's step")
        t0 = clock.now()
        scalar_of(model(*a, **k)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return clock.seconds(t0, clock.now())
    return step


def run_eager(name: str, args, dev, world: int, net) -> dict:
    """One system at ``world`` under ``net``: warm-up steps, then ``--steps`` steps with the network's time
    and as many with every collective free (``timed_kinds(())``), interleaved; the ledger of the timed ones."""
    from shardplan.runtime.emulated import emulated_network, ledger, reset_ledger, timed_kinds
    setup = setup_fsdp2 if name.startswith("fsdp2") else setup_shardplan
    with emulated_network(net, rank=0, world_size=world, comm_ctas=args.comm_ctas):
        model, opt = setup(name, args, dev, world)
        step = step_fn(model, opt, args, dev)
        for _ in range(args.warmup):
            step()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        timed, free, modelled = [], [], collections.Counter()
        for _ in range(args.steps):
            reset_ledger()
            timed.append(step())
            for kind, e in ledger().by_kind.items():
                modelled[kind] += e.modelled_s / args.steps
            with timed_kinds(()):
                free.append(step())
        peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
        del model, opt, step
        _free(dev)
    return {"step_s": timed, "free_step_s": free, "peak": peak, "modelled_s": dict(modelled)}


def run_captured(name: str, args, dev, world: int, net) -> dict:
    """shardplan's step captured into a CUDA graph (``sp.rehearse(capture=True, network=...)``: its replays
    with the network and a second capture replayed with it off)."""
    build = model_fn(args.model)

    def fn():
        m = build()
        apply_ac(m, args.ac)
        return m
    from shardplan.runtime.emulated import configure
    configure(None, comm_ctas=args.comm_ctas)  # (the rehearsal configures the network, keeping this)
    r = sp.rehearse(fn, shardplan_plan(args, world), rank=0, batch=(args.batch, args.seq), steps=args.steps,
                    network=net, capture=True)
    _free(dev)
    n = r.network
    return {"step_s": [n.step_s], "free_step_s": list(n.baseline_steps) or [n.baseline_step_s],
            "peak": r.measured_peak, "planned_peak": r.planned_peak, "modelled_s": dict(n.modelled_s)}


def _free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# -- the grid -------------------------------------------------------------------------------------------

def summarise(runs: dict, args, world: int, net_name: str) -> dict:
    tokens = args.batch * args.seq
    with torch.device("meta"):
        m = model_fn(args.model)()
    cfg = getattr(m, "config", None)
    layers = getattr(cfg, "num_hidden_layers", 0) or 0
    dim = getattr(cfg, "hidden_size", 0) or 0
    fpt = sp.metrics.flops_per_token(m, seq=args.seq, layers=layers, dim=dim)
    peak = sp.metrics.peak_tflops() if torch.cuda.is_available() else None
    rows = {}
    for name, r in runs.items():
        step, free = statistics.median(r["step_s"]), statistics.median(r["free_step_s"])
        modelled = sum(r["modelled_s"].values())
        exposed = max(step - free, 0.0)
        rows[name] = {"step_s": step, "free_comm_step_s": free, "exposed_comm_s": exposed,
                      "exposed_fraction": exposed / step, "modelled_comm_s": modelled,
                      "modelled_comm_by_kind_s": r["modelled_s"],
                      "overlap": 1.0 - exposed / modelled if modelled > 0 else None,
                      "tokens_per_s_per_gpu": tokens / step, "mfu": fpt * tokens / step / (peak * 1e12) if peak else None,
                      "peak_bytes": r.get("peak"), "planned_peak_bytes": r.get("planned_peak"),
                      "steps_s": r["step_s"], "free_steps_s": r["free_step_s"]}
    base = rows.get("fsdp2_compile") or rows.get("fsdp2")
    for row in rows.values():
        row["step_vs_fsdp2"] = row["step_s"] / rows["fsdp2"]["step_s"] if "fsdp2" in rows else None
        row["step_vs_fsdp2_compile"] = (row["step_s"] / rows["fsdp2_compile"]["step_s"]
                                        if "fsdp2_compile" in rows else None)
    del base
    return {"world": world, "network": net_name, "flops_per_token": fpt, "systems": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt:1B")
    ap.add_argument("--world", default="8", help="comma-separated world sizes (8 GPUs a node)")
    ap.add_argument("--network", default="h100-8x-ib400", help="a preset or JSON file (forecast's networks)")
    ap.add_argument("--systems", default=",".join(SYSTEMS[:3]))
    ap.add_argument("--batch", type=int, default=2, help="local batch (sequences per rank)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ac", choices=("none", "selective", "full"), default="none")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--comm-ctas", type=int, default=1, help="SMs each emulated collective holds (NCCL's channels)")
    ap.add_argument("--layout", default="auto")
    ap.add_argument("--min-unit-bytes", type=int, default=None)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    net = sp.forecast.network(args.network)
    grid, failed = [], []
    for world in (int(w) for w in args.world.split(",")):
        runs = {}
        for name in args.systems.split(","):
            run = run_captured if name == "shardplan_captured" else run_eager
            try:
                r = run(name, args, dev, world, net)
            except Exception as exc:  # one system failing (out of memory, say) leaves the others' figures
                print(f"[{name} at {world}] failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
                failed.append({"system": name, "world": world, "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
                _free(dev)
                continue
            runs[name] = r
            print(f"[{name} at {world}] step {statistics.median(r['step_s']) * 1e3:.1f} ms, free collectives "
                  f"{statistics.median(r['free_step_s']) * 1e3:.1f} ms, modelled comm "
                  f"{sum(r['modelled_s'].values()) * 1e3:.1f} ms", flush=True)
        grid.append(summarise(runs, args, world, net.name))
    out = {"emulated": True, "what": "one GPU playing rank 0 of N; collectives timed by the network model, not run "
                                     "on several GPUs", "device": torch.cuda.get_device_name() if dev.type == "cuda"
           else "cpu", "torch": torch.__version__, "network": net.to_dict(), "args": vars(args), "grid": grid,
           "failed": failed}
    print(json.dumps(out, indent=1, default=str))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
