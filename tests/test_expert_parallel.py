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
    assert plan.axis("ep").module("layers.0.moe.experts").local_experts == 2
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
        with pytest.raises(sp.errors.PlanError, match="all_to_all|all-to-alls"):
            plan.with_schedule(edited)
    # one rank of ep: nothing moves, no op
    one = sp.plan(moe.build("tiny"), moe.rules_for(sp.Mesh(dp=2, ep=1)), sp.Mesh(dp=2, ep=1), units=moe.UNITS)
    assert not any(o.kind == "all_to_all" for o in one.schedule)


def test_errors_name_the_fix():
    m = moe.build("tiny")
    with pytest.raises(sp.errors.SpecError, match=r"4 experts.*do not divide.*size 3.*\[1, 2, 4\]"):
        sp.plan(m, [(r".*experts\.w\d", sp.P("ep")), (r".*", sp.P())], sp.Mesh(ep=3))
    with pytest.raises(sp.errors.SpecError, match=r"dimension 1.*dimension 0 holds.*4 experts.*Write P\('ep'\)"):
        sp.plan(m, [(r".*experts\.w\d", sp.P(None, "ep")), (r".*", sp.P())], sp.Mesh(ep=2))
    with pytest.raises(sp.errors.SpecError, match=r"must come first.*P\(\('ep', 'dp'\)"):
        sp.plan(m, [(r".*experts\.w\d", sp.P(("dp", "ep"))), (r".*", sp.P())], sp.Mesh(dp=2, ep=2))
    with pytest.raises(sp.errors.SpecError, match=r"split alike"):
        sp.plan(m, [(r".*experts\.w1", sp.P("ep")), (r".*", sp.P())], sp.Mesh(ep=2))
    # a dense parameter may be ZeRO-sharded over ep: for it ep is a data axis
    plan = sp.plan(m, [(r".*", sp.P("ep"))], sp.Mesh(ep=2))
    assert plan.param("layers.0.attention.wq.weight").compute is None


@pytest.mark.slow  # a Mixtral-size plan; HF EP: test_hf_auto_rules_train_at_dp2_ep2_like_one_process
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
        full = sp.checkpoint.full_state_dict(model)
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


# -- Hugging Face MoE models: routers are dense, experts split over ep (issue 36) ----------------------------

HF_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def _hf_moe(kind, experts=4, hidden=64, seed=0):
    """A tiny Hugging Face MoE causal LM of ``kind`` (built from a config, nothing downloads), its matrices drawn
    from ``seed`` (routers too: some initialise them to zeros, which ties every routing decision)."""
    transformers = pytest.importorskip("transformers")
    base = dict(vocab_size=97, hidden_size=hidden, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2)
    torch.manual_seed(seed)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**base, num_local_experts=experts))
    elif kind == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **base, num_experts=experts, moe_intermediate_size=32, shared_expert_intermediate_size=32))
    elif kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**base, num_experts=experts,
                                                                             moe_intermediate_size=32))
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **base, n_routed_experts=experts, moe_intermediate_size=32, n_group=1, topk_group=1,
            first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    return model


def _routers(model):
    return [n for n, m in model.named_modules() if n.endswith("mlp.gate") and hasattr(m, "num_experts")]


@pytest.mark.parametrize("kind", HF_MOE)
def test_hf_routers_are_dense_and_the_documented_rules_plan(kind):
    """Issue 36: MixtralTopKRouter & co. (num_experts, an [E, H] weight) were taken for expert modules: the
    documented dense rule P(("dp", "ep")) was refused for them with a fix that then failed at run time."""
    model = _hf_moe(kind)
    routers = _routers(model)
    assert len(routers) == 2
    mesh = sp.Mesh(dp=2, ep=2)
    rules = [(r".*experts\.(gate_up|down)_proj", sp.P(("ep", "dp"))), (r".*", sp.P(("dp", "ep")))]
    plan = sp.plan(model, rules, mesh)
    assert [m.path for m in plan.axis("ep").modules] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    for r in routers:
        w = plan.param(r + ".weight")
        assert w.compute is None and w.shape == w.global_shape == (4, 64)      # dense: whole on every rank
        assert plan.buffers[w.buffer].axes == ("dp", "ep")                   # ZeRO over dp x ep, reduced over both
    up = plan.param("model.layers.0.mlp.experts.gate_up_proj")
    assert up.global_shape == (4, 64, 64) and up.shape == (2, 64, 64) and up.tp_axis == "ep"
    # the router may be replicated too, or carry ep first in its spec: for it ep is a data axis either way
    for spec in (sp.P(), sp.P(("ep", "dp"))):
        alt = sp.plan(model, [(r".*mlp\.gate\.weight", spec)] + rules, mesh)
        assert [m.path for m in alt.axis("ep").modules] == [m.path for m in plan.axis("ep").modules]
        assert alt.param(routers[0] + ".weight").compute is None


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_hf_experts_that_do_not_divide_over_ep_say_so(kind):
    """ep=3 with 8 experts: the experts do not divide (it used to suggest swapping the router's axes)."""
    model = _hf_moe(kind, experts=8)
    rules = [(r".*experts\.(gate_up|down)_proj", sp.P(("ep", "dp"))), (r".*", sp.P(("dp", "ep")))]
    with pytest.raises(sp.errors.SpecError, match=r"experts\.gate_up_proj.*8 experts, which do not divide over expert axis "
                                           r"'ep' of size 3.*\[1, 2, 4, 8\]") as exc:
        sp.plan(model, rules, sp.Mesh(dp=2, ep=3))
    assert "must come first" not in str(exc.value) and "mlp.gate'" not in str(exc.value)
    with pytest.raises(sp.errors.SpecError, match=r"auto_rules.*experts\.gate_up_proj.*8 experts.*do not divide.*size 3"
                                           r".*\[1, 2, 4, 8\]"):
        sp.auto_rules(model, sp.Mesh(dp=2, ep=3), min_shard_bytes=0)


