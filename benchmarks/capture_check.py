"""GPU checks and timings of ``shardplan.capture`` (one GPU, NCCL world 1): replayed steps against eager steps,
bit for bit, then step times of eager and captured systems side by side.

    NCCL_NVLS_ENABLE=0 python benchmarks/capture_check.py --parity --out capture_parity.json
    NCCL_NVLS_ENABLE=0 python benchmarks/capture_check.py --time --config tiny200 --batch 1 --seq 128 --out t.json

Parity: every case trains the same GPT from the same weights on the same batches, once eagerly and once through
``sp.capture`` (2 eager warm-up steps, the capture, replays), with AdamW(capturable=True), a warm-up + cosine
schedule through ``sp.optim.as_lr_scheduler`` (a tensor lr updated in place), clipping and, where said, two
accumulated micro-batches; the losses of every step and the final parameters must be equal bit for bit.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
import gpt  # noqa: E402

import shardplan as sp  # noqa: E402
sys.path.insert(0, HERE)
from _report import meta_params, top_kernels  # noqa: E402
import _memsnap  # noqa: E402
import contextlib  # noqa: E402


def start():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))


class HFCausalLM(torch.nn.Module):
    """A Hugging Face LlamaForCausalLM (Llama-3.2-1B shapes, 1.24B parameters) behind the GPT's ``model(x, y)``."""

    def __init__(self, tiny=False):
        super().__init__()
        import transformers
        from forecast_gpu import _llama_3_2_1b
        self.config = _llama_3_2_1b(tiny)
        self.hf = transformers.LlamaForCausalLM(self.config)
        from shardplan.hf import capturable_attention
        capturable_attention(self.hf)  # the same attention kernel captured as eager (transformers < 5.18)
        self.layers = self.hf.model.layers

    def forward(self, x, y):
        return self.hf(input_ids=x, labels=y).loss


UNITS = {"hf_llama": r"hf\.model\.layers\.\d+", "hf_llama_tiny": r"hf\.model\.layers\.\d+"}


def vocab_of(config):
    if config.startswith("hf_llama"):
        from forecast_gpu import _llama_3_2_1b
        return _llama_3_2_1b(config == "hf_llama_tiny").vocab_size
    return gpt.CONFIGS[config].vocab


def build(config, dev, seed=0):
    if config.startswith("hf_llama"):  # built on the device by its own init: its buffers (RoPE's inv_freq) need values
        torch.manual_seed(seed)
        with torch.device(dev):
            return HFCausalLM(tiny=config == "hf_llama_tiny")
    with torch.device("meta"):
        model = gpt.build(config)
    model.to_empty(device=dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=g)
    return model


def data(config, batch, seq, n, dev, micro=1):
    g = torch.Generator().manual_seed(123)
    V = vocab_of(config)
    out = []
    for _ in range(n):
        t = torch.randint(0, V, (micro, batch, seq + 1), generator=g)
        out.append((t[..., :-1].to(dev), t[..., 1:].to(dev)))
    return out


