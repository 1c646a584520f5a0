"""The forecast: properties (hypothesis) over random models, meshes, networks and compute times; the
α–β model and rank layout by hand; the timeline on hand-made items; presets, errors and the CLI."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardplan as sp
from shardplan import Mesh, P
from shardplan.errors import ForecastError
from shardplan.forecast import (ComputeModel, Forecast, Link, Network, Placement, collective_time, network,
                                placement)
from shardplan.forecast.flops import unit_flops, unit_widths
from shardplan.forecast.timeline import Comm, Issue, Run, Wait, Work, simulate
from shardplan.units import ROOT

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import gpt  # noqa: E402
import gpt_rules_tp  # noqa: E402

MESHES = [Mesh(dp=1), Mesh(dp=2), Mesh(dp=4), Mesh(dp=8), Mesh(replica=2, shard=4), Mesh(replica=4, shard=2),
          Mesh(shard=4, replica=2)]


def small_net(gpus_per_node: int, **kw) -> Network:
    """A network whose nodes are small, so meshes of a few ranks already cross nodes."""
    return Network("test", gpus_per_node, Link.uniform("nv", alpha_us=2.0, busbw=100.0),
                   Link.uniform("ib", alpha_us=8.0, busbw=10.0), **kw)


@st.composite
def cases(draw):
    mesh = draw(st.sampled_from(MESHES))
    n_blocks = draw(st.integers(1, 5))
    dims = [draw(st.sampled_from([16, 64, 256, 512])) for _ in range(n_blocks)]
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(1000, 64), *[nn.Sequential(nn.Linear(64, d), nn.Linear(d, 64)) for d in dims],
                              nn.Linear(64, 1000))
    hsdp = "shard" in mesh.axis_names
    rules = [(r".*bias", P()), (r".*", P("shard" if hsdp else "dp"))]
    plan = sp.plan(model, rules, mesh, strategy=draw(st.integers(0, 3)), units=[r"\d+"], min_unit_bytes=0,
                   compute_dtype=draw(st.sampled_from([None, torch.bfloat16])), prefetch=draw(st.integers(0, 2)),
                   reshard_after_forward=draw(st.booleans()))
    net = small_net(draw(st.sampled_from([1, 2, 4, 8])), algorithm=draw(st.sampled_from(["auto", "ring", "tree"])),
                    overlap=draw(st.booleans()))
    # measured unit times, drawn: compute that is sometimes far shorter, sometimes far longer than the transfers
    times = tuple((u.name, draw(st.floats(0, 2e-3)), draw(st.floats(0, 4e-3))) for u in plan.units)
    cm = ComputeModel(units=times, optimizer_s=draw(st.floats(0, 1e-3)))
    return plan, net, cm, model


SETTINGS = dict(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _close_or_less(a: float, b: float) -> bool:
    return a <= b * (1 + 1e-9) + 1e-12


@settings(**SETTINGS)
@given(cases(), st.floats(1.0, 8.0), st.sampled_from(["intra", "inter", "both"]))
def test_more_bandwidth_never_predicts_a_slower_step(case, factor, which):
    plan, net, cm, _ = case
    base = plan.forecast(net, cm, batch=(2, 128))
    if which == "both":
        faster = net.scaled(factor)
    else:
        link = net.link(which)
        faster = net.with_link(which, busbw=link.all_gather.busbw * factor)
    f = plan.forecast(faster, cm, batch=(2, 128))
    assert _close_or_less(f.step_s, base.step_s), (f.step_s, base.step_s)
    assert _close_or_less(f.exposed_s, base.exposed_s)


@settings(**SETTINGS)
@given(cases())
def test_forecast_bytes_equal_plan_comm_bytes(case):
    plan, net, cm, _ = case
    f = plan.forecast(net, cm, batch=(2, 128))
    assert f.comm_bytes() == plan.comm_bytes()
    # step = compute + exposed, always: the compute stream only computes or waits
    assert math.isclose(f.step_s, f.compute_s + f.exposed_s, rel_tol=1e-9, abs_tol=1e-12)
    for c in f.collectives:
        assert c.issued_s <= c.start_s + 1e-12 and c.end_s + 1e-12 >= c.start_s + c.alone_s


@settings(**SETTINGS)
@given(cases())
def test_deeper_prefetch_never_increases_exposed_communication(case):
    plan, net, cm, _ = case
    exposed = [plan.with_prefetch(k).forecast(net, cm, batch=(2, 128)).exposed_s for k in range(4)]
    for shallow, deep in zip(exposed, exposed[1:]):
        assert _close_or_less(deep, shallow), exposed


@settings(**SETTINGS)
@given(cases())
def test_world_one_predicts_no_communication(case):
    plan, net, _, model = case
    one = sp.plan(model, [(r".*", P("dp"))], Mesh(dp=1), units=[r"\d+"], min_unit_bytes=0,
                  strategy=plan.strategy, prefetch=plan.prefetch)
    f = one.forecast(net, ComputeModel(tflops=100.0), batch=(2, 128))
    assert f.exposed_s == 0 and math.isclose(f.step_s, f.compute_s, rel_tol=1e-12)
    assert all(c.sent == 0 and c.alone_s == 0 for c in f.collectives)
    assert f.comm_bytes()["total"] == 0 and all(p.link == "local" for p in f.placements)


# -- the α–β model and the rank layout ------------------------------------------------------------------

def test_rank_layout_decides_the_link():
    net = network("h100-8x-ib400")
    m = Mesh(replica=8, shard=8)          # row-major: shard varies fastest and stays in a node
    assert placement(net, m, 0, ("shard",)) == Placement(("shard",), 8, 1, 8, "intra")
    assert placement(net, m, 0, ("replica",)) == Placement(("replica",), 8, 8, 1, "inter")
    swapped = Mesh(shard=8, replica=8)
    assert placement(net, swapped, 0, ("shard",)).link == "inter"
    assert placement(net, Mesh(dp=64), 5, ("dp",)) == Placement(("dp",), 64, 8, 8, "inter")
    assert placement(net, Mesh(dp=8), 3, ("dp",)).link == "intra"
    assert placement(net, Mesh(dp=1), 0, ("dp",)).link == "local"


def test_alpha_beta_times_by_hand():
    net = network("h100-8x-ib400")
    gib = 2 ** 30
    t = collective_time(net, "all_gather", gib, Placement(("dp",), 8, 1, 8, "intra"))
    assert t.algorithm == "ring" and math.isclose(t.transfer_s, gib * 7 / 8 / 360e9)
    assert math.isclose(t.latency_s, 7 * 1.5e-6)
    # a whole-node axis over 8 nodes: 8 NICs per node carry the ring's cross-node traffic (min(360, 8 x 47))
    t = collective_time(net, "reduce_scatter", gib, Placement(("dp",), 64, 8, 8, "inter"))
    assert math.isclose(t.transfer_s, gib * 63 / 64 / 360e9)
    assert math.isclose(t.latency_s, (63 - 7) * 1.5e-6 + 7 * 6e-6)
    # one rank per node (HSDP's replica axis): one NIC
    t = collective_time(net, "all_reduce", gib, Placement(("replica",), 8, 8, 1, "inter"))
    assert math.isclose(t.transfer_s, 2 * gib * 7 / 8 / 47e9)
    # a tiny all-reduce across many nodes takes the tree
    t = collective_time(net, "all_reduce", 8, Placement(("dp",), 512, 64, 8, "inter"))
    assert t.algorithm == "tree" and math.isclose(t.latency_s, 2 * (7 * 1.5e-6 + 6 * 6e-6))
    ring = collective_time(network({"base": "h100-8x-ib400", "algorithm": "ring"}), "all_reduce", 8,
                           Placement(("dp",), 512, 64, 8, "inter"))
    assert ring.algorithm == "ring" and ring.latency_s > t.latency_s


def test_timeline_by_hand():
    # a gather of 3 ms issued before 2 ms of compute is exposed for 1 ms; a second one queued behind it on
    # the same stream starts when the first ends
    g1 = Comm(0, "ag 1", "gather", "intra", 0.0, 3e-3)
    g2 = Comm(1, "ag 2", "gather", "intra", 0.0, 1e-3)
    items = [Issue(g1), Issue(g2), Run(Work("f 0", "0", "forward", 2e-3)), Wait((0,)), Run(Work("f 1", "1", "forward", 1e-3)),
             Wait((1,))]
    tl = simulate(items)
    assert math.isclose(tl.step_s, 4e-3) and math.isclose(tl.exposed_s, 1e-3)
    assert math.isclose(tl.comms[1].start_s, 3e-3)
    # on different streams sharing one link, the collective waited for first is served first
    r = Comm(1, "rs", "reduce", "intra", 0.0, 1e-3)
    tl = simulate([Issue(g1), Issue(r), Wait((1,)), Wait((0,))])
    assert math.isclose(tl.comms[1].end_s, 1e-3) and math.isclose(tl.comms[0].end_s, 4e-3)
    # without overlap (gloo on the compute's cores) every collective is exposed
    tl = simulate(items, overlap=False)
    assert math.isclose(tl.step_s, 3e-3 + 1e-3 + 2e-3 + 1e-3) and math.isclose(tl.exposed_s, 4e-3)


# -- compute -------------------------------------------------------------------------------------------

def test_flops_count_matmuls_like_torchtitan():
    with torch.device("meta"):
        model = gpt.build("8B")
    plan = sp.plan(model, [(r".*", P("dp"))], Mesh(dp=8), units=[r"layers\.\d+"])
    c = model.config
    f = unit_flops(plan, (1, 8192))
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if "embeddings" not in n and p.dim() >= 2)
    # torchtitan: 6 N + 12 L H Q T per token (N without embeddings), forward is a third of it
    per_token = 6 * non_embedding + 12 * c.layers * c.dim * 8192
    assert math.isclose(3 * sum(f.values()) / 8192, per_token, rel_tol=1e-12)
    assert f[ROOT] == 2 * 8192 * c.vocab * c.dim          # the output head; embeddings are lookups
    with torch.device("meta"):
        tied = gpt.build("tiny")                            # tied embedding = output head: a matmul
    tplan = sp.plan(tied, [(r".*", P("dp"))], Mesh(dp=2), units=[r"layers\.\d+"], min_unit_bytes=0)
    assert unit_flops(tplan, (1, 64))[ROOT] == 2 * 64 * 256 * 64


def test_compute_from_flops_and_elementwise_work():
    with torch.device("meta"):
        model = gpt.build("1B")
    plan = sp.plan(model, [(r".*", P("dp"))], Mesh(dp=1), units=[r"layers\.\d+"], compute_dtype=torch.bfloat16)
    assert unit_widths(plan)["layers.0"] == 2048
    cm = ComputeModel(tflops=100.0, memory_gbs=1000.0, elementwise_bytes=500.0, backward_factor=3.0, optimizer_bytes=80.0)
    f = plan.forecast("h200-8x-ib400", cm, batch=(2, 64))
    flops = unit_flops(plan, (2, 64))["layers.0"]
    elementwise = 500.0 * 2 * 64 * 2048 / 1e12
    fwd = [s for s in f.spans if s.name == "forward layers.0"][0]
    bwd = [s for s in f.spans if s.name == "backward layers.0"][0]
    assert math.isclose(fwd.end_s - fwd.start_s, flops / 100e12 + elementwise / 4)
    assert math.isclose(bwd.end_s - bwd.start_s, 3 * (fwd.end_s - fwd.start_s))
    assert math.isclose(f.optimizer_s, sum(p.numel for p in plan.params) * 80 / 1e12)
    assert f.mfu is None                                    # no peak given


def test_measured_compute_and_presets():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    plan = sp.plan(model, [(r".*", P("dp"))], Mesh(dp=2), units=[r"\d+"], min_unit_bytes=0)
    cm = ComputeModel(units=((ROOT, 0.0, 0.0), ("0", 1e-3, 2e-3), ("1", 1e-3, 2e-3)), optimizer_s=5e-4, batch=(4, 8))
    f = plan.forecast("h100-8x-ib400", cm, batch=(4, 8))
    assert math.isclose(f.compute_s, 6.5e-3) and math.isclose(f.forward_s, 2e-3)
    with pytest.raises(ForecastError, match="measured at batch 4x8"):
        plan.forecast("h100-8x-ib400", cm, batch=(1, 8))
    with pytest.raises(ForecastError, match="no time for unit"):
        plan.forecast("h100-8x-ib400", ComputeModel(units=(("0", 1e-3, 2e-3),)), batch=(4, 8))
    assert plan.forecast("h100-8x-ib400", 400.0, batch=(4, 8)).compute.tflops == 400.0
    for name in sp.forecast.NETWORK_PRESETS:
        net = network(name)
        assert net.source and net.device in sp.forecast.COMPUTE_PRESETS
        assert Network.from_dict(json.loads(net.to_json())) == net


def test_network_from_file_dict_and_one_link_changed(tmp_path):
    net = network("h100-8x-ib400")
    path = tmp_path / "net.json"
    path.write_text(net.to_json())
    assert network(str(path)) == net
    d = network({"base": "h100-8x-ib400", "inter": {"busbw": 90.0}})
    assert d.inter.all_reduce.busbw == 90.0 and d.intra == net.intra
    assert net.with_link("inter", busbw=90.0) == d
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    plan = sp.plan(model, [(r".*", P("dp"))], Mesh(dp=64), units=[r"\d+"], min_unit_bytes=0)
    f = plan.forecast("h100-8x-ib400", 1.0, batch=(1, 64))
    again = plan.forecast(f.network.with_link("inter", busbw=4.5), f.compute, batch=f.batch)
    assert again.network.inter.all_gather.busbw == 4.5 and again.step_s >= f.step_s


def test_errors_are_one_line_and_name_the_fix():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    plan12 = sp.plan(model, [(r".*", P("dp"))], Mesh(dp=12), units=[r"\d+"], min_unit_bytes=0)
    plan = sp.plan(model, [(r".*", P("dp"))], Mesh(dp=16), units=[r"\d+"], min_unit_bytes=0)
    measured = {"name": "measured", "gpus_per_node": 4, "max_nodes": 2, "intra": {"alpha_us": 1, "busbw": 1},
                "inter": {"alpha_us": 1, "busbw": 1}}
    cases = [(plan12, dict(network="h100-8x-ib400"), "not whole nodes of 8"),
             (plan, dict(network="h900-8x"), "unknown network 'h900-8x'"),
             (plan, dict(network={"gpus_per_node": 8}), "no 'intra'"),
             (plan, dict(network="h100-8x-ib400", compute="tpu"), "unknown compute model"),
             (plan, dict(network="h100-8x-ib400", batch=(0, 5)), "batch must be"),
             (plan, dict(network={"base": "h100-8x-ib400", "inter": None}), "needs 2 nodes"),
             (plan, dict(network=measured, compute=1.0), "measured on at most 2"),
             (plan, dict(network={**measured, "max_nodes": None}), "no compute model"),
             (plan, dict(network="h100-8x-ib400", rank=16), "not a rank")]
    for p, kw, msg in cases:
        kw.setdefault("batch", (1, 64))
        with pytest.raises(sp.ShardingError, match=msg) as e:
            p.forecast(**kw)
        assert "\n" not in str(e.value)


def test_tensor_parallel_activations_are_timed_and_counted():
    model = gpt.build("tiny")
    tokens = torch.zeros(2, 16, dtype=torch.long)
    plan = sp.plan(model, gpt_rules_tp.rules, Mesh(dp=2, tp=2), compute_axes=("tp",), units=gpt_rules_tp.UNITS,
                   trace=tokens, min_unit_bytes=0)
    f = plan.forecast(small_net(4), 1.0, batch=(2, 16))
    assert f.comm_bytes() == plan.comm_bytes() and f.comm_bytes()["tensor_parallel"] > 0
    assert any(c.what == "activations" and c.stream == "compute" for c in f.collectives)
    untraced = sp.plan(model, gpt_rules_tp.rules, Mesh(dp=2, tp=2), compute_axes=("tp",), units=gpt_rules_tp.UNITS)
    g = untraced.forecast(small_net(4), 1.0, batch=(2, 16))
    assert g.comm_bytes()["tensor_parallel"] is None and any("not forecast" in n for n in g.notes)


def test_result_views(tmp_path):
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    plan = sp.plan(model, [(r".*", P("shard"))], Mesh(replica=2, shard=8), units=[r"\d+"], min_unit_bytes=0)
    f = plan.forecast("h200-8x-ib400", batch=(1, 256), scalar_all_reduces=1)
    assert isinstance(f, Forecast) and f.mfu is not None and 0 < f.mfu < 1
    text = str(f)
    assert "shard" in text and "replica" in text and "exposed comm" in text and "MFU" in text
    d = json.loads(f.to_json())
    assert d["comm_bytes_per_step"] == plan.comm_bytes() and d["network"]["name"] == "h200-8x-ib400"
    trace = tmp_path / "t.json"
    f.to_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} >= {"compute", "all_gather (gather stream)"}
    assert any(e["ph"] == "X" and e["name"].startswith("reduce_scatter") for e in events)
    assert f == plan.forecast("h200-8x-ib400", batch=(1, 256), scalar_all_reduces=1)   # pure: same inputs, same value


# -- CLI -----------------------------------------------------------------------------------------------

def _cli(*args):
    from shardplan.cli import main
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_cli_forecast_table_json_trace(tmp_path):
    gpt_py, rules = str(EXAMPLES / "gpt.py"), str(EXAMPLES / "gpt_rules.py")
    code, out, _ = _cli("forecast", f"{gpt_py}:llama_70b", "--mesh", "dp=64", "--rules", rules, "--dtype", "bf16",
                        "--network", "h100-8x-ib400", "--batch", "1x4096", "--trace", str(tmp_path / "t.json"))
    assert code == 0 and "exposed comm" in out and "tokens/s" in out and (tmp_path / "t.json").exists()
    code, out, _ = _cli("forecast", f"{gpt_py}:llama_70b", "--mesh", "dp=64", "--rules", rules, "--dtype", "bf16",
                        "--network", "h100-8x-ib400", "--batch", "1x4096", "--json")
    d = json.loads(out)
    code2, plan_out, _ = _cli("plan", f"{gpt_py}:llama_70b", "--mesh", "dp=64", "--rules", rules, "--dtype", "bf16", "--json")
    assert d["comm_bytes_per_step"] == json.loads(plan_out)["comm_bytes_per_step"]   # the same plan
    assert d["plan_fingerprint"] == sp.Plan.from_json(plan_out).fingerprint()
    for args, msg in [(("--network", "nope", "--batch", "1x4096"), "unknown network"),
                      (("--network", "h100-8x-ib400", "--batch", "4096"), "expected BxT"),
                      (("--network", "h100-8x-ib400", "--batch", "1x4096", "--mesh", "dp=12"), "not whole nodes")]:
        base = ["forecast", f"{gpt_py}:llama_70b", "--mesh", "dp=64"]
        code, _, err = _cli(*base, *args)
        assert code == 2 and msg in err and err.count("\n") == 1, err


def test_cli_compute_takes_what_it_offers(tmp_path):
    """--compute takes a number (the achievable TFLOP/s, as --tflops does) and its refusal offers only what it takes."""
    base = ["forecast", f"{EXAMPLES / 'gpt.py'}:tiny", "--mesh", "dp=2", "--network", "a100-8x-ib200", "--batch", "2x64",
            "--json"]
    code, out, err = _cli(*base, "--compute", "0.5")
    assert code == 0, err
    assert json.loads(out)["compute"]["tflops"] == 0.5   # as compute=0.5 in Python: that rate alone
    for bad, msg in [("fast", "not a preset, a file or a number"), ("-3", "positive number")]:
        code, _, err = _cli(*base, "--compute", bad)
        assert code == 2 and msg in err and "a dict" not in err and err.count("\n") == 1, err


@pytest.mark.slow  # the CLI in-process: test_cli_forecast_table_json_trace; the entry point: test_cli.py
def test_cli_entry_point_runs():
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent / "src")}
    out = subprocess.run([sys.executable, "-m", "shardplan", "forecast", f"{EXAMPLES / 'gpt.py'}:tiny", "--mesh", "dp=2",
                          "--network", "a100-8x-ib200", "--batch", "2x64"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr
    assert "Mesh(dp=2)" in out.stdout


# -- memory traffic beside the blocks: the head's loss, the runtime's copies --------------------------------

def test_head_loss_and_copy_traffic():
    """World 1, fp32 parameters, bf16 compute, fp32 reduce: a block's gather is a cast copy (4 + 2 bytes
    per element) in its forward and again in its backward, its gradients land in the reduce dtype (read
    2, write 4: the landing is the cast): 6N forward, 12N backward; the loss costs ``logit_bytes`` per logit on the
    head's unit, 18 : 22 between forward and backward."""
    from shardplan.forecast.traffic import logits_per_token, unit_traffic
    with torch.device("meta"):
        m = gpt.build("tiny", tie_embeddings=False)
    plan = sp.plan(m, [(r".*", P("dp"))], Mesh(dp=1), units=[r"layers\.\d+"], compute_dtype=torch.bfloat16,
                   reduce_dtype=torch.float32, min_unit_bytes=0)
    n = sum(p.numel() for p in m.layers[0].parameters())
    assert unit_traffic(plan, (2, 32), 0.0)["layers.0"] == (6 * n, 12 * n)
    assert plan.buffers[plan.units[1].buffers[0]].lands_in_reduce_dtype
    assert logits_per_token(plan) == m.config.vocab
    loss = unit_traffic(plan, (2, 32), 40.0, copies=False)
    assert loss[ROOT] == (64 * 256 * 18, 64 * 256 * 22) and loss["layers.0"] == (0, 0)
    base = ComputeModel(tflops=100.0, memory_gbs=1000.0, optimizer_s=0.0)
    plain = plan.forecast(network="h100-8x-ib400", compute=base, batch=(2, 32))
    more = plan.forecast(network="h100-8x-ib400", batch=(2, 32),
                         compute=ComputeModel(tflops=100.0, memory_gbs=1000.0, optimizer_s=0.0, logit_bytes=40.0,
                                              copy_traffic=True))
    total = sum(f + b for f, b in unit_traffic(plan, (2, 32), 40.0).values())
    assert more.compute_s - plain.compute_s == pytest.approx(total / 1e12, rel=1e-9)
    assert sp.forecast.compute_model("h200-sxm-bf16").copy_traffic and sp.forecast.compute_model("h200-sxm-bf16").logit_bytes == 40
    with pytest.raises(ForecastError, match="copy_traffic"):
        ComputeModel(copy_traffic="yes")


