"""Train-step benchmark: shardplan vs FSDP2 (fully_shard) vs unsharded vs Megatron-FSDP, one launch.

    python benchmarks/train_step.py --config 1B --batch 8 --seq 1024 --dtype bf16 --out out.json   # 1 GPU
    python benchmarks/train_step.py --config 8B --batch 1 --seq 8192 --dtype bf16 --act-ckpt --trace-plan \
        --systems shardplan_offload --offload optimizer --forecast h200-8x-ib400:8   # CPU offload (docs/offload.md)
    python benchmarks/train_step.py --config 1B --batch 8 --seq 1024 --dtype bf16 \
        --systems shardplan,shardplan_offload --offload balance       # the fraction whose host step backward hides
    python benchmarks/train_step.py --config 1B --batch 8 --seq 1024 --dtype bf16 \
        --systems shardplan,shardplan_int8,shardplan_fp8,shardplan_int8_qg,fsdp2   # docs/low_precision.md
    python benchmarks/train_step.py --config 8B --batch 1 --seq 8192 --dtype bf16 --act-ckpt --compile \
        --systems shardplan,shardplan_fp8c,shardplan_fp8c_cast,fsdp2,fsdp2_fp8   # FP8 compute (shardplan[fp8])
    torchrun --nproc-per-node 2 benchmarks/train_step.py --config small --out cpu.json             # CPU, gloo

Every system trains the same GPT (examples/gpt.py; units = transformer blocks) from the same
initial weights on the same batches with AdamW; systems alternate over several rounds, warm-up steps
excluded. Reported per system: median step time, peak memory (GPU: torch.cuda.max_memory_allocated
after a reset, each system alone on the device; CPU: the runtime's own accounting, shardplan only),
bytes communicated per step and rank, and the first losses (which must agree, or the comparison is
void). ``--breakdown`` also times forward, backward and optimizer separately.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
import gpt  # noqa: E402
import gpt_rules_tp  # noqa: E402

import shardplan as sp  # noqa: E402
from _report import meta_params, start_world  # noqa: E402


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def rss_now() -> int:
    """The process's resident host memory now, in bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def build_model(args, dev):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = gpt.build(args.config, max_seq=max(args.seq, gpt.CONFIGS[args.config].max_seq))
    model.to_empty(device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=g)
    if args.act_ckpt:  # activation checkpointing of every block (inside its call: the unit hooks stay outside)
        from torch.utils.checkpoint import checkpoint
        for layer in model.layers:
            layer.forward = lambda *a, _f=layer.forward: checkpoint(_f, *a, use_reentrant=False)
    return model