def system(face, config, dev, dtype, act_ckpt=False, units=None, min_unit_bytes=None, start=0, gather=None,
           fp8=False, strategy=3, offload=None, fraction=1.0, clip=True):
    """``(step_fn(x, y) -> loss, params_fn() -> {name: tensor})``: one training step of ``face``."""
    model = build(config, dev)
    units = units or UNITS.get(config, r"layers\.\d+")
    dt = torch.bfloat16 if dtype == "bf16" else None
    red = torch.float32 if dt else None
    if act_ckpt:
        from torch.utils.checkpoint import checkpoint
        for layer in model.layers:
            layer.forward = lambda *a, _f=layer.forward: checkpoint(_f, *a, use_reentrant=False)
    sched = sp.optim.warmup_cosine(1e-3, warmup=5, total=40, end=1e-4)
    if face in ("shard", "fully_shard", "unsharded"):
        if face == "shard":
            plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=1), units=[units], compute_dtype=dt,
                           reduce_dtype=red, min_unit_bytes=min_unit_bytes, gather_dtype=gather,
                           fp8="torchao" if fp8 else None, strategy=strategy, offload=offload,
                           offload_fraction=fraction)
            sp.shard(model, plan)
        elif face == "fully_shard":
            mp = sp.MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=red) if dt else sp.MixedPrecisionPolicy()
            for layer in model.layers:  # strategy 2: the gathered parameters stay between forward and backward
                sp.fully_shard(layer, mp_policy=mp, reshard_after_forward=strategy == 3)
            sp.fully_shard(model, mp_policy=mp, reshard_after_forward=strategy == 3)
        if offload:  # the host optimizer (clipping inside it: its host steps overlap the backward eagerly), its
            # learning rate a Python number the host step reads at every replay
            # (without clipping, a replay's host step overlaps the graph's backward: [Note: the replay's host step
            # overlaps], runtime/offload/steps.py)
            opt = sp.offload_optimizer(model, lr=float(sched(start)), weight_decay=0.1,
                                       max_grad_norm=1.0 if clip else None)
            count = [start]

            class lr_sched:  # noqa: N801
                @staticmethod
                def step():
                    count[0] += 1
                    opt.param_groups[0]["lr"] = float(sched(count[0]))
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device=dev), capturable=True,
                                    foreach=True, weight_decay=0.1)
            lr_sched = sp.optim.as_lr_scheduler(opt, sched, step=start)
        ctx = (lambda: torch.autocast("cuda", dtype=dt, cache_enabled=False)) if (dt and face == "unsharded") else None

        def step(x, y):
            for i in range(x.shape[0]):  # micro-batches: gradients accumulate, synchronised on the last
                last = i == x.shape[0] - 1
                sync = sp.no_sync(model) if (not last and face == "shard") else _null()
                with sync:  # (backward inside no_sync: it is the backward that skips the reduction)
                    with (ctx() if ctx else _null()):
                        loss = model(x[i], y[i]) / x.shape[0]
                    loss.backward()
            if offload:
                pass  # the offloading optimizer clips (max_grad_norm=1.0)
            elif face == "shard":
                sp.clip_grad_norm_(model, 1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        step.opt = opt

        def after():
            lr_sched.step()

        def params():
            if face == "unsharded":
                return {n: p.detach().clone() for n, p in model.named_parameters()}
            return {n: p.detach().clone() for n, p in sp.checkpoint.full_state_dict(model, cpu=False).items()}
        return step, after, params, model
    if face == "functional":
        plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=1), units=[units], compute_dtype=dt, reduce_dtype=red,
                       min_unit_bytes=min_unit_bytes, strategy=strategy)
        params = sp.shard_tree(dict(model.named_parameters()), plan)
        meta_params(model)  # the tree holds the parameters now: the module's own copy would only add memory
        opt = sp.optim.adamw(lr=sched, weight_decay=0.1, mask=sp.optim.trainable(plan), capturable=True)
        state = opt.init(params)
        vg = sp.value_and_grad(lambda p, x, y: sp.functional_call(model, plan, p, (x, y)), plan)
        box = {"params": params, "state": state}
        box["eval"] = lambda x, y: sp.functional_call(model, plan, box["params"], (x, y))  # (no gradient)

        def fstep(params, state, x, y):
            loss, grads = vg(params, x[0], y[0])
            grads, _ = sp.optim.clip_by_global_norm(grads, 1.0, plan, donate=True)
            params, state = opt.update(grads, state, params, donate=True)
            return params, state, loss.detach()

        def step(x, y):
            return fstep(box["params"], box["state"], x, y)

        def params_fn():
            return {n: p.detach().clone() for n, p in box["params"].items()}
        return (fstep, box), None, params_fn, model
    raise SystemExit(face)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


SEGMENTS: list = []  # the last captured run's graph segments per signature


