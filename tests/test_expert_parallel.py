"""Expert parallelism: stacked experts split over an ``ep`` axis, tokens moved by all-to-all; per-step losses
equal one process's at 2 and 4 ranks, routing that sends every token to one rank still trains, the plan's
errors name their fix, and a Hugging Face Mixtral plans with experts over ep."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import shardplan as sp
from distributed import run

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import moe  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the plan -------------------------------------------------------------------------------------------

def test_experts_split_over_ep_and_reduced_over_the_other_data_axes():
    mesh = sp.Mesh(dp=2, ep=2)
    plan = sp.plan(moe.build("tiny"), moe.rules_for(mesh), mesh, units=moe.UNITS, min_unit_bytes=0)
    w1 = plan.param("layers.0.moe.experts.w1")
    assert w1.global_shape == (4, 64, 64) and w1.shape == (2, 64, 64) and w1.tp_axis == "ep"
    assert plan.expert_module("layers.0.moe.experts").local_experts == 2
    assert plan.data_axes == ("dp", "ep") and plan.data_size == 4        # ep splits the batch too
    expert_buf = plan.buffers[w1.buffer]
    dense_buf = plan.buffers[plan.param("layers.0.moe.router.gate.weight").buffer]
    assert expert_buf.axes == ("dp",) and "ep" not in expert_buf.replica_axes
    assert dense_buf.axes == ("dp", "ep")
    # rank 3 (dp=1, ep=1) holds experts 2..3 (ep rank 1's block), of which expert 3 (sharded over dp)
    chunked = sp.plan(moe.build("tiny"), moe.rules_for(mesh), mesh, units=moe.UNITS, layout="chunked")
    assert chunked.local_slices("layers.0.moe.experts.w1", 3)[0] == slice(3, 4)
    assert sp.Plan.from_json(plan.to_json()) == plan
    assert plan.comm_bytes()["expert_parallel"] is None                   # not traced: not estimated
    x = torch.randint(0, 256, (4, 16))
    traced = sp.plan(moe.build("tiny"), moe.rules_for(mesh), mesh, units=moe.UNITS, trace=(x, x))
    # 2 layers x 4 all-to-alls x 64 tokens x top-2 x 64 wide x fp32, half of it leaves the rank
    assert traced.comm_bytes()["expert_parallel"] == 2 * 4 * 64 * 2 * 64 * 4 // 2
    assert "expert all-to-all 128.00 KiB" in str(traced) and "2 of 4 experts per rank" in str(traced)


def test_all_to_alls_are_in_the_schedule_and_the_forecast():
    mesh = sp.Mesh(dp=2, ep=2)
    x = torch.randint(0, 256, (4, 16))
    plan = sp.plan(moe.build("tiny"), moe.rules_for(mesh), mesh, units=moe.UNITS, trace=(x, x), min_unit_bytes=0)
    a2a = [o for o in plan.ops() if o.kind == "all_to_all"]
    # per layer: dispatch and combine in forward, their gradients back in backward (later layer first);
    # each op: 64 tokens x top-2 x 64 wide x fp32 leave for their experts
    assert [(o.event, o.at, o.unit, o.axes) for o in a2a] == \
        [("module_forward", "layers.0.moe.experts", "layers.0", ("ep",))] * 2 + \
        [("module_forward", "layers.1.moe.experts", "layers.1", ("ep",))] * 2 + \
        [("module_backward", "layers.1.moe.experts", "layers.1", ("ep",))] * 2 + \
        [("module_backward", "layers.0.moe.experts", "layers.0", ("ep",))] * 2
    assert {o.bytes for o in a2a} == {64 * 2 * 64 * 4} and all(o.what == "activations" for o in a2a)
    assert sum(o.bytes // 2 for o in a2a) == plan.comm_bytes()["expert_parallel"]
    f = plan.forecast("h100-8x-ib400", batch=(4, 16))
    assert f.comm_bytes() == plan.comm_bytes()
    tokens = [c for c in f.collectives if c.what == "tokens"]
    assert len(tokens) == 8 and all(c.kind == "all_to_all" and c.alone_s > 0 for c in tokens)
    assert sp.Plan.from_json(plan.to_json()) == plan
    # not traced: the ops are placed, their size unknown (and the forecast leaves them out, as the plan does)
    untraced = sp.plan(moe.build("tiny"), moe.rules_for(mesh), mesh, units=moe.UNITS, min_unit_bytes=0)
    assert [o.bytes for o in untraced.ops() if o.kind == "all_to_all"] == [0] * 8
    g = untraced.forecast("h100-8x-ib400", batch=(4, 16))
    assert g.comm_bytes() == untraced.comm_bytes() and any("all-to-alls not forecast" in n for n in g.notes)
    # a hand-edited schedule is checked: an all-to-all of a module that has no experts, or over another axis
    import dataclasses
    i = next(i for i, o in enumerate(plan.schedule) if o.kind == "all_to_all")
    for bad in (dict(at="layers.0.attention"), dict(axes=("dp",))):
        edited = list(plan.schedule)
        edited[i] = dataclasses.replace(edited[i], **bad)
        with pytest.raises(sp.PlanError, match="all_to_all|all-to-alls"):
            plan.with_schedule(edited)
    # one rank of ep: nothing moves, no op
    one = sp.plan(moe.build("tiny"), moe.rules_for(sp.Mesh(dp=2, ep=1)), sp.Mesh(dp=2, ep=1), units=moe.UNITS)
    assert not any(o.kind == "all_to_all" for o in one.schedule)


def test_errors_name_the_fix():
    m = moe.build("tiny")
    with pytest.raises(sp.SpecError, match=r"4 experts.*do not divide.*size 3.*\[1, 2, 4\]"):
        sp.plan(m, [(r".*experts\.w\d", sp.P("ep")), (r".*", sp.P())], sp.Mesh(ep=3))
    with pytest.raises(sp.SpecError, match=r"dimension 1.*dimension 0 holds.*4 experts.*Write P\('ep'\)"):
        sp.plan(m, [(r".*experts\.w\d", sp.P(None, "ep")), (r".*", sp.P())], sp.Mesh(ep=2))
    with pytest.raises(sp.SpecError, match=r"must come first.*P\(\('ep', 'dp'\)"):
        sp.plan(m, [(r".*experts\.w\d", sp.P(("dp", "ep"))), (r".*", sp.P())], sp.Mesh(dp=2, ep=2))
    with pytest.raises(sp.SpecError, match=r"split alike"):
        sp.plan(m, [(r".*experts\.w1", sp.P("ep")), (r".*", sp.P())], sp.Mesh(ep=2))
    # a dense parameter may be ZeRO-sharded over ep: for it ep is a data axis
    plan = sp.plan(m, [(r".*", sp.P("ep"))], sp.Mesh(ep=2))
    assert plan.param("layers.0.attention.wq.weight").compute is None


def test_hf_mixtral_plans_with_experts_over_ep(capsys):
    pytest.importorskip("transformers")
    from shardplan.cli import main
    rc = main(["plan", "hf:" + os.path.join(ROOT, "examples/hf/mixtral_8x7b.json"), "--mesh", "dp=8,ep=8", "--summary"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "expert axis ep: 32 expert modules, 1 of 8 experts per rank" in out
    assert "expert all-to-all not estimated" in out
    # traced: 32 layers x 4 all-to-alls x 4096 tokens x top-2 x 4096 wide x bf16, 7/8 of it leaves the rank
    rc = main(["plan", "hf:" + os.path.join(ROOT, "examples/hf/mixtral_8x7b.json"), "--mesh", "dp=8,ep=8", "--summary",
               "--dtype", "bf16", "--trace-tokens", "1x4096"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"expert all-to-all {32 * 4 * 4096 * 2 * 4096 * 2 * 7 // 8 / 2**30:.2f} GiB" in out   # 7.00 GiB


# -- training ----------------------------------------------------------------------------------------------

def _route_all_to_first_experts(model):
    """Every token to experts 0 and 1 (both on ep rank 0); the router still takes gradients."""
    def forward(self, x):
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        index = torch.tensor([0, 1]).expand(x.shape[0], 2)
        w = probs[:, :2]
        return probs, w / w.sum(-1, keepdim=True), index
    for layer in model.layers:
        layer.moe.router.forward = forward.__get__(layer.moe.router)


def _train(rank, world, meshes, skew):
    out = []
    for text in meshes:
        mesh = sp.Mesh.parse(text)
        model, ref = moe.build("tiny").init_weights(0), moe.build("tiny").init_weights(0)
        if skew:
            _route_all_to_first_experts(model)
            _route_all_to_first_experts(ref)
        plan = sp.plan(model, moe.rules_for(mesh), mesh, units=moe.UNITS, min_unit_bytes=0)
        sp.shard(model, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1)
        losses, ref_losses = [], []
        for _ in range(3):
            x = torch.randint(0, 256, (8, 16), generator=g)
            xs = x.chunk(plan.data_size)[plan.data_index(rank)]
            loss = model(xs, xs)
            loss.backward()
            sp.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            torch.distributed.all_reduce(t)
            losses.append(t.item() / world)
            r = ref(x, x)
            r.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(r.item())
        with sp.record_ops(model) as ops:                      # the all-to-alls are recorded where the plan has them
            model(xs, xs).backward()
        recorded = (ops == list(plan.ops()), sum(o.kind == "all_to_all" for o in ops))
        full = sp.full_state_dict(model)
        diff = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()) if rank == 0 else 0.0
        out.append((text, losses, ref_losses, diff, recorded))
    return out


@pytest.mark.timeout(300)
def test_ep_at_4_ranks_equals_one_process():
    for results in run(_train, 4, ["dp=2,ep=2", "ep=4"], False):
        for text, losses, ref_losses, diff, (same, n) in results:
            assert losses == pytest.approx(ref_losses, abs=1e-5), text
            assert diff < 1e-5, text
            assert same and n == 2 * 4, text            # 2 layers x (dispatch, combine) x (forward, backward)


@pytest.mark.timeout(300)
def test_ep_at_2_ranks_with_every_token_routed_to_one_rank():
    for results in run(_train, 2, ["ep=2"], True):
        for text, losses, ref_losses, diff, _ in results:
            assert losses == pytest.approx(ref_losses, abs=1e-5), text
            assert diff < 1e-5, text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_moe_example_meshes_equal_one_process(tmp_path):
    from example_runs import losses
    one = losses(tmp_path, 1, "examples/train_moe.py", "--steps", "5")
    assert len(one) == 5 and one[-1] < one[0]
    assert losses(tmp_path, 4, "examples/train_moe.py", "--steps", "5", "--mesh", "dp=2,ep=2") == pytest.approx(one, abs=1e-5)
    assert losses(tmp_path, 4, "examples/train_moe.py", "--steps", "5", "--mesh", "ep=4") == pytest.approx(one, abs=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cp_ep_overhead_benchmark_runs_tiny(tmp_path):
    """benchmarks/cp_ep_overhead.py at toy size: every system takes the path it names (the script checks)
    and computes the same losses."""
    import json
    import subprocess
    out = tmp_path / "cp_ep.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cp_ep_overhead.py"), "--batch", "2", "--seq",
                        "32", "--steps", "2", "--warmup", "1", "--rounds", "2", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=280,
                       env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), CUDA_VISIBLE_DEVICES="",
                                OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert set(d["models"]) == {"gpt", "moe"} and all(m["losses_agree"] for m in d["models"].values())
    assert set(d["models"]["gpt"]["ratios"]) == {"cp1/plain", "cp1_forced/plain_forced"}
    assert set(d["models"]["moe"]["ratios"]) == {"ep1/plain", "ep1_forced/plain_forced"}