def planning_twin(args, world, names=()):
    """``(model, trace kwargs)`` to plan with: a meta twin of the benchmark's ``model`` (a plan is data: it
    shards the real one; ``names``: the real model's parameters, those it holds untied stay untied), traced
    on one rank's batch with ``--trace-plan`` (``plan.memory()`` then counts activations; ``--act-ckpt``: as
    recomputed)."""
    with torch.device("meta"):
        twin = gpt.build(args.config, max_seq=max(args.seq, gpt.CONFIGS[args.config].max_seq))
    for name in set(names) - {n for n, _ in twin.named_parameters()}:  # build_model's to_empty unties tied weights
        path, _, attr = name.rpartition(".")
        owner = twin.get_submodule(path)
        setattr(owner, attr, torch.nn.Parameter(torch.empty_like(getattr(owner, attr))))
    if not args.trace_plan:
        return twin, {}
    from shardplan.step_call import token_inputs
    tokens = torch.zeros(args.batch // world, args.seq, dtype=torch.long, device="meta")
    return twin, dict(trace=token_inputs(twin, tokens))


def calibrate(args, dev, world, plan, steps=4):
    """The host AdamW's kernel seconds per step under ``plan`` and the backward's seconds (the window the
    host step overlaps), measured on a fresh model over ``steps`` steps (the first one not counted)."""
    model = build_model(args, dev)
    sp.shard(model, plan)
    hosted = bool(plan.offload)
    opt = sp.offload_optimizer(model, lr=1e-4) if hosted else torch.optim.AdamW(model.parameters(), lr=1e-4)
    ctx = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if args.dtype == "bf16" else None
    back = []
    for k, (x, y) in enumerate(batches(args, dev, dist.get_rank(), world, steps)):
        if k == 1 and hosted:
            opt.host_stats(reset=True)
        with (ctx() if ctx else _null()):
            loss = model(x, y)
        sync(dev)
        t0 = time.perf_counter()
        loss.backward()
        sync(dev)
        back.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    kernel = opt.host_stats()["kernel_s"] / (steps - 1) if hosted else 0.0
    del model, opt
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return kernel, statistics.median(back[1:])


SHARDPLAN_SYSTEMS = ("shardplan", "shardplan_raf", "shardplan_int8", "shardplan_fp8", "shardplan_int8_qg",
                     "shardplan_fp8c", "shardplan_fp8c_cast", "shardplan_chunked", "shardplan_chunked_dt")
# shardplan_chunked: layout="chunked" (every parameter a torch.chunk piece, DTensor-describable, as FSDP2) against
# the default layout="auto" (contiguous packing of dim-0 specs: no copy-out after the gather); _dt: the same plan
# with DTensor parameters (shard(..., dtensor_params=True), fully_shard's): the optimizer steps through DTensor
# FP8 compute through torchao: _fp8c gathers the Float8Linear weights as float8 (one scale per weight), _fp8c_cast
# in bf16 (torchao casts after the gather), fsdp2_fp8 is FSDP2 + torchao's float8 all-gather (torchtitan's recipe)
FP8_SYSTEMS = ("shardplan_fp8c", "shardplan_fp8c_cast", "fsdp2_fp8")
ADAMW = {"foreach": True}  # --adamw: the torch AdamW implementation every system uses ({"fused": True} for fused)


class SkippedSystem(Exception):
    """A system that cannot run here (torchao missing): reported as skipped, the others run."""


def need_torchao():
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise SkippedSystem(f"skipped: torchao is not installed (pip install 'shardplan[fp8]'): {exc}") from None


class _AfterStep:
    """An optimizer whose step() is followed by ``fn`` (FSDP2 + torchao: precompute the float8 weight scales)."""

    def __init__(self, opt, fn):
        self.opt, self.fn = opt, fn

    def step(self):
        self.opt.step()
        self.fn()

    def zero_grad(self, set_to_none=True):
        self.opt.zero_grad(set_to_none=set_to_none)


def make_system(name, args, dev, world):
    if name.endswith("_captured"):  # the same system, its whole step captured once and replayed (sp.capture)
        return captured_system(name[:-len("_captured")], args, dev, world)
    if name in ("fsdp2_compile", "shardplan_compile"):  # each block compiled: FSDP2's per layer before sharding
        args = argparse.Namespace(**{**vars(args), "compile": True})  # (the best eager FSDP2 a user would run),
        name = name[:-len("_compile")]                                  # shardplan's units by sp.compile_units
    model = build_model(args, dev)
    dt = torch.bfloat16 if args.dtype == "bf16" else None
    info = {}
    if name == "unsharded":
        wrapped = model
        ctx = (lambda: torch.autocast(dev.type, dtype=dt)) if dt else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **ADAMW)
        return wrapped, opt, ctx, info
    if name in FP8_SYSTEMS:
        need_torchao()
    if name in SHARDPLAN_SYSTEMS:
        # _int8/_fp8: quantized gathers, _int8_qg: and the int8 gradient reduction, _fp8c: FP8 compute (torchao
        # Float8Linear, bf16 gathers) (docs/low_precision.md)
        gather = {"shardplan_int8": "int8", "shardplan_fp8": "float8_e4m3fn", "shardplan_int8_qg": "int8"}.get(name)
        reduce = "int8" if name == "shardplan_int8_qg" else torch.float32 if dt else None
        opts = dict(units=[r"layers\.\d+"], compute_dtype=dt, reduce_dtype=reduce,
                    prefetch=args.prefetch, min_unit_bytes=args.min_unit_bytes, gather_dtype=gather,
                    fp8="torchao" if name in FP8_SYSTEMS else None, fp8_gather=name != "shardplan_fp8c_cast",
                    layout="chunked" if name.startswith("shardplan_chunked") else "auto")
        plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), **opts)
        if name == "shardplan_raf":  # every unit freed after its forward, the last too (FSDP2's default; by
            plan = plan.with_reshard_after_forward(True)  # default the last stays gathered, as in torchtitan)
        with torch.device("meta"):  # the gathers are local at world 1: the bytes they would send at 8 and 64 ranks
            meta = gpt.build(args.config)
        info["planned_bytes"] = {w: {k: v for k, v in sp.plan(meta, [(r".*", sp.P("dp"))], sp.Mesh(dp=w), **opts)
                                     .comm_bytes().items() if k in ("all_gather", "reduce_scatter", "gather_scales",
                                                                      "fp8_amax")}
                                 for w in (8, 64)}
        sp.shard(model, plan, dtensor_params=name == "shardplan_chunked_dt")
        if plan.fp8_modules:
            info["fp8_linears"] = len(plan.fp8_modules)
            info["fp8_warnings"] = [w for w in plan.warnings if w.startswith("fp8")]
        if args.compile:
            sp.compile_units(model)
        info["planned_memory"] = plan.memory().__dict__
        info["units"] = len(plan.units)
        info["notes"] = list(plan.notes)
        info["comm_bytes"] = plan.comm_bytes()["total"]
        info["plan_peak"] = plan.memory().peak
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **ADAMW)
        return model, opt, None, info
    if name == "shardplan_offload":  # CPU offload (--offload): the shardplan system with host optimizer state
        mode, _, frac = args.offload.partition("=")
        budget = None
        if mode in ("auto", "balance") and frac:  # =GIB: the device budget the fraction must fit
            budget = int(float(frac) * 2**30)
        if mode == "auto":  # auto=GIB: the smallest fraction whose plan fits GIB per device
            mode, frac = "optimizer", "auto"
        elif mode != "balance":
            mode, frac = ("optimizer", float(frac)) if mode == "fraction" else (mode, 1.0)

        names = [n for n, _ in model.named_parameters()]

        def offload_plan(m, f, b=None):
            twin, trace = planning_twin(args, world, names)
            return sp.plan(twin, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"layers\.\d+"], compute_dtype=dt,
                           reduce_dtype=torch.float32 if dt else None, prefetch=args.prefetch,
                           min_unit_bytes=args.min_unit_bytes, offload=m, offload_fraction=f, device_memory=b, **trace)

        if mode == "balance":  # balance[=GIB]: measure the host step at full offload, then the balanced fraction
            del model
            at_least = offload_plan("optimizer", "auto", budget).offload_fraction if budget else 0.0
            full = offload_plan("optimizer", 1.0)
            host_s, _ = calibrate(args, dev, world, full)
            # [Note: the window is the backward without offload: measured beside a full-offload host step, the
            # backward itself was slowed by it (3B: 286 against 133 ms), which overstated the window twice over;
            # and a buffer's host step starts only after its reduction, so the first unit's share is lost]
            plain = offload_plan(None, 1.0)
            _, backward_s = calibrate(args, dev, world, plain)
            window_s = backward_s * (1 - 1 / len(plain.units))
            f = full.balanced_offload_fraction(host_s, window_s, at_least)
            info["calibration"] = dict(host_kernel_ms=1e3 * host_s, backward_ms=1e3 * backward_s,
                                       window_ms=1e3 * window_s, fits_at_least=at_least, balanced_fraction=f)
            mode, frac, budget = "optimizer", f, None
            model = build_model(args, dev)
        plan = offload_plan(mode, frac, budget)
        info["offload_fraction"] = plan.offload_fraction
        if plan.activations is not None:  # --trace-plan: the planned peak with the traced activations
            info["plan_peak_traced"] = plan.memory(recompute=args.act_ckpt).peak
        if args.threads:  # the host step's CPU threads (torch's intra-op pool, shared with the main thread)
            torch.set_num_threads(args.threads)
        info["host_rss_before_bytes"] = rss_now()  # Python, torch, CUDA and the model on the device: before offload
        sp.shard(model, plan)
        info.update(planned_memory=plan.memory().__dict__, comm_bytes=plan.comm_bytes()["total"],
                    plan_peak=plan.memory().peak, units=len(plan.units), offload=args.offload,
                    host_copy_bytes=plan.comm_bytes()["copy_d2h"] + plan.comm_bytes()["copy_h2d"])
        return model, sp.offload_optimizer(model, lr=1e-4, overlap_forward=args.overlap_forward), None, info
    if name in ("shardplan_tp", "shardplan_tp_dtensor"):  # FSDP x TP from examples/gpt_rules_tp.py (--tp N)
        plan = sp.plan(model, gpt_rules_tp.rules, sp.Mesh(dp=world // args.tp, tp=args.tp),
                       compute_axes=gpt_rules_tp.compute_axes, units=gpt_rules_tp.UNITS, compute_dtype=dt,
                       reduce_dtype=torch.float32 if dt else None, prefetch=args.prefetch,
                       min_unit_bytes=args.min_unit_bytes)
        force = name == "shardplan_tp_dtensor"  # tp=1 through DTensor anyway (the path tp>1 takes)
        os.environ["SHARDPLAN_SINGLETON_GROUPS"] = "1" if force else "0"
        sp.shard(model, plan)
        info.update(data_index=plan.data_index(dist.get_rank()), data_size=plan.data_size,
                    comm_bytes=plan.comm_bytes()["total"], plan_peak=plan.memory().peak, units=len(plan.units))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **ADAMW)
        return model, opt, None, info
    if name == "functional":  # the same plan through functional_call / value_and_grad / a pure AdamW
        plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"layers\.\d+"], compute_dtype=dt,
                       reduce_dtype=torch.float32 if dt else None, prefetch=args.prefetch,
                       min_unit_bytes=args.min_unit_bytes)
        system = FunctionalSystem(model, plan)
        return system, system, None, info
    if name in ("fsdp2", "fsdp2_fp8"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=torch.float32) if dt else MixedPrecisionPolicy()
        if name == "fsdp2_fp8":  # torchtitan's recipe: tensorwise float8, float8 all-gather, the head left in bf16
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            cfg = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
            convert_to_float8_training(model, config=cfg, module_filter_fn=lambda m, fqn: fqn != "output"
                                       and m.in_features % 16 == 0 and m.out_features % 16 == 0)
        if args.compile:  # per block, before sharding (torchtitan's order)
            for layer in model.layers:
                layer.compile()
        for layer in model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **ADAMW)
        if name == "fsdp2_fp8":  # the next step's weight scales in one all-reduce, after each optimizer step
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
            opt = _AfterStep(opt, lambda: precompute_float8_dynamic_scale_for_fsdp(model))
        return model, opt, None, info
    if name == "megatron":
        from megatron_fsdp import MixedPrecisionPolicy, fully_shard_model, fully_shard_optimizer
        from torch.distributed.device_mesh import init_device_mesh
        if dt:
            model = model.to(dt)
        mesh = init_device_mesh(dev.type, (world, 1), mesh_dim_names=("dp", "tp"))  # Megatron-FSDP wants a TP dim
        wrapped = fully_shard_model(model, device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp", fsdp_unit_modules=[gpt.Block],
                                    zero_dp_strategy=3, mixed_precision_policy=MixedPrecisionPolicy(
                                        main_params_dtype=torch.float32, main_grads_dtype=torch.float32))
        opt = fully_shard_optimizer(torch.optim.AdamW(wrapped.parameters(), lr=1e-4))
        return wrapped, opt, None, info
    raise SystemExit(f"unknown system {name}")