def train(face, config, dev, dtype, batches, captured, evals=False, save=None, load=None, **kw):
    """Losses, final parameters and replays of ``batches`` trained eagerly or captured; ``evals``: a no-grad
    forward after every step (its loss recorded too; ``"captured"``: an evaluation step captured beside the
    training step when it is captured); ``save``/``load``: a checkpoint after the last step / before the first
    (module faces)."""
    gc.collect()  # the previous run's model, optimizer and graph pool (held in reference cycles)
    torch.cuda.empty_cache()
    step, after, params, model = system(face, config, dev, dtype, **kw)
    losses = []
    if load:
        _load(load, model, step)
    if face == "functional":
        fstep, box = step
        f = sp.capture(fstep, donate_argnums=(0, 1)) if captured else fstep
        for x, y in batches:
            box["params"], box["state"], loss = f(box["params"], box["state"], x, y)
            losses.append(loss.float().item())
            if evals:
                with torch.no_grad():
                    losses.append(box["eval"](x[0], y[0]).float().item())
    else:
        f = sp.capture(step) if captured else step

        def evaluate(x, y):
            with torch.no_grad():
                return model(x, y).detach()
        ev = sp.capture(evaluate) if (captured and evals == "captured") else evaluate
        for x, y in batches:
            loss = f(x, y)
            losses.append(loss.float().item())
            after()
            if evals:
                losses.append(ev(x[0], y[0]).float().item())
        if save:
            sp.checkpoint.save(save, model, step.opt, step=len(batches))
    torch.cuda.synchronize()
    if captured:  # graphs of the captured program (2 with an offloaded optimizer: its host step between them)
        SEGMENTS[:] = [getattr(g.graph, "segments", 1) for g in f.graphs.values() if g.graph is not None]
    return losses, params(), (f.replays if captured else 0)


def _load(path, model, step):
    sp.checkpoint.load(path, model, step.opt)


def parity(args, dev):
    if args.cases.startswith("big"):  # the models: each captured with accumulation, clipping, the schedule
        cases = [dict(face="shard", dtype=dt, micro=2) for dt in ("bf16", "fp32") if args.cases in ("big", f"big_{dt}")]
        return _parity_cases(args, dev, cases)
    cases = []
    for face in ("shard", "fully_shard", "functional", "unsharded"):
        for dtype in ("fp32", "bf16"):
            cases.append(dict(face=face, dtype=dtype, micro=1))
    cases += [dict(face="shard", dtype="bf16", micro=2), dict(face="shard", dtype="bf16", micro=1, act_ckpt=True),
              dict(face="shard", dtype="fp32", micro=1, singleton=True)]
    # an evaluation forward after every step (before the capture and between replays): under ZeRO-1/2 the gathered
    # parameters stay between steps, and the host's bookkeeping must know a replay left the shards stale
    cases += [dict(face="shard", dtype="bf16", micro=1, evals=True, strategy=s) for s in (1, 2)]
    cases += [dict(face="fully_shard", dtype="bf16", micro=1, evals=True, strategy=2),
              dict(face="functional", dtype="bf16", micro=1, evals=True, strategy=2),
              dict(face="shard", dtype="bf16", micro=1, evals="captured", strategy=2)]
    cases += [dict(face="shard", dtype="bf16", micro=1, evals=True), dict(face="shard", dtype="fp32", micro=1, resume=True),
              dict(face="shard", dtype="bf16", micro=1, gather="int8"), dict(face="shard", dtype="bf16", micro=1, fp8=True),
              dict(face="shard", dtype="bf16", micro=1, gather="int8", nan=True)]
    # CPU offload: the host step between the graph's two segments ([Note: a step in segments])
    cases += [dict(face="shard", dtype="bf16", micro=2, offload="optimizer"),
              dict(face="shard", dtype="fp32", micro=1, offload="optimizer", strategy=1, evals=True),
              dict(face="shard", dtype="bf16", micro=1, offload="optimizer", fraction=0.5, strategy=2),
              dict(face="shard", dtype="bf16", micro=1, offload="params"),
              dict(face="shard", dtype="bf16", micro=2, offload="optimizer", clip=False),
              dict(face="shard", dtype="bf16", micro=1, offload="params", clip=False, strategy=3),
              dict(face="shard", dtype="fp32", micro=1, offload="optimizer", resume=True)]
    if args.cases == "offload":
        cases = [c for c in cases if c.get("offload")]
    return _parity_cases(args, dev, cases)