# -- memory-bound work counted op by op in a traced plan ------------------------------------------------------

def test_moved_bytes_classify_ops_by_hand():
    """Matmuls and views move nothing here (matmuls are timed from FLOPs); an elementwise op reads its
    inputs and writes its output; a broadcast input counts its storage; fill only writes; a cast reads
    one dtype and writes the other."""
    from shardplan.optraffic import kind, moved_bytes
    aten = torch.ops.aten
    x = torch.empty(4, 1024, device="meta", dtype=torch.bfloat16)
    w = torch.empty(1024, device="meta", dtype=torch.bfloat16)
    assert moved_bytes(aten.mm.default, (x, x.t()), {}, x) == 0 and kind(aten.mm.default) == "matmul"
    assert moved_bytes(aten.view.default, (x, [4096]), {}, x.view(4096)) == 0 and kind(aten.t.default) == "free"
    assert moved_bytes(aten.mul.Tensor, (x, x), {}, x) == 3 * 8192
    assert moved_bytes(aten.mul.Tensor, (x, w.expand(4, 1024)), {}, x) == 8192 + 2048 + 8192
    assert moved_bytes(aten.fill_.Scalar, (x, 0.0), {}, x) == 8192
    assert moved_bytes(aten._to_copy.default, (x,), {"dtype": torch.float32}, x.float()) == 8192 + 16384
    assert kind(aten._scaled_dot_product_flash_attention.default) == "matmul"


