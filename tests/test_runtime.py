"""Runtime parity with single-process training, schedule fidelity and errors, on real gloo groups."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import shardplan as sp
from distributed import run
from models import Toy, batches, toy_rules
from shardplan.planner.accounting import max_gathered_units
from shardplan.runtime.unit import Params

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
UNITS = [r"blocks\.\d+"]
LR = 1e-3
ATOL = 1e-5


def _stepping(case, step):
    """With keep_grads, gradients of two backward passes add up before one optimizer step."""
    return not case.get("keep_grads") or step % 2 == 1


def _reference(data, case):
    clip = case.get("clip")
    model = Toy(ckpt=case.get("ckpt", False), **case.get("toy", {}))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for step, (x, y) in enumerate(data):
        model(x, y).backward()
        if not _stepping(case, step):
            continue
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _train_sharded(rank, world, case, data):
    model = Toy(ckpt=case.get("ckpt", False), **case.get("toy", {}))
    if rank == 1:
        model.scale.fill_(7.0)  # buffers are broadcast from rank 0 at shard()
    mesh = sp.Mesh(**case.get("mesh", {"dp": world}))
    axis = case.get("axis", "dp")
    plan = sp.plan(model, toy_rules(axis, odd=case.get("odd", True)), mesh, strategy=case["strategy"],
                   units=case.get("units", UNITS), prefetch=case.get("prefetch", 1),
                   min_unit_bytes=case.get("min_unit_bytes", 0), layout=case.get("layout", "auto"))
    if case.get("min_unit_bytes"):
        assert any(u.modules for u in plan.units), "the case should merge units"
    if case.get("edit"):
        plan = EDITS[case["edit"]](plan)
    sp.shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    accum, clip = case.get("accum", 1), case.get("clip")
    per = data[0][0].shape[0] // world
    norms, recorded, expected = [], [], []
    for step, (x, y) in enumerate(data):
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        with sp.record_ops(model) as ops:
            m = per // accum
            for i in range(accum):
                sync = sp.no_sync(model) if i < accum - 1 else contextlib.nullcontext()
                with sync:
                    (model(xs[i * m:(i + 1) * m], ys[i * m:(i + 1) * m]) / accum).backward()
                # the shards are stale (re-gathered by ZeRO-1/2) after every synchronising backward
                expected += plan.ops(stale=i == 0, sync=i == accum - 1)
        recorded += ops
        if not _stepping(case, step):
            continue
        if clip:
            norms.append(sp.clip_grad_norm_(model, clip).item())
        opt.step()
        opt.zero_grad()
    params = dict(model.named_parameters())
    local = {p.name: (plan.local_slices(p.name, rank), params[p.name].detach().clone()) for p in plan.params}
    eng = sp.runtime.engine_of(model)
    # inference frees what it gathers, and runs the plan's no_grad program
    with torch.no_grad(), sp.record_ops(model) as ops:
        model.eval()
        model(*[t[:2] for t in data[0]])
    recorded += ops
    expected += plan.ops(grad=False)
    still = [u.name for u in eng.unit_list if u.params is not Params.SHARDED and u.name in eng.transient]
    return dict(local=local, norms=norms, recorded=recorded, expected=expected,
                max_gathered=eng.max_gathered, allowed=max_gathered_units(plan) + 1, scale=model.scale.item(),
                still_gathered=still, registered_are_shards=all(p is q for p, q in zip(model.parameters(), opt.param_groups[0]["params"])))


def _parity_worker(rank, world, cases):
    data = batches(4, batch=8)
    out = []
    for case in cases:
        res = _train_sharded(rank, world, case, data)
        ref, ref_norms = _reference(data, case)
        diffs = {}
        for name, (box, local) in res.pop("local").items():
            if box is not None:
                diffs[name] = (local - ref[name][box]).abs().max().item() if local.numel() else 0.0
            else:
                diffs[name] = 0.0 if local.numel() == 0 else float("inf")
        res.update(diffs=diffs, ref_norms=ref_norms)
        out.append(res)
    return out


def _check(results, cases):
    for rank_results in results:
        for case, res in zip(cases, rank_results):
            worst = max(res["diffs"].items(), key=lambda kv: kv[1])
            assert worst[1] <= ATOL, f"{case}: parameter {worst[0]} differs by {worst[1]:.2e} from single-process training"
            if case.get("clip"):
                assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-5, abs=1e-6), case
            assert res["recorded"] == res["expected"], f"{case}: executed ops differ from plan.schedule"
            assert res["max_gathered"] <= res["allowed"], case
            assert res["scale"] == 0.5, "buffers must be synced from rank 0"
            assert res["still_gathered"] == [], f"{case}: inference left units gathered"


def _gather_late(plan):
    """An edited op list: blocks.1 is no longer prefetched; it is gathered where it computes."""
    ops = list(plan.schedule)
    k = next(i for i, o in enumerate(ops) if o.kind == "all_gather" and o.unit == "blocks.1" and o.prefetch
             and o.event == "pre_forward")
    moved = ops.pop(k)
    w = next(i for i, o in enumerate(ops) if o.kind == "wait" and o.unit == "blocks.1" and o.event == "pre_forward")
    ops.insert(w, sp.planner.Op(kind=moved.kind, unit=moved.unit, what=moved.what, event="pre_forward", at="blocks.1",
                        buffers=moved.buffers, axes=moved.axes, bytes=moved.bytes))
    return plan.with_schedule(ops)


EDITS = {
    "prefetch2": lambda p: p.with_prefetch(2),
    "prefetch0": lambda p: p.with_prefetch(0),
    "keep_block0": lambda p: p.with_reshard_after_forward({"blocks.0": False}),
    "keep_all": lambda p: p.with_reshard_after_forward(False),
    "dynamic": lambda p: p.with_order("dynamic"),
    "gather_late": _gather_late,
}

CASES_2 = [dict(strategy=s) for s in STRATEGIES] + [dict(strategy="optim_grads_params", edit=e) for e in EDITS] + [
    dict(strategy="optim_grads_params", accum=2, clip=0.05),
    dict(strategy="optim_grads", accum=2),
    dict(strategy="optim_grads_params", ckpt=True, prefetch=2),
    dict(strategy="optim_grads_params", units=[r"blocks\.[02]"], clip=0.05),  # uneven units: block 1 in the root
    dict(strategy="optim_grads_params", odd=False, prefetch=0),
    dict(strategy="optim_grads_params", min_unit_bytes=5000),  # blocks 0 and 1 merged into one unit
    dict(strategy="optim_grads", min_unit_bytes=5000, ckpt=True),
    dict(strategy="no_shard", keep_grads=True),
    dict(strategy="optim", keep_grads=True, clip=0.05),
    dict(strategy="optim_grads_params", keep_grads=True),
    # chunked pieces of every parameter, copied out after each gather: whole equal row blocks (one strided copy
    # per parameter) beside the uneven ones (a copy per rank)
    dict(strategy="optim_grads_params", layout="chunked", toy=dict(vocab=40, d=16, h=30)),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])  # 2: the quick loop's gloo smoke
def test_parity_one_and_two_ranks(world):
    results = run(_parity_worker, world, CASES_2)
    _check(results, CASES_2)


CASES_4 = [
    dict(strategy="optim_grads_params"),
    dict(strategy="optim_grads_params", mesh={"replica": 2, "shard": 2}, axis="shard"),
    dict(strategy="optim_grads", mesh={"replica": 2, "shard": 2}, axis="shard", clip=0.05),
    dict(strategy="optim", mesh={"replica": 2, "shard": 2}, axis="shard", accum=2),
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_parity_four_ranks_and_hsdp():
    results = run(_parity_worker, 4, CASES_4)
    _check(results, CASES_4)


def _error_of(fn) -> str:
    try:
        fn()
        return "no error"
    except sp.errors.RuntimeShardingError as exc:
        return str(exc)


def _error_worker(rank, world):
    import gc
    import time
    import weakref
    out = {}
    model = Toy()
    # a plan that differs between ranks: the error names the option that differs
    plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=UNITS, prefetch=1 + rank, min_unit_bytes=0)
    out["fingerprint"] = _error_of(lambda: sp.shard(model, plan))
    bad = sp.plan(Toy(), toy_rules(), sp.Mesh(dp=2 * world), units=UNITS, min_unit_bytes=0)
    out["world"] = _error_of(lambda: sp.shard(Toy(), bad))
    # a check only rank 1 fails (its plan is for another mesh) ends every rank at once, not at a timeout
    t = time.monotonic()
    mine = sp.plan(Toy(), toy_rules(), sp.Mesh(dp=world if rank == 0 else 2 * world), units=UNITS, min_unit_bytes=0)
    out["one_rank"] = _error_of(lambda: sp.shard(Toy(), mine, timeout_s=60))
    out["one_rank_s"] = time.monotonic() - t
    good = sp.plan(Toy(), toy_rules(), sp.Mesh(dp=world), units=UNITS, min_unit_bytes=0)
    m = sp.shard(Toy(), good)
    out["twice"] = _error_of(lambda: sp.shard(m, good))
    out["mismatch"] = _error_of(lambda: sp.shard(Toy(h=31), good))
    # a dropped sharded model is freed (hooks live in C++, out of the garbage collector's sight)
    m2 = sp.shard(Toy(), good)
    m2(*batches(1)[0]).backward()
    ref = weakref.ref(sp.runtime.engine_of(m2))
    del m2, m
    gc.collect()
    out["freed"] = ref() is None
    # a rank that never reaches shard(): the others stop after timeout_s, naming it
    t = time.monotonic()
    if rank == 0:
        out["absent"] = _error_of(lambda: sp.shard(Toy(), good, timeout_s=3))
    out["absent_s"] = time.monotonic() - t
    if rank == 1:
        time.sleep(4)  # stay alive: the store lives with the group
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_errors_instead_of_hangs():
    for rank, out in enumerate(run(_error_worker, 2)):
        assert "ranks [0] have" in out["fingerprint"] and "ranks [1] have" in out["fingerprint"]
        assert "prefetch: 1 vs 2" in out["fingerprint"], out["fingerprint"]
        assert "world size is 2" in out["world"] and "4 ranks" in out["world"]
        assert "failed on rank(s) [1]" in out["one_rank"] and "world size is 2" in out["one_rank"], out["one_rank"]
        assert out["one_rank_s"] < 20, "a one-rank failure must end every rank promptly"
        assert "already sharded" in out["twice"]
        assert "blocks.0.fc1.weight" in out["mismatch"] and "(31, 13)" in out["mismatch"]
        assert out["freed"], "a sharded model must be garbage-collected once dropped"
        if rank == 0:
            assert "rank(s) [1] did not reach shard()" in out["absent"] and 2.5 < out["absent_s"] < 20, out


def test_shard_without_process_group():
    assert not dist.is_initialized()
    plan = sp.plan(Toy(), toy_rules(), sp.Mesh(dp=1), units=UNITS, min_unit_bytes=0)
    with pytest.raises(sp.errors.RuntimeShardingError, match="init_process_group"):
        sp.shard(Toy(), plan)


def _memory_worker(rank, world, cases):
    import sys
    sys.path.insert(0, "examples")
    import gpt
    out = []
    for kind, strategy, dtype in cases:
        mesh, tp = sp.Mesh(dp=world), {}
        if kind.startswith("gpt"):  # contiguous buffers only
            model, rules, units, x = gpt.build("small").init_weights(0), [(r".*", sp.P("dp"))], [r"layers\.\d+"], None
            x = (torch.randint(0, 512, (2, 16)),) * 2
            if kind == "gpt_tp":  # tensor-parallel-local storage, DTensor parameters and gradients
                import gpt_rules_tp
                rules, mesh, tp = gpt_rules_tp.rules, sp.Mesh(dp=1, tp=world), dict(compute_axes=("tp",))
        else:  # interleaved (copy-out), replicated and frozen buffers, a tied parameter
            model, rules, units, x = Toy(), toy_rules(), UNITS, batches(1, batch=2)[0]
        dtype, reduce = dtype if isinstance(dtype, tuple) else (dtype, None)
        plan = sp.plan(model, rules, mesh, strategy=strategy, units=units, compute_dtype=dtype, reduce_dtype=reduce,
                       min_unit_bytes=0, **tp)
        if reduce is not None and strategy >= 2:  # [Note: gradients land in the reduce dtype] (planner/values.py)
            assert any(b.lands_in_reduce_dtype for b in plan.buffers)
        sp.shard(model, plan)
        opt = torch.optim.AdamW(model.parameters())
        for step in range(2):
            if step == 1:
                sp.reset_peak(model)
            model(*x).backward()
            opt.step()
            opt.zero_grad()
        mem = plan.memory(rank)
        out.append((sp.memory_stats(model)["peak"], mem.peak - mem.optimizer))
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_runtime_memory_matches_plan():
    """The runtime's accounted peak (every tensor it holds for parameters and gradients: shards, gathered
    buffers, send copies, unsharded gradients, reduction inputs and outputs, local gradients; not optimizer
    state or activations) equals plan.memory()'s op-by-op walk exactly, in fp32, in bf16, and in bf16 with
    fp32 reductions (the unsharded gradients then land in fp32)."""
    cases = [(k, s, d) for k in ("gpt", "toy", "gpt_tp") for s in range(4)
             for d in (None, torch.bfloat16, (torch.bfloat16, torch.float32))]
    for rank_out in run(_memory_worker, 2, cases):
        for case, (measured, planned) in zip(cases, rank_out):
            assert measured == planned, (case, measured, planned)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_runtime_memory_matches_plan_on_one_rank():
    """A unit's first reduction lands the gradients of all its buffers, a replicated one too, whose own reduction
    (on one rank: its wait) comes later: with fp32 reductions of bf16 gradients its unsharded gradient is wider
    from then on, and plan.memory() counts it so (it had counted it narrow until the wait: 154 bytes under the
    runtime's peak on this toy)."""
    cases = [("toy", 3, (torch.bfloat16, torch.float32)), ("toy", 2, (torch.bfloat16, torch.float32))]
    for case, (measured, planned) in zip(cases, run(_memory_worker, 1, cases)[0]):
        assert measured == planned, (case, measured, planned)


def _hang_worker(rank, world):
    import time
    model = Toy()
    plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=UNITS, min_unit_bytes=0)
    sp.shard(model, plan, timeout_s=3)
    if rank == 1:
        time.sleep(8)  # never joins the forward's all-gather
        return "skipped"
    try:
        model(*batches(1)[0])
        return "no error"
    except sp.errors.CollectiveError as exc:
        return str(exc)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_collective_timeout_names_the_op():
    out = run(_hang_worker, 2, expect_errors=True, timeout=60)
    status, msg = out[0]
    assert status == "ok" and "all_gather params unit=<root> at pre_forward(<root>)" in msg and "rank 0" in msg, out


def _held_grads_worker(rank, world):
    out = []
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        model = Toy()
        plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), strategy=strategy, units=[r"blocks\.\d+"],
                       min_unit_bytes=0)
        sp.shard(model, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        held, values = [], []
        for x, y in batches(3):
            model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel()]
            held.append(grads)                           # the caller keeps every step's gradient tensors
            values.append([g.clone() for g in grads])
            opt.step()
            opt.zero_grad(set_to_none=True)
        worst = max((h - v).abs().max().item() for hs, vs in zip(held, values) for h, v in zip(hs, vs))
        out.append((strategy, worst))
    return out


def test_gradients_a_caller_keeps_are_not_overwritten_by_later_steps():
    """A gradient tensor the caller holds after zero_grad(set_to_none=True) keeps its values through later
    backwards, as in plain PyTorch (under no_shard and optim the local gradients are views of the flat
    gradient: a later window once reused its storage and changed them silently)."""
    for rank_out in run(_held_grads_worker, 2):
        for strategy, worst in rank_out:
            assert worst == 0.0, (strategy, worst)