def _parity_cases(args, dev, cases):
    out = []
    for c in cases:
        os.environ["SHARDPLAN_SINGLETON_GROUPS"] = "1" if c.get("singleton") else "0"
        rec = dict(c, config=args.config)
        try:
            batches = data(args.config, args.batch, args.seq, args.steps, dev, c["micro"])
            kw = dict(act_ckpt=c.get("act_ckpt", False), evals=c.get("evals", False), gather=c.get("gather"),
                      fp8=c.get("fp8", False), strategy=c.get("strategy", 3), offload=c.get("offload"),
                      fraction=c.get("fraction", 1.0), clip=c.get("clip", True))
            if c.get("nan"):  # a NaN put in a weight between replays: a later call raises naming it
                step, after, params, model = system(c["face"], args.config, dev, c["dtype"], gather=c["gather"])
                f = sp.capture(step)
                rec["steps_before_error"] = 0
                try:
                    for i, (x, y) in enumerate(batches):
                        if i == 5:
                            with torch.no_grad():
                                next(iter(model.parameters())).view(-1)[0] = float("nan")
                        f(x, y)
                        rec["steps_before_error"] = i + 1
                except sp.ShardingError as exc:
                    rec["error_raised"] = str(exc)[:300]
                out.append(rec)
                print(json.dumps(rec), flush=True)
                continue
            if c.get("resume"):  # a checkpoint written between replays resumes eagerly, and the other way round
                import tempfile
                d = tempfile.mkdtemp()
                half = len(batches) // 2
                le, pe, _ = train(c["face"], args.config, dev, c["dtype"], batches, False, **kw)
                lc, _, _ = train(c["face"], args.config, dev, c["dtype"], batches[:half], True, save=f"{d}/c", **kw)
                l2, pc, _ = train(c["face"], args.config, dev, c["dtype"], batches[half:], False, load=f"{d}/c",
                                  start=half, **kw)
                l3, _, _ = train(c["face"], args.config, dev, c["dtype"], batches[:half], False, save=f"{d}/e", **kw)
                l4, p4, replays = train(c["face"], args.config, dev, c["dtype"], batches[half:], True, load=f"{d}/e",
                                        start=half, **kw)
                rec["eager_resumes_captured"] = (lc + l2 == le) and all(torch.equal(pe[n], pc[n]) for n in pe)
                rec["captured_resumes_eager"] = (l3 + l4 == le) and all(torch.equal(pe[n], p4[n]) for n in pe)
                lc, pc = lc + l2, pc
            else:
                le, pe, _ = train(c["face"], args.config, dev, c["dtype"], batches, False, **kw)
                lc, pc, replays = train(c["face"], args.config, dev, c["dtype"], batches, True, **kw)
                if args.control:  # eager twice: is the eager step itself repeatable on this GPU?
                    l2, p2, _ = train(c["face"], args.config, dev, c["dtype"], batches, False, **kw)
                    rec["eager_repeatable"] = l2 == le and all(torch.equal(pe[n], p2[n]) for n in pe)
                    rec["eager_vs_eager_max_diff"] = max(float((pe[n].float() - p2[n].float()).abs().max()) for n in pe)
            rec.update(losses_equal=le == lc, params_equal=all(torch.equal(pe[n], pc[n]) for n in pe),
                       max_param_diff=max(float((pe[n].float() - pc[n].float()).abs().max()) for n in pe),
                       first_losses=le[:3], last_loss_eager=le[-1], last_loss_captured=lc[-1], replays=replays,
                       segments=list(SEGMENTS))
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            rec["traceback"] = traceback.format_exc()[-3000:]
        print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
        if "traceback" in rec:
            print(rec["traceback"], flush=True)
        out.append(rec)
        torch.cuda.empty_cache()
    return out