def _traced_tiny(batch=(2, 32)):
    with torch.device("meta"):
        m = gpt.build("tiny")
    tokens = torch.zeros(*batch, dtype=torch.long, device="meta")
    return sp.plan(m, [(r".*", P("dp"))], Mesh(dp=1), units=[r"layers\.\d+"], compute_dtype=torch.bfloat16,
                   reduce_dtype=torch.float32, min_unit_bytes=0, trace=(tokens, tokens))


def test_traced_plan_counts_memory_bound_bytes_per_unit():
    """A traced plan's profile holds the bytes moved between events; every block moves the same, forward
    less than backward; the sum over units is every byte counted; a JSON round trip keeps them; the
    forecast times them at elementwise_gbs, shows the split, and scales them with the tokens."""
    from shardplan.forecast.traffic import traced_bytes
    plan = _traced_tiny()
    assert plan.activations.tokens == 64 and all(p.moved is not None for p in plan.activations.plain)
    per = traced_bytes(plan, (2, 32))
    blocks = [v for u, v in per.items() if u != ROOT]
    assert len(set(blocks)) == 1 and 0 < blocks[0][0] < blocks[0][1]
    assert sum(f + b for f, b in per.values()) == sum(p.moved for p in plan.activations.plain)
    assert traced_bytes(sp.Plan.from_json(plan.to_json()), (2, 32)) == per
    assert traced_bytes(plan, (4, 32))["layers.0"] == tuple(2 * x for x in per["layers.0"])
    cm = ComputeModel(tflops=100.0, memory_gbs=1000.0, elementwise_gbs=500.0, optimizer_s=0.0)
    f = plan.forecast("h100-8x-ib400", cm, batch=(2, 32))
    total = sum(f_ + b for f_, b in per.values())
    assert f.traffic == "traced" and f.memory_bytes == pytest.approx(total)
    assert f.memory_s == pytest.approx(total / 500e9) and f.copies_s == 0
    assert f.forward_s + f.backward_s == pytest.approx(f.matmul_s + f.memory_s)
    assert "memory-bound" in str(f) and f.to_dict()["memory_traffic"] == "traced"
    assert "traced at 500 GB/s" in str(f)  # the table names the bandwidth the bytes were timed at, not memory_gbs
    untraced = sp.plan(gpt.build("tiny").to("meta"), [(r".*", P("dp"))], Mesh(dp=1), units=[r"layers\.\d+"],
                       compute_dtype=torch.bfloat16, min_unit_bytes=0).forecast("h100-8x-ib400", cm, batch=(2, 32))
    assert untraced.traffic == "estimated" and any("trace=" in n for n in untraced.notes)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.floats(1.0, 8.0), st.floats(1.0, 8.0), st.booleans(), st.sampled_from(["h200-sxm-bf16", "h100-sxm-bf16"]))