class CapturedSystem:
    """A captured step (``sp.capture``) behind train_step's loop: calling it runs the whole step (forward, backward,
    clipping off, optimizer) as one replay; ``backward``, ``step`` and ``zero_grad`` are inside it."""

    def __init__(self, step, parameters):
        self.step_fn, self.parameters = step, parameters

    def __call__(self, x, y):
        return FunctionalSystem._Loss(self.step_fn(x, y))  # the loss the loop sees: backward() ran inside

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        pass


def captured_system(base, args, dev, world):
    """``base`` (unsharded, shardplan, functional) with its optimizer capturable and its step captured."""
    if dev.type != "cuda":
        raise SkippedSystem(f"{base}_captured: CUDA graphs need a GPU")
    model, opt, ctx, info = make_system(base, args, dev, world)
    lr = torch.tensor(1e-4, device=dev)  # a device tensor: a schedule would update it in place between replays
    if base == "functional":
        system = model
        system.opt = sp.optim.adamw(lr=1e-4, mask=sp.optim.trainable(system.plan), capturable=True)
        system.state = system.opt.init(system.params)

        def fstep(params, state, x, y):
            loss, grads = system.vg(params, x, y)
            params, state = system.opt.update(grads, state, params, donate=True)
            return params, state, loss.detach()
        captured = sp.capture(fstep, donate_argnums=(0, 1))

        def step(x, y):
            system.params, system.state, loss = captured(system.params, system.state, x, y)
            return loss
        return CapturedSystem(step, system.parameters), CapturedSystem(None, None), None, info
    if base not in ("unsharded", "shardplan", "shardplan_compile", "shardplan_offload"):
        raise SystemExit(f"no captured variant of {base}")
    if base != "shardplan_offload":  # (offload: its own optimizer, the host step between the graph's segments)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=True, **ADAMW)
    if ctx is not None:  # autocast's weight-cast cache cannot live across replays
        dt = torch.bfloat16
        ctx = lambda: torch.autocast(dev.type, dtype=dt, cache_enabled=False)  # noqa: E731

    def step(x, y):
        with (ctx() if ctx else _null()):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    captured = sp.capture(step)
    stand_in = CapturedSystem(None, None)
    if base == "shardplan_offload":  # its host steps' statistics, as the eager system reports them
        stand_in.host_stats = opt.host_stats
    return CapturedSystem(captured, model.parameters), stand_in, None, info