def test_hf_auto_rules_keep_a_1_mib_router_dense():
    """auto_rules split routers over ep on their own once they reached min_shard_bytes (1 MiB: 64 experts x
    4096 hidden in fp32), which made the CLI write unrunnable plans for such configs."""
    with torch.device("meta"):
        model = _hf_moe("qwen3_moe", experts=64, hidden=4096)
    mesh = sp.Mesh(dp=2, ep=2)
    rules = sp.auto_rules(model, mesh)
    specs = sp.match(rules, model, mesh=mesh)
    for r in _routers(model):
        assert model.get_submodule(r).weight.numel() * 4 == 2 ** 20                 # at the threshold: sharded
        assert specs[r + ".weight"] == sp.P(("dp", "ep"))                           # ... as a dense parameter
    assert specs["model.layers.0.mlp.experts.gate_up_proj"] == sp.P(("ep", "dp"))
    plan = sp.plan(model, rules, mesh)
    assert [m.path for m in plan.axis("ep").modules] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert plan.param("model.layers.0.mlp.gate.weight").compute is None


def test_hf_expert_all_to_all_bytes_count_the_experts_only():
    """Traced, the routers' calls were counted as all-to-alls too (1.5x the bytes at top-2). Hand count: 2 layers
    x 4 all-to-alls x 32 tokens x top-2 x 64 wide x bf16, half of it leaves the rank (ep=2)."""
    model = _hf_moe("mixtral")
    x = torch.randint(0, 97, (2, 16))
    rules = [(r".*experts\.(gate_up|down)_proj", sp.P(("ep", "dp"))), (r".*", sp.P(("dp", "ep")))]
    plan = sp.plan(model, rules, sp.Mesh(dp=2, ep=2), trace=(x,), compute_dtype="bf16")
    assert plan.comm_bytes()["expert_parallel"] == 2 * 4 * 32 * 2 * 64 * 2 // 2
    a2a = [o for o in plan.ops() if o.kind == "all_to_all"]
    assert len(a2a) == 8 and {o.at for o in a2a} == {f"model.layers.{i}.mlp.experts" for i in range(2)}


def _hf_auto_step(rank, world, kinds, meshes):
    """Each model on each mesh under auto_rules (a small min_shard_bytes, so that routers and experts both
    cross it, as they do at the default 1 MiB on real configs): two SGD steps, the losses and the full
    parameters against one process's; the ops recorded against the plan's."""
    import copy
    out = []
    for kind in kinds:
        for text in meshes:
            mesh = sp.Mesh.parse(text)
            model = _hf_moe(kind)
            ref = copy.deepcopy(model)
            rules = sp.auto_rules(model, mesh, min_shard_bytes=1024)
            plan = sp.plan(model, rules, mesh, min_unit_bytes=0)
            routers = {r + ".weight": (rules.find(r + ".weight").spec != sp.P(), plan.param(r + ".weight").compute)
                       for r in _routers(model)}   # [Note: a P does not survive pickling: plain values back]
            sp.shard(model, plan)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
            g = torch.Generator().manual_seed(1)
            losses, ref_losses = [], []
            for _ in range(2):
                x = torch.randint(0, 97, (8, 12), generator=g)
                xs = x.chunk(plan.data_size)[plan.data_index(rank)]
                loss = model(input_ids=xs, labels=xs).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                t = loss.detach().clone()
                torch.distributed.all_reduce(t)
                losses.append(t.item() / world)
                r = ref(input_ids=x, labels=x).loss
                r.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                ref_losses.append(r.item())
            with sp.record_ops(model) as ops:
                model(input_ids=xs, labels=xs).loss.backward()
            recorded = (ops == list(plan.ops()), sum(o.kind == "all_to_all" for o in ops))
            full = sp.checkpoint.full_state_dict(model)
            diff = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()) if rank == 0 \
                else 0.0
            experts = [m.path for m in plan.axis("ep").modules]
            out.append((kind, text, losses, ref_losses, diff, recorded, routers, experts))
    return out


def _check_hf_auto(results):
    for kind, text, losses, ref_losses, diff, (same, n), routers, experts in results:
        where = (kind, text)
        assert experts == [f"model.layers.{i}.mlp.experts" for i in range(2)], where
        assert routers and all(sharded and compute is None for sharded, compute in routers.values()), where
        assert losses == pytest.approx(ref_losses, abs=1e-5), where
        assert diff < 1e-5, where
        assert same and n == 2 * 4, where     # 2 layers x (dispatch, combine) x (forward, backward)


@pytest.mark.timeout(400)
def test_hf_auto_rules_train_at_dp2_ep2_like_one_process():
    """Mixtral and Qwen3-MoE under auto_rules on Mesh(dp=2, ep=2): the routers sharded as dense parameters, the
    experts split over ep, Hugging Face's experts modules dispatching their tokens; the same losses and
    parameters as one process after two SGD steps."""
    for results in run(_hf_auto_step, 4, ["mixtral", "qwen3_moe"], ["dp=2,ep=2"], timeout=380):
        _check_hf_auto(results)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hf_auto_rules_train_at_ep2_like_one_process():
    """Qwen2-MoE (a shared expert and its gate beside the routed ones) and DeepSeek-V3 (grouped routing, an
    fp32 router with a correction bias) at 2 ranks."""
    for results in run(_hf_auto_step, 2, ["qwen2_moe", "deepseek_v3"], ["ep=2"], timeout=380):
        _check_hf_auto(results)