def test_more_memory_bandwidth_never_predicts_a_slower_step(hbm, elementwise, traced, preset):
    """Faster memory (the streaming bandwidth, the elementwise one, or both) never predicts a slower step,
    traced or not, world 1 or 2."""
    import dataclasses
    plan = _TRACED if traced else _UNTRACED
    cm = sp.forecast.compute_model(preset)
    faster = dataclasses.replace(cm, memory_gbs=cm.memory_gbs * hbm, elementwise_gbs=cm.elementwise_gbs * elementwise)
    for p in plan:
        base, f = p.forecast("h100-8x-ib400", cm, batch=(2, 32)), p.forecast("h100-8x-ib400", faster, batch=(2, 32))
        assert _close_or_less(f.step_s, base.step_s) and _close_or_less(f.memory_s, base.memory_s)
        assert _close_or_less(f.exposed_s, base.exposed_s + 1e-12) or f.step_s <= base.step_s


def _plans(trace: bool):
    with torch.device("meta"):
        m = gpt.build("tiny")
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    return [sp.plan(m, [(r".*", P("dp"))], Mesh(dp=n), units=[r"layers\.\d+"], compute_dtype=torch.bfloat16,
                    reduce_dtype=torch.float32, min_unit_bytes=0, trace=(tokens, tokens) if trace else None)
            for n in (1, 2)]


