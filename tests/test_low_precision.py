"""Quantized parameter gathers (``gather_dtype``): plan data and accounting, the kernels' error bounds,
and the runtime on real gloo groups (bytes sent, memory, NaN refusal, training parity)."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

import shardplan as sp
from distributed import run
from shardplan import lowp
from shardplan.runtime.quantize import round_trip

sys.path.insert(0, "examples")
import gpt  # noqa: E402

RULES = [(r".*", sp.P("dp"))]
UNITS = [r"layers\.\d+"]


def _plan(world=4, gather="int8", **kw):
    kw.setdefault("units", UNITS)
    kw.setdefault("min_unit_bytes", 0)
    return sp.plan(gpt.tiny(), RULES, sp.Mesh(dp=world), gather_dtype=gather, **kw)


# -- plan data ------------------------------------------------------------------------------------

def test_global_option_quantizes_matrices_only():
    plan = _plan(compute_dtype="bf16")
    for p in plan.params:
        b = plan.buffers[p.buffer]
        assert b.gather_dtype == ("int8" if len(p.shape) >= 2 else ""), p.name
    assert all(b.gather_dtype == "" for b in plan.buffers if not b.sharded)


def test_per_rule_option_first_match_wins():
    plan = _plan(gather=[(r".*tok_embeddings.*", None), (r".*norm.*", "fp8"), (r".*", "int8")])
    fmt = {p.name: plan.buffers[p.buffer].gather_dtype for p in plan.params}
    assert fmt["tok_embeddings.weight"] == ""
    assert fmt["norm.weight"] == "float8_e4m3fn" and fmt["layers.0.attention_norm.weight"] == "float8_e4m3fn"
    assert fmt["layers.0.attention.wq.weight"] == "int8"


def test_plan_warns_where_quantizing_cannot_pay():
    alone = _plan(world=1)
    assert any("shard group of one" in w for w in alone.warnings)
    assert not any("shard group of one" in w for w in _plan(world=2).warnings)
    assert not any("shard group of one" in w for w in _plan(world=1, gather=None).warnings)


def test_plan_shows_quantized_gathers():
    plan = _plan(gather="float8_e4m3fn", compute_dtype="bf16")
    text = str(plan)
    assert "gathered as float8_e4m3fn" in text and "fp32 block scales" in text
    from shardplan.planner.render import render_schedule
    sched = render_schedule(plan)
    assert "quantize float8_e4m3fn" in sched and "dequantize float8_e4m3fn -> compute dtype" in sched


def test_quantized_plans_round_trip():
    """JSON, declarative options and to_source() keep gather_dtype and reduce_dtype='int8'."""
    plan = _plan(gather=[(r".*embed.*", None), (r".*", "int8")], compute_dtype="bf16", reduce_dtype="int8")
    again = sp.Plan.from_json(plan.to_json())
    assert again.buffers == plan.buffers and again.fingerprint() == plan.fingerprint()
    rebuilt = sp.plan(gpt.tiny(), **plan.declarative())
    assert rebuilt.equivalent(plan) and rebuilt.buffers == plan.buffers
    assert "gather_dtype=" in plan.to_source()
    assert _plan(gather=None).fingerprint() != _plan().fingerprint()


@pytest.mark.parametrize("kw, match", [
    (dict(strategy="optim_grads"), "optim_grads_params"),
    (dict(offload="params"), "offload"),
])
def test_refused_combinations_name_the_fix(kw, match):
    with pytest.raises(sp.errors.PlanError, match=match):
        _plan(**kw)


@pytest.mark.parametrize("kw", [dict(compute_dtype=torch.int8), dict(reduce_dtype="uint8"), dict(reduce_dtype=torch.int32)])
def test_integer_compute_or_reduce_dtypes_are_refused(kw):
    """A cast of the parameters or gradients to an integer type would be a silent wrong number."""
    with pytest.raises(sp.errors.PlanError, match="not a floating dtype"):
        _plan(gather=None, **kw)


@pytest.mark.parametrize("kw,fix", [(dict(reduce_dtype="float8_e5m2"), "reduce_dtype='int8'"),
                                    (dict(reduce_dtype=torch.float8_e4m3fn), "reduce_dtype='int8'"),
                                    (dict(compute_dtype="float8_e4m3fn"), "fp8='torchao'")])
def test_float8_compute_or_reduce_dtypes_are_refused_at_plan_time(kw, fix):
    """Issue 36: reduce_dtype='float8_e5m2' was planned, and the first backward failed on every rank with a
    CollectiveError blaming mismatched schedules (no collective sums float8). Refused when planning, with the fix."""
    with pytest.raises(sp.errors.PlanError, match=r"is not supported.*" + re.escape(fix)):
        _plan(gather=None, **kw)


def test_bad_option_is_refused():
    with pytest.raises(sp.errors.PlanError, match="gather_dtype must be"):
        _plan(gather="int4")
    with pytest.raises(sp.errors.PlanError, match="not a \\(regex, dtype\\) pair"):
        _plan(gather=["int8"])


@settings(max_examples=25, deadline=None)
@given(world=st.sampled_from([1, 2, 3, 4, 8]), fmt=st.sampled_from(lowp.FORMATS),
       dim=st.sampled_from([16, 24, 64, 72]), compute=st.sampled_from([None, "bf16"]))
def test_accounting_equals_the_layout(world, fmt, dim, compute):
    """all_gather bytes = codes + fp32 scales per the layout, for every buffer; the rest as unquantized."""
    model = gpt.build("tiny", dim=dim, heads=4, kv_heads=4, ffn=2 * dim)
    q = sp.plan(model, RULES, sp.Mesh(dp=world), units=UNITS, min_unit_bytes=0, gather_dtype=fmt, compute_dtype=compute)
    full = sp.plan(model, RULES, sp.Mesh(dp=world), units=UNITS, min_unit_bytes=0, compute_dtype=compute)
    expect = scales = 0
    for op in q.ops():
        if op.kind == "all_gather":
            n = q.mesh.axis_size(op.axes)
            wire = sum((lowp.wire_shard_bytes(b.shard_numel) * b.group_size if b.gather_dtype
                        else b.gathered_numel * b.compute_itemsize)
                       for b in (q.buffers[i] for i in op.buffers) if b.sharded)
            assert op.bytes == wire
            expect += wire * (n - 1) // n
            scales += sum(4 * math.ceil(q.buffers[i].shard_numel / 256) * (n - 1)
                          for i in op.buffers if q.buffers[i].gather_dtype)
    c = q.comm_bytes()
    assert c["all_gather"] == expect and c["gather_scales"] == scales
    rs = [op for op in q.ops() if op.kind == "reduce_scatter"]  # gradients: reduced unquantized
    assert all(op.bytes == sum(q.buffers[i].gathered_numel * q.buffers[i].reduce_itemsize for i in op.buffers) for op in rs)
    if world > 1:
        assert c["all_gather"] < full.comm_bytes()["all_gather"]
    # the masters are unchanged (splitting buffers by gather dtype may move padding)
    assert sum(b.numel for b in q.buffers) == sum(b.numel for b in full.buffers)
    assert q.memory().params == sum(b.shard_numel * b.itemsize for b in q.buffers)


# -- the kernels ------------------------------------------------------------------------------------

_MAG = st.sampled_from([0.0, 1e-30, 1e-6, 1.0, 1e4, 1e30])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 1300), fmt=st.sampled_from(lowp.FORMATS), scale=_MAG, zeros=st.floats(0, 1),
       seed=st.integers(0, 2**31 - 1))
def test_round_trip_within_the_format_bound(n, fmt, scale, zeros, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    x[torch.rand(n, generator=g) < zeros] = 0.0
    y = round_trip(x, fmt)
    blocks = [x[i:i + lowp.BLOCK] for i in range(0, n, lowp.BLOCK)]
    ys = [y[i:i + lowp.BLOCK] for i in range(0, n, lowp.BLOCK)]
    for xb, yb in zip(blocks, ys):
        amax = xb.abs().max().item()
        err = (xb - yb).abs()
        assert torch.isfinite(yb).all()
        assert (yb[xb == 0] == 0).all()  # zeros stay exact
        if fmt == "int8":
            bound = amax / 127 / 2 * (1 + 1e-5) + 1e-45
            assert err.max().item() <= bound, (amax, err.max().item())
        else:
            s = amax / 448
            bound = torch.maximum(xb.abs() * 2.0 ** -4, torch.full_like(xb, s * 2.0 ** -10)) * (1 + 1e-5) + 1e-45
            assert (err <= bound).all(), (amax, (err - bound).max().item())


def test_round_trip_is_not_the_identity():
    x = torch.randn(1000)
    for fmt in lowp.FORMATS:
        assert (round_trip(x, fmt) != x).any()


# -- the runtime on gloo -----------------------------------------------------------------------------

def _counting(C):
    """Wrap collectives.all_gather to count the bytes this rank sends: (n-1)/n of each gathered output."""
    sent = [0]
    orig = C.all_gather

    def counted(out, inp, group, async_op=True):
        if group.pg is not None:
            sent[0] += out.numel() * out.element_size() * (group.size - 1) // group.size
        return orig(out, inp, group, async_op)
    C.all_gather = counted
    return sent, orig


def _train(rank, world, fmt, steps, compute=None, batch=4, seq=32, reduce=None, strategy="optim_grads_params"):
    from shardplan.runtime import collectives as C
    torch.manual_seed(0)
    model = gpt.tiny().init_weights(0)
    plan = sp.plan(model, RULES, sp.Mesh(dp=world), units=UNITS, min_unit_bytes=0, gather_dtype=fmt,
                   compute_dtype=compute, reduce_dtype=reduce, strategy=strategy)
    sp.shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sent, orig = _counting(C)
    a2a, orig_a2a = [0], C.all_to_all

    def counted_a2a(out, inp, group, async_op=True):
        if group.pg is not None:
            a2a[0] += inp.numel() * inp.element_size() * (group.size - 1) // group.size
        return orig_a2a(out, inp, group, async_op)
    C.all_to_all = counted_a2a
    g = torch.Generator().manual_seed(1)
    losses, per_step = [], []
    try:
        for step in range(steps):
            # learnable sequences: each row counts up from a random start by a random stride
            start = torch.randint(0, 256, (batch * world, 1), generator=g)
            stride = torch.randint(1, 4, (batch * world, 1), generator=g)
            x = (start + stride * torch.arange(seq + 1)) % 256
            x = x[rank * batch:(rank + 1) * batch]
            before = sent[0]
            if step == 1 and steps == 2:
                sp.reset_peak(model)
            loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            per_step.append(sent[0] - before)
            t = loss.detach().clone()
            torch.distributed.all_reduce(t)
            losses.append(t.item() / world)
    finally:
        C.all_gather, C.all_to_all = orig, orig_a2a
    return dict(losses=losses, sent=per_step, planned=plan.comm_bytes()["all_gather"], a2a=a2a[0],
                planned_rs=plan.comm_bytes()["reduce_scatter"],
                mem=(sp.memory_stats(model)["peak"], plan.memory(rank).peak - plan.memory(rank).optimizer))


def _toy(rank, world, fmt, reduce=None):
    """Interleaved (copy-out), replicated, frozen and tied parameters; every trainable one quantized. Returns the
    bytes sent vs planned, the memory, and the largest error of a gathered weight against its master value."""
    from models import Toy, batches, toy_rules
    from shardplan.runtime import collectives as C
    ref = {n: p.detach().clone() for n, p in Toy().named_parameters()}
    model = Toy()
    plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0,
                   gather_dtype=[(r".*", fmt)], reduce_dtype=reduce)
    assert any(b.gather_dtype and b.copy_out for b in plan.buffers)
    sp.shard(model, plan)
    seen = {}
    model.blocks[1].fc2.register_forward_pre_hook(lambda m, a: seen.update(w=m.weight.detach().clone()) and None)
    sent, orig = _counting(C)
    try:
        x, y = batches(1, batch=2)[0]
        sp.reset_peak(model)
        model(x, y).backward()
    finally:
        C.all_gather = orig
    amax = max(t.abs().max().item() for t in ref.values())
    err = (seen["w"] - ref["blocks.1.fc2.weight"]).abs().max().item()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(sent=[sent[0]], planned=plan.comm_bytes()["all_gather"], err=err, amax=amax, grads=grads,
                mem=(sp.memory_stats(model)["peak"], plan.memory(rank).peak - plan.memory(rank).optimizer))


def _bytes_worker(rank, world):
    out = {("toy", fmt): _toy(rank, world, fmt) for fmt in lowp.FORMATS}
    out[("toy, int8 gathers + int8 reduction", "")] = _toy(rank, world, "int8", reduce="int8")  # copy-in of grads
    out[("int8 gathers + int8 reduction", "torch.bfloat16")] = _train(rank, world, "int8", 2, torch.bfloat16, reduce="int8")
    for fmt in (None, "int8", "float8_e4m3fn"):
        for compute in (None, torch.bfloat16):
            r = _train(rank, world, fmt, 2, compute)
            out[(fmt, str(compute))] = r
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_runtime_sends_the_planned_bytes(world):
    """Per step, the bytes the runtime's all-gathers send equal plan.comm_bytes()['all_gather'], quantized or not;
    the quantized ones send fewer; the runtime's accounted peak equals plan.memory()'s."""
    for rank_out in run(_bytes_worker, world):
        for key, r in rank_out.items():
            assert r["sent"] == [r["planned"]] * len(r["sent"]), (key, r["sent"], r["planned"])
            assert r["mem"][0] == r["mem"][1], (key, r["mem"])
        # the int8 reduction (copy-in of interleaved gradients, segments to their ranks) against the unquantized one
        q, ref = rank_out[("toy, int8 gathers + int8 reduction", "")]["grads"], rank_out[("toy", "int8")]["grads"]
        assert q.keys() == ref.keys() and q
        num = sum(((q[n] - ref[n]).float() ** 2).sum() for n in q) ** 0.5
        den = sum((ref[n].float() ** 2).sum() for n in q) ** 0.5
        assert 0 < num / den < 2e-2, (num, den)  # measured 9.3e-3 (2 ranks); a misrouted segment is O(1)
        for fmt in lowp.FORMATS:  # quantize -> gather -> dequantize -> copy-out, within the format's bound
            r = rank_out[("toy", fmt)]
            assert 0 < r["err"] <= r["amax"] * (1 / 254 if fmt == "int8" else 1 / 16) * 1.001, (fmt, r["err"], r["amax"])
        for compute in ("None", "torch.bfloat16"):
            full = rank_out[(None, compute)]["planned"]
            assert rank_out[("int8", compute)]["planned"] < full
            assert rank_out[("float8_e4m3fn", compute)]["planned"] < full


def _nan_worker(rank, world, deferred=False):
    model = gpt.tiny().init_weights(0)
    plan = sp.plan(model, RULES, sp.Mesh(dp=world), units=UNITS, min_unit_bytes=0, gather_dtype="int8")
    sp.shard(model, plan)
    if deferred:  # the GPU's check (no host sync): found at the buffer's next gather
        for b in model._shardplan.buffer.values():
            b.defer_check = True
    x = torch.randint(0, 256, (2, 9))
    model(x[:, :-1], x[:, 1:]).backward()
    if rank == 1:
        with torch.no_grad():
            model.layers[1].feed_forward.w2.weight.view(-1)[3] = float("nan")
    model(x[:, :-1], x[:, 1:]).backward()
    if deferred:  # layers.1 is the last unit (kept gathered for backward): its next gather is the next step's
        model(x[:, :-1], x[:, 1:]).backward()
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("deferred", [False, True])
def test_nan_in_a_shard_raises_on_every_rank_naming_the_parameter(deferred):
    out = run(_nan_worker, 2, deferred, expect_errors=True)
    for status, message in out:
        assert status == "error", message
        assert "RuntimeShardingError" in message and "layers.1.feed_forward.w2.weight" in message, message
        assert "NaN or inf on rank 1" in message


STEPS = 50
# [Note: the tolerance] measured on the tiny GPT (docs/low_precision.md has the curves' differences): over 50
# steps int8 stays within 2e-3 of the unquantized-gather loss, float8_e4m3fn within 8.3e-3 (loss 5.5 -> 2.0)
TOL = {"int8": 0.02, "float8_e4m3fn": 0.05}


def _parity_worker(rank, world):
    return {(fmt, str(c)): _train(rank, world, fmt, STEPS, c)["losses"]
            for c in (None, torch.bfloat16) for fmt in (None, "int8", "float8_e4m3fn")}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_training_with_quantized_gathers_stays_near_full_precision():
    """50 steps of the tiny GPT on 2 ranks: the loss curve with int8 / float8 gathers stays within TOL of the one
    with unquantized gathers (fp32 compute, and bf16 compute against bf16 gathers), and differs from it (the
    quantization happened)."""
    curves = run(_parity_worker, 2)[0]
    print("for scale: bf16 compute vs fp32 compute, unquantized gathers: max difference "
          f"{max(abs(a - b) for a, b in zip(curves[(None, 'torch.bfloat16')], curves[(None, 'None')])):.3g}")
    for compute in ("None", "torch.bfloat16"):
        base = curves[(None, compute)]
        assert base[-1] < base[0] - 2, base  # it trains
        for fmt, tol in TOL.items():
            diff = max(abs(a - b) for a, b in zip(curves[(fmt, compute)], base))
            print(f"compute {compute}, {fmt} gathers: max |loss - unquantized-gather loss| over {STEPS} steps = "
                  f"{diff:.3g}; final {curves[(fmt, compute)][-1]:.4f} vs {base[-1]:.4f}")
            assert 0 < diff < tol, (fmt, compute, diff)


# -- quantized gradient reduction (reduce_dtype="int8") ------------------------------------------------

def test_quantized_reduction_plan():
    full = _plan(gather=None, compute_dtype="bf16", reduce_dtype="float32")
    q = _plan(gather=None, compute_dtype="bf16", reduce_dtype="int8")
    for b in q.buffers:
        assert b.reduce_dtype == ("float32" if b.requires_grad else b.reduce_dtype)
        assert b.reduce_quant == ("int8" if b.sharded and b.requires_grad else "")
    for op in q.ops():
        if op.kind == "reduce_scatter":
            assert op.bytes == sum(lowp.wire_shard_bytes(q.buffers[i].shard_numel) * q.buffers[i].group_size
                                   for i in op.buffers)
    assert q.comm_bytes()["reduce_scatter"] < 0.27 * full.comm_bytes()["reduce_scatter"]  # vs fp32 reduction
    with pytest.raises(sp.errors.PlanError, match="optim_grads"):
        _plan(gather=None, strategy="optim", reduce_dtype="int8")
    with pytest.raises(sp.errors.PlanError, match="HSDP"):
        sp.plan(gpt.tiny(), RULES, sp.Mesh(rep=2, dp=2), units=UNITS, min_unit_bytes=0, reduce_dtype="int8")


def _reduce_worker(rank, world):
    out = {}
    for strategy in ("optim_grads", "optim_grads_params"):
        for compute in (None, torch.bfloat16):
            out[(strategy, str(compute))] = _train(rank, world, None, 2, compute, reduce="int8", strategy=strategy)
    out["parity"] = {r: _train(rank, world, None, STEPS, reduce=r)["losses"] for r in (None, "int8")}
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_quantized_reduction_bytes_memory_and_parity(world):
    """reduce_dtype='int8': the all-to-all sends plan.comm_bytes()['reduce_scatter'] per step, the accounted peak
    equals plan.memory()'s, and 50 steps stay within 0.02 of the unquantized reduction's loss curve."""
    for rank_out in run(_reduce_worker, world):
        for key, r in rank_out.items():
            if key == "parity":
                continue
            assert r["a2a"] == 2 * r["planned_rs"] > 0, (key, r["a2a"], r["planned_rs"])
            assert r["mem"][0] == r["mem"][1], (key, r["mem"])
    curves = rank_out["parity"]
    diff = max(abs(a - b) for a, b in zip(curves["int8"], curves[None]))
    print(f"world {world}: int8 reduction, max |loss - fp32-reduction loss| over {STEPS} steps = {diff:.3g}")
    assert curves[None][-1] < curves[None][0] - 2
    assert 0 < diff < 0.02, diff