def _time_system(name, args, dev, out):
    """One system of ``timing``, alone: its model, optimizer and graph are this function's locals, so none of
    them is alive (counted in the next system's peak) once it returns and the caller collects."""
    os.environ["SHARDPLAN_SINGLETON_GROUPS"] = "0"
    face, _, mode = name.partition("_")
    captured = mode == "captured"
    rec = _memsnap.recording() if args.snapshot else contextlib.nullcontext()
    try:
        rec.__enter__()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start_gib = torch.cuda.memory_allocated() / 2**30  # what an earlier system left (should be ~0)
        batches = data(args.config, args.batch, args.seq, 1, dev)
        x, y = batches[0]
        if face == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            model = build(args.config, dev)
            dt = torch.bfloat16 if args.dtype == "bf16" else None
            mp = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=torch.float32) if dt else MixedPrecisionPolicy()
            if mode == "compile":
                for layer in model.layers:
                    layer.compile()
            for layer in model.layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

            def f(x, y):
                loss = model(x[0], y[0])
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss.detach()
        elif face == "functional":
            (fstep, box), _, _, _ = system(face, args.config, dev, args.dtype)
            g = sp.capture(fstep, donate_argnums=(0, 1)) if captured else fstep

            def f(x, y, g=g, box=box):
                box["params"], box["state"], loss = g(box["params"], box["state"], x, y)
                return loss
        else:
            step, _, _, _ = system(face, args.config, dev, args.dtype)
            f = sp.capture(step) if captured else step
        for _ in range(args.warmup):
            f(x, y)
        torch.cuda.synchronize()
        times, cpu = [], []
        for _ in range(args.rounds):
            torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(args.steps):
                f(x, y)
            c1 = time.thread_time()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / args.steps)
            cpu.append((c1 - c0) / args.steps)
        out[name] = dict(step_ms=1e3 * statistics.median(times), host_cpu_ms=1e3 * statistics.median(cpu),
                         peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                         peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30, start_gib=start_gib)
        if args.snapshot:  # what is live at this system's peak, by allocation site
            out[name]["live_at_peak"] = _memsnap.live_at_peak(torch.cuda.memory._snapshot(), top=15)
        if args.kernels:
            out[name]["kernels"] = top_kernels(lambda: f(x, y))
        if captured:
            out[name]["replay_host_us"] = 1e6 * getattr(f, "host_seconds", 0) / max(getattr(f, "replays", 1), 1)
            idle = []  # a call with the GPU idle: the host's own work (back to back, a launch waits for the queue)
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                f(x, y)
                idle.append(time.perf_counter() - t0)
            out[name]["idle_call_ms"] = 1e3 * statistics.median(idle)
    except Exception as exc:  # noqa: BLE001
        out[name] = dict(error=f"{type(exc).__name__}: {exc}"[:1500], traceback=traceback.format_exc()[-2500:])
    finally:
        rec.__exit__(None, None, None)
    print(name, json.dumps({k: v for k, v in out[name].items() if k != "traceback"}), flush=True)
    if "traceback" in out[name]:
        print(out[name]["traceback"], flush=True)


def timing(args, dev):
    out = {}
    systems = args.systems.split(",")
    for name in systems:
        _time_system(name, args, dev, out)
        gc.collect()  # this system's model, optimizer and graph pool (reference cycles) before the next one's peak
        torch.cuda.empty_cache()
        out[name]["base_gib"] = torch.cuda.memory_allocated() / 2**30  # left after it: should be ~0
    for a, b in (("functional", "shard"), ("functional_captured", "shard_captured")):
        if "live_at_peak" in out.get(a, {}) and "live_at_peak" in out.get(b, {}):
            out[f"peak_diff_{a}_vs_{b}"] = _memsnap.diff(out[a]["live_at_peak"], out[b]["live_at_peak"])
    base = out.get("unsharded", {}).get("step_ms")
    for k, v in out.items():
        if base and "step_ms" in v:
            v["x_unsharded"] = v["step_ms"] / base
        if out.get("fsdp2", {}).get("step_ms") and "step_ms" in v:
            v["x_fsdp2"] = v["step_ms"] / out["fsdp2"]["step_ms"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parity", action="store_true")
    ap.add_argument("--control", action="store_true", help="parity: also train eagerly twice (repeatability)")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True) (CUBLAS_WORKSPACE_CONFIG=:4096:8)")
    ap.add_argument("--cases", default="all",
                    help="all (every face and feature) | big (accumulation, bf16 and fp32) | big_bf16 | big_fp32 | offload")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--config", default="small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", default="unsharded,unsharded_captured,shard,shard_captured,functional,"
                                         "functional_captured,fsdp2")
    ap.add_argument("--kernels", action="store_true", help="--time: each system's top kernels over two steps")
    ap.add_argument("--snapshot", action="store_true", help="--time: what is live at each system's peak, by site")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True, warn_only=True)
    start()
    dev = torch.device("cuda", 0)
    result = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, args=vars(args))
    if args.parity:
        result["parity"] = parity(args, dev)
    if args.time:
        result["timing"] = timing(args, dev)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