def batches(args, dev, index, size, n):
    """Slice ``index`` of ``size`` of every global batch (a rank's data index, not its rank, under TP)."""
    g = torch.Generator().manual_seed(123)
    vocab = gpt.CONFIGS[args.config].vocab
    per = args.batch // size
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
        x = x[index * per:(index + 1) * per]
        out.append((x[:, :-1].to(dev), x[:, 1:].to(dev)))
    return out


class FunctionalSystem:
    """The functional face behind train_step's loop: calling it runs forward and backward
    (value_and_grad), ``step()`` applies the pure optimizer."""

    class _Loss:
        def __init__(self, value):
            self.value = value

        def backward(self):
            pass

        def detach(self):
            return self.value

    def __init__(self, model, plan):
        self.model, self.plan = model, plan
        self.params = sp.shard_tree(dict(model.named_parameters()), plan)
        meta_params(model)  # the functional face computes with the tree: the module's own copy is not used
        self.opt = sp.optim.adamw(lr=1e-4, mask=sp.optim.trainable(plan))
        self.state = self.opt.init(self.params)
        self.vg = sp.value_and_grad(lambda p, x, y: sp.functional_call(model, plan, p, (x, y)), plan)
        self.grads = None
        self.parameters = model.parameters  # for the parameter count only (meta tensors)

    def __call__(self, x, y):
        loss, self.grads = self.vg(self.params, x, y)
        return self._Loss(loss)

    def step(self):  # donated: params and moments updated in place, as shard()'s torch optimizer does
        self.params, self.state = self.opt.update(self.grads, self.state, self.params, donate=True)

    def zero_grad(self, set_to_none=True):
        self.grads = None


