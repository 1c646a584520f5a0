"""Quantized parameter gathers (``gather_dtype``): plan data and accounting, the kernels' error bounds,
and the runtime on real gloo groups (bytes sent, memory, NaN refusal, training parity)."""

from __future__ import annotations

import math
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


def test_plan_shows_quantized_gathers():
    plan = _plan(gather="float8_e4m3fn", compute_dtype="bf16")
    text = str(plan)
    assert "gathered as float8_e4m3fn" in text and "fp32 block scales" in text
    sched = plan.render_schedule() if hasattr(plan, "render_schedule") else None
    from shardplan.plan.render import render_schedule
    sched = render_schedule(plan)
    assert "quantize float8_e4m3fn" in sched and "dequantize float8_e4m3fn -> compute dtype" in sched
    again = sp.Plan.from_json(plan.to_json()) if hasattr(sp.Plan, "from_json") else None
    if again is not None:
        assert again.buffers == plan.buffers


@pytest.mark.parametrize("kw, match", [
    (dict(strategy="optim_grads"), "optim_grads_params"),
    (dict(offload="params"), "offload"),
])
def test_refused_combinations_name_the_fix(kw, match):
    with pytest.raises(sp.PlanError, match=match):
        _plan(**kw)


def test_bad_option_is_refused():
    with pytest.raises(sp.PlanError, match="gather_dtype must be"):
        _plan(gather="int4")
    with pytest.raises(sp.PlanError, match="not a \\(regex, dtype\\) pair"):
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