_TRACED, _UNTRACED = _plans(True), _plans(False)


def test_fp8_compute_absmax_all_reduces_are_forecast():
    """FP8 compute's float8 gathers all-reduce one absmax per weight first (inside the all_gather op): the
    forecast issues them on the gather's group and stream, and its bytes equal plan.comm_bytes() again."""
    import sys
    sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/examples")
    import gpt
    with torch.device("meta"):
        model = gpt.build("1B")
    plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=16), units=[r"layers\.\d+"], compute_dtype="bf16",
                   fp8="torchao")
    f = plan.forecast("h100-8x-ib400", batch=(1, 2048))
    assert f.comm_bytes() == plan.comm_bytes() and f.comm_bytes()["fp8_amax"] > 0
    amax = [c for c in f.collectives if c.what == "scales"]
    gathers = [o for o in plan.ops() if o.kind == "all_gather" and any(plan.buffers[b].amax_bytes for b in o.buffers)]
    ops = plan.ops()
    scales = [k for k, o in enumerate(ops) if o.what == "scales"]
    assert len(amax) == len(scales) == len(gathers) > 0  # one all_reduce of scales per float8 gather, just before it
    assert all(ops[k + 1].kind == "all_gather" and set(ops[k].buffers) <= set(ops[k + 1].buffers) for k in scales)
    assert all(c.kind == "all_reduce" and c.stream == "gather" and c.latency_s > 0 for c in amax)