def run_steps(model, opt, ctx, data, dev, breakdown=False):
    times, losses, parts = [], [], []
    for x, y in data:
        sync(dev)
        t0, c0 = time.perf_counter(), time.thread_time()
        with (ctx() if ctx else _null()):
            loss = model(x, y)
        sync(dev) if breakdown else None
        t1 = time.perf_counter()
        loss.backward()
        sync(dev) if breakdown else None
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        c3 = time.thread_time()  # the host's CPU time issuing the step (before waiting for the device)
        sync(dev)
        t3 = time.perf_counter()
        times.append(t3 - t0)
        parts.append((t1 - t0, t2 - t1, t3 - t2, c3 - c0))
        losses.append(loss.detach().float().item())
    # the world mean: every system's losses cover the whole batch (TP ranks of one data slice agree)
    mean = torch.tensor(losses, dtype=torch.float64, device=dev)
    dist.all_reduce(mean)
    return times, (mean / dist.get_world_size()).tolist(), parts


def memory_phases(model, opt, ctx, batch, dev):
    """One more (untimed) step, measuring GPU memory by phase: allocated at its start, and the peak of the
    forward, the backward and the optimizer step (each from a reset), in bytes. Where a system's peak comes from."""
    x, y = batch
    out = {"start": torch.cuda.memory_allocated()}
    torch.cuda.reset_peak_memory_stats()
    with (ctx() if ctx else _null()):
        loss = model(x, y)
    sync(dev)
    out["forward_peak"], out["after_forward"] = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    sync(dev)
    out["backward_peak"], out["after_backward"] = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(dev)
    out["optimizer_peak"], out["end"] = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (profile_step.py takes its defaults from here)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--systems", default="unsharded,shardplan,functional,fsdp2,megatron")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--min-unit-bytes", type=int, default=None,
                    help="shardplan: merge neighbouring blocks up to this size (default: the planner chooses; 0: never)")
    ap.add_argument("--tp", type=int, default=1, help="shardplan_tp: size of the tensor-parallel axis")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--mem-phases", action="store_true",
                    help="GPU: one more untimed step per system measuring memory by phase (memory_phases in the JSON)")
    ap.add_argument("--offload", default="optimizer", metavar="optimizer|params|fraction=F|auto=GIB|balance[=GIB]",
                    help="the shardplan_offload system's plan(offload=...): optimizer state on the host, parameters too, "
                         "or that fraction of the optimizer state, or the smallest fraction fitting GIB per device, or "
                         "the fraction whose host step (measured at full offload) fits the backward "
                         "(plan.balanced_offload_fraction; not below the one fitting GIB); "
                         "reports host step time (host_step_ms) and how much of it backward hid")
    ap.add_argument("--act-ckpt", action="store_true", help="activation checkpointing of every block (all systems)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile every block: shardplan systems via sp.compile_units, FSDP2 ones per layer "
                         "before fully_shard (torchao's float8 casts are slow uncompiled)")
    ap.add_argument("--trace-plan", action="store_true",
                    help="shardplan_offload: plan on a meta twin traced on one batch "
                         "(plan_peak_traced: with activations)")
    ap.add_argument("--overlap-forward", action="store_true",
                    help="shardplan_offload: host steps also overlap the next forward (offload_optimizer(overlap_forward=True))")
    ap.add_argument("--threads", type=int, default=0, help="shardplan_offload: torch.set_num_threads for its run")
    ap.add_argument("--forecast", default="", metavar="NETWORK:DP",
                    help="also forecast the same job without offload on DP GPUs of NETWORK (e.g. h200-8x-ib400:8): "
                         "the same batch per GPU, its step time and tokens/s per GPU reported beside the measured ones")
    ap.add_argument("--adamw", choices=("foreach", "fused"), default="foreach",
                    help="torch AdamW's implementation, for every system that uses it (eager and captured)")
    ap.add_argument("--out", default=None)
    return ap


def main():
    args = parser().parse_args()
    ADAMW.clear()
    ADAMW[args.adamw] = True
    cuda, dev = start_world()
    rank, world = dist.get_rank(), dist.get_world_size()
    systems = [s for s in args.systems.split(",") if s]
    if not cuda:
        systems = [s for s in systems if s != "megatron"]  # Megatron-FSDP needs CUDA
    if world > 1:
        systems = [s for s in systems if s != "unsharded"]
    data = batches(args, dev, rank, world, args.warmup + args.steps)
    assert world % args.tp == 0, f"--tp {args.tp} must divide the world size {world}"
    results = {s: {"times": [], "losses": None, "peak": [], "parts": [], "error": None} for s in systems}
    for r in range(args.rounds):
        for s in systems:
            if results[s]["error"]:
                continue
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                model, opt, ctx, info = make_system(s, args, dev, world)
                if cuda and s.startswith("shardplan_offload"):  # its peak: training only (set-up builds the model unsharded)
                    torch.cuda.reset_peak_memory_stats()
                if s == "shardplan":
                    eng = sp.runtime.engine_of(model)
                    eng.hook_seconds = eng.backward_seconds = 0.0
                steps = data
                if info.get("data_size", world) != world:
                    steps = batches(args, dev, info["data_index"], info["data_size"], len(data))
                if s.startswith("shardplan_offload"):
                    opt.host_stats(reset=True)
                times, losses, parts = run_steps(model, opt, ctx, steps, dev, args.breakdown)
                if s.startswith("shardplan_offload"):  # the host AdamW: its time per step and how much backward hid
                    hs, n = opt.host_stats(), len(steps)
                    info.update(host_step_ms=1000 * hs["host_step_s"] / n, host_exposed_ms=1000 * hs["exposed_s"] / n,
                                host_kernel_ms=1000 * hs["kernel_s"] / n, host_threads=hs["threads"],
                                host_hidden_fraction=hs["hidden_s"] / hs["host_step_s"] if hs["host_step_s"] else None,
                                host_steps_overlapped=f"{hs['overlapped']}/{hs['steps']}")
                if s == "shardplan":  # the runtime's CPU time per unit and step: forward hooks, backward hooks
                    eng = sp.runtime.engine_of(model)
                    per = 1e6 / len(times) / info["units"]
                    info["hook_us_per_unit"] = (eng.hook_seconds + eng.backward_seconds) * per
                    info["forward_hook_us_per_unit"] = eng.hook_seconds * per
                    info["backward_hook_us_per_unit"] = eng.backward_seconds * per
                    # the definition of earlier results: forward hooks only, per block (not per merged unit)
                    info["forward_hook_us_per_block"] = 1e6 * eng.hook_seconds / len(times) / (
                        gpt.CONFIGS[args.config].layers + 1)
            except SkippedSystem as exc:
                results[s]["error"] = str(exc)[:500]
                if rank == 0:
                    print(f"{s}: {exc}")
                model = opt = None
                continue
            except Exception as exc:  # noqa: BLE001 - recorded, the other systems still run
                results[s]["error"] = f"{type(exc).__name__}: {exc}"[:500]
                model = opt = None  # (an out-of-memory system must not keep its tensors from the next one)
                continue
            res = results[s]
            res["times"] += times[args.warmup:]
            res["parts"] += parts[args.warmup:]
            res["losses"] = res["losses"] or losses
            res.update(info)
            if s == "shardplan_offload":  # the process's peak resident host memory (Linux: KiB), and its parts
                import resource
                res["host_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                res["host_rss_end_bytes"] = rss_now()
                # what shardplan allocated on the host (its slabs and step counts): the figure the plan states
                res["shardplan_host_bytes"] = sp.runtime.engine_of(model).offload.host_bytes()
            if cuda:
                res["peak"].append(torch.cuda.max_memory_allocated())
                # the same peak in the bytes tensors asked for (no allocator rounding): a difference of a few MiB
                # between systems that is in peak_bytes only is the allocator's, not a tensor's
                res.setdefault("requested", []).append(torch.cuda.memory_stats()["requested_bytes.all.peak"])
                if args.mem_phases:  # after the peak is read: this step resets it per phase
                    res.setdefault("memory_phases", []).append(memory_phases(model, opt, ctx, data[0], dev))
            elif s in SHARDPLAN_SYSTEMS + ("shardplan_offload",):  # CPU: the runtime's own accounting, one step untimed
                sp.reset_peak(model)  # (it costs a pass over every tensor per op while on)
                run_steps(model, opt, ctx, data[:1], dev)
                res["peak"].append(sp.memory_stats(model)["peak"])
            # [Note: `eng` too: the engine holds the model's shards (a 1B model's fp32, 3.57 GiB); left bound
            # here it kept them alive into the next systems' peaks (+3.57 GiB on functional and FSDP2)]
            model = opt = eng = None
    with torch.device("meta"):
        n_params = sum(p.numel() for p in gpt.build(args.config).parameters())
    summary = {"config": args.config, "params": n_params, "world": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
               "torch": torch.__version__, "dtype": args.dtype or "fp32", "batch": args.batch, "seq": args.seq,
               "prefetch": args.prefetch, "tp": args.tp, "min_unit_bytes": args.min_unit_bytes, "systems": {}}
    if args.forecast:  # the same job without offload on more GPUs (shardplan.forecast: plan on the meta device)
        network, _, n = args.forecast.rpartition(":")
        twin = planning_twin(args, world)[0]
        dt = torch.bfloat16 if args.dtype == "bf16" else None
        fplan = sp.plan(twin, [(r".*", sp.P("dp"))], sp.Mesh(dp=int(n)), units=[r"layers\.\d+"], compute_dtype=dt,
                        reduce_dtype=torch.float32 if dt else None, prefetch=args.prefetch,
                        min_unit_bytes=args.min_unit_bytes)
        f = fplan.forecast(network, batch=(args.batch // world, args.seq))  # the same batch per GPU
        summary["forecast"] = dict(network=network, gpus=int(n), step_ms=1e3 * f.step_s, tokens_per_s=f.tokens_per_s,
                                   tokens_per_s_per_gpu=f.tokens_per_s / int(n), plan_peak=fplan.memory().peak)
    for s, res in results.items():
        if res["error"]:
            summary["systems"][s] = {"error": res["error"]}
            continue
        entry = {"median_step_ms": 1000 * statistics.median(res["times"]),
                 # the least over rounds: a system that leaves memory behind must not inflate the next one
                 "peak_bytes": min(res["peak"]) if res["peak"] else None,
                 "peak_requested_bytes": min(res["requested"]) if res.get("requested") else None,
                 "first_losses": res["losses"][:3], "last_loss": res["losses"][-1], "steps_timed": len(res["times"])}
        if args.breakdown:
            entry["forward_ms"] = 1000 * statistics.median(p[0] for p in res["parts"])
            entry["backward_ms"] = 1000 * statistics.median(p[1] for p in res["parts"])
            entry["optimizer_ms"] = 1000 * statistics.median(p[2] for p in res["parts"])
        if res["parts"]:  # the host's CPU time per step (thread time until the step is issued)
            entry["host_cpu_ms"] = 1000 * statistics.median(p[3] for p in res["parts"])
        for k in ("comm_bytes", "plan_peak", "planned_memory", "hook_us_per_unit", "forward_hook_us_per_unit",
                  "backward_hook_us_per_unit", "forward_hook_us_per_block", "units", "notes", "data_size",
                  "offload", "offload_fraction", "host_copy_bytes", "host_rss_bytes", "host_rss_end_bytes",
                  "host_rss_before_bytes", "shardplan_host_bytes", "host_step_ms",
                  "host_exposed_ms", "host_hidden_fraction", "host_steps_overlapped", "host_kernel_ms", "host_threads",
                  "calibration", "plan_peak_traced", "memory_phases", "planned_bytes", "fp8_linears", "fp8_warnings"):
            if k in res:
                entry[k] = res[k]
        summary["systems"][s] = entry
    ok = {s: e for s, e in summary["systems"].items() if "error" not in e}
    ref = next(iter(ok.values()))["first_losses"][0] if ok else None
    tol = 3e-2 if args.dtype else 1e-4
    # quantized gathers and FP8 compute: within their documented tolerance
    quantized = ("shardplan_int8", "shardplan_fp8", "shardplan_int8_qg") + FP8_SYSTEMS
    summary["losses_agree"] = all(abs(e["first_losses"][0] - ref) <= (3e-2 if s in quantized else tol) * max(1.0, abs(ref))
                                  for s, e in ok.items())
    if "shardplan" in ok:  # the loss after the run's steps against unquantized gathers (docs/low_precision.md)
        summary["last_loss_vs_shardplan"] = {s: ok[s]["last_loss"] - ok["shardplan"]["last_loss"] for s in quantized
                                             if s in ok}
    summary["ratios"] = {f"{a}/{b}": ok[a]["median_step_ms"] / ok[b]["median_step_ms"] for a in ok for b in ok if a != b}
    n_units = gpt.CONFIGS[args.config].layers + 1
    if "unsharded" in ok:
        summary["overhead_us_per_unit"] = {s: 1000 * (e["median_step_ms"] - ok["unsharded"]["median_step_ms"]) / n_units
                                           for s, e in ok.items() if s != "unsharded"}
    if rank == 0:
        print(f"{args.config} ({n_params / 1e6:.0f}M params), world {world}, {summary['device']}, {summary['dtype']}, "
              f"batch {args.batch}x{args.seq}")
        parts = f" {'fwd ms':>8} {'bwd ms':>8} {'opt ms':>8}" if args.breakdown else ""
        print(f"{'system':<20} {'step ms':>9} {'peak GiB':>9} {'loss[0]':>9}{parts} {'hook us/unit':>12}")
        for s, e in summary["systems"].items():
            if "error" in e:
                print(f"{s:<20} error: {e['error'][:200]}")
                continue
            peak = f"{e['peak_bytes'] / 2**30:.2f}" if e["peak_bytes"] else "-"
            row = f"{s:<20} {e['median_step_ms']:>9.1f} {peak:>9} {e['first_losses'][0]:>9.4f}"
            if args.breakdown:
                row += f" {e['forward_ms']:>8.1f} {e['backward_ms']:>8.1f} {e['optimizer_ms']:>8.1f}"
            hook = e.get("hook_us_per_unit")
            print(row + (f" {hook:>12.0f}" if hook is not None else f" {'-':>12}"))
            if "host_step_ms" in e:  # CPU offload: the host AdamW per step, and what backward hid of it
                hidden = e["host_hidden_fraction"]
                print(f"  {'':<18} host step {e['host_step_ms']:.1f} ms/step, exposed {e['host_exposed_ms']:.1f} ms "
                      f"({'-' if hidden is None else f'{100 * hidden:.0f}%'} hidden; buffer steps overlapped "
                      f"{e['host_steps_overlapped']}), AdamW kernels {e.get('host_kernel_ms', 0):.1f} ms on "
                      f"{e.get('host_threads')} threads, offload_fraction {e.get('offload_fraction')}")
                # [Note: host memory] what the plan states is shardplan's own host tensors (pinned slabs on a GPU);
                # the process's RSS adds what was resident before sp.shard (Python, torch, the CUDA context and
                # libraries) and the rest (allocator caches, a calibration run's leftovers in --offload balance)
                gib, pm = 2**30, e["planned_memory"]
                sp_host, before, peak = (e.get(k, 0) or 0 for k in ("shardplan_host_bytes", "host_rss_before_bytes",
                                                                     "host_rss_bytes"))
                print(f"  {'':<18} host: shardplan's tensors {sp_host / gib:.2f} GiB (plan: {pm['host'] / gib:.2f} GiB "
                      f"of tensors, {pm.get('host_pinned', 0) / gib:.2f} GiB pinned); process RSS peak "
                      f"{peak / gib:.2f} GiB = before sp.shard {before / gib:.2f} + shardplan {sp_host / gib:.2f} + "
                      f"other {(peak - before - sp_host) / gib:.2f} GiB (now {e.get('host_rss_end_bytes', 0) / gib:.2f})")
                if "plan_peak_traced" in e and e["peak_bytes"]:
                    print(f"  {'':<18} device peak {e['peak_bytes'] / 2**30:.2f} GiB vs plan (traced) "
                          f"{e['plan_peak_traced'] / 2**30:.2f} GiB ({e['peak_bytes'] / e['plan_peak_traced']:.3f}x)")
                if "calibration" in e:
                    print(f"  {'':<18} balance: {e['calibration']}")
        if "forecast" in summary:
            fc = summary["forecast"]
            mine = {s: args.batch * args.seq / (e["median_step_ms"] / 1e3) / world for s, e in ok.items()}
            print(f"  forecast without offload on {fc['gpus']} GPUs ({fc['network']}, "
                  f"{args.batch // world}x{args.seq} per GPU): "
                  f"{fc['step_ms']:.1f} ms/step, {fc['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU (measured here: "
                  + ", ".join(f"{s} {v:,.0f}" for s, v in mine.items()) + ")")
        for k, v in summary["ratios"].items():
            print(f"  {k}: {v:.3f}")
        print("losses agree:", summary["losses_agree"])
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
