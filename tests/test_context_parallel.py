"""Context parallelism: sequences split over ``cp`` in load-balanced chunks, keys and values all-gathered for
attention; per-step losses equal one process's at 4 ranks, and bad inputs get errors naming the fix."""

from __future__ import annotations

import collections
import os
import re
import sys

import pytest
import torch

import shardplan as sp
from distributed import run

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import gpt  # noqa: E402
import gpt_rules  # noqa: E402
import gpt_rules_tp  # noqa: E402


def _plan_for(model, text, trace=None):
    """``dp=..,cp=..``: ZeRO over the data axes and cp; with ``tp``: gpt_rules_tp's rules over them."""
    mesh = sp.Mesh.parse(text)
    if "tp" not in mesh.axis_names:
        return sp.plan(model, gpt_rules.rules_over(mesh), mesh, units=gpt_rules.UNITS, min_unit_bytes=0, trace=trace)
    data = tuple(a for a in mesh.axis_names if a != "tp")
    return sp.plan(model, gpt_rules_tp.tp_rules(data=data), mesh, units=gpt_rules_tp.UNITS, min_unit_bytes=0,
                   compute_axes=gpt_rules_tp.compute_axes, trace=trace)


def test_positions_are_balanced_chunks_of_the_full_sequence():
    CP = sp.context_parallel
    assert CP.positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert CP.positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([CP.positions(16, 4, i) for i in range(4)])
    assert sorted(every.tolist()) == list(range(16))
    with pytest.raises(sp.ShardingError, match=r"not divisible by 2\*cp = 8.*e\.g\. 16"):
        CP.positions(12, 4, 0)


def test_cp_ranks_share_the_batch_and_parameters_shard_over_dp_and_cp():
    mesh = sp.Mesh(dp=2, cp=2)
    plan = sp.plan(gpt.build("tiny"), gpt_rules.rules_over(mesh), mesh, units=gpt_rules.UNITS)
    assert plan.data_axes == ("dp",) and plan.data_size == 2
    assert plan.data_index(0) == plan.data_index(1) == 0 and plan.data_index(2) == 1
    assert all(b.axes == ("dp", "cp") for b in plan.buffers if b.sharded)   # ZeRO over dp x cp
    x = torch.arange(4 * 8).view(4, 8)
    xs, pos = sp.context_parallel.shard_batch(plan, 3, x)                   # dp index 1, cp index 1
    assert pos.tolist() == [2, 3, 4, 5] and xs.tolist() == x[2:4, 2:6].tolist()


def test_traced_plan_schedules_and_counts_the_kv_traffic():
    mesh = sp.Mesh(dp=2, cp=2)
    x = torch.randint(0, 256, (2, 16))                     # one rank's input: 16 of each sequence's 32 tokens
    plan = sp.plan(gpt.build("tiny"), gpt_rules.rules_over(mesh), mesh, units=gpt_rules.UNITS, trace=(x, x),
                   min_unit_bytes=0)
    kv = [o for o in plan.ops() if o.in_module and o.axes == ("cp",)]
    # per layer: K and V all-gathered in forward, their gradients reduce-scattered in backward, inside the
    # unit of the layer; each op carries the gathered tensor: 2 x 4 heads x 32 tokens x 16 wide x fp32
    assert [(o.kind, o.event, o.at, o.unit) for o in kv] == \
        [("all_gather", "module_forward", "layers.0.attention", "layers.0")] * 2 + \
        [("all_gather", "module_forward", "layers.1.attention", "layers.1")] * 2 + \
        [("reduce_scatter", "module_backward", "layers.1.attention", "layers.1")] * 2 + \
        [("reduce_scatter", "module_backward", "layers.0.attention", "layers.0")] * 2
    assert {o.bytes for o in kv} == {2 * 4 * 32 * 16 * 4}
    assert plan.comm_bytes()["context_parallel"] == 8 * 16384 // 2        # half of each leaves the rank
    assert len([o for o in plan.ops(recompute=True) if o.axes == ("cp",)]) == 12   # recompute re-gathers
    assert "context-parallel keys/values 64.00 KiB" in str(plan) and "2 attention calls traced" in str(plan)
    f = plan.forecast("h100-8x-ib400", batch=(2, 16))
    assert f.comm_bytes() == plan.comm_bytes()
    assert sum(c.what == "kv" and c.alone_s > 0 for c in f.collectives) == 8
    assert f.tokens_per_step == 2 * 16 * 2 * 2                           # batch x local tokens x dp x cp
    import dataclasses
    i = next(i for i, o in enumerate(plan.schedule) if o.axes == ("cp",))
    for bad, says in ((dict(at="layers.0.feed_forward"), "no traced attention call"),
                      (dict(kind="reduce_scatter"), "all-gathered at module_forward")):
        edited = list(plan.schedule)
        edited[i] = dataclasses.replace(edited[i], **bad)
        with pytest.raises(sp.errors.PlanError, match=says):                  # hand-edited schedules are checked
            plan.with_schedule(edited)
    back = sp.Plan.from_json(plan.to_json())
    assert back == plan and back.mesh.axis_names == ("dp", "cp")          # the axis order survives JSON
    untraced = sp.plan(gpt.build("tiny"), gpt_rules.rules_over(mesh), mesh, units=gpt_rules.UNITS)
    assert untraced.comm_bytes()["context_parallel"] is None and "keys/values not estimated" in str(untraced)
    assert not any(o.in_module for o in untraced.schedule)


@pytest.mark.slow  # a 70B trace; CP plans: the fast cases above
def test_cli_plans_llama3_70b_with_cp_and_tp(capsys):
    from shardplan.cli import main
    root = os.path.join(os.path.dirname(__file__), "..")
    rc = main(["plan", os.path.join(root, "examples/gpt.py") + ":llama3_70b", "--mesh", "dp=8,cp=4,tp=8", "--rules",
               os.path.join(root, "examples/gpt_rules_tp.py") + ":cp_rules", "--dtype", "bf16", "--trace-tokens",
               "1x2048", "--summary"])
    out = capsys.readouterr().out
    assert rc == 0, out
    # 80 layers x (K, V) x (all-gather, reduce-scatter) x [1, 64/8 heads, 4 x 2048 tokens, 128] bf16, 3/4 sent
    assert f"context-parallel keys/values {80 * 4 * 8 * 8192 * 128 * 2 * 3 // 4 / 2**30:.2f} GiB" in out  # 3.75 GiB
    assert "context axis cp=4" in out and "80 attention calls traced" in out and "axes=dp,cp" in out
    assert "the batch is split 8 ways over dp" in out


class _MaskedAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        q = self.proj(x).view(x.shape[0], 1, x.shape[1], 8)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_attention_cp_cannot_run_is_refused_at_plan_time():
    m = _MaskedAttention()
    rules = [(r".*", sp.P(("dp", "cp")))]
    with pytest.raises(sp.errors.PlanError, match=r"attention in 'the root module' passes an attn_mask.*is_causal=True"):
        sp.plan(m, rules, sp.Mesh(dp=1, cp=2), trace=torch.zeros(1, 4, 8))
    sp.plan(m, rules, sp.Mesh(dp=2, cp=1), trace=torch.zeros(1, 4, 8))       # cp=1: nothing to honour
    # attention that does not come through sp.context_parallel.attention would see its own chunks only
    direct = _MaskedAttention()
    direct.forward = lambda x: torch.nn.functional.scaled_dot_product_attention(
        *[direct.proj(x).view(x.shape[0], 1, x.shape[1], 8)] * 3, is_causal=True)
    with pytest.raises(sp.errors.PlanError, match=r"calls F.scaled_dot_product_attention itself.*sp.context_parallel.attention"):
        sp.plan(direct, rules, sp.Mesh(dp=1, cp=2), trace=torch.zeros(1, 4, 8))
    gpt_model = gpt.build("tiny")
    mesh = sp.Mesh(cp=2)
    x = torch.randint(0, 256, (1, 7))
    with pytest.raises(sp.errors.PlanError, match=r"7 tokens.*\(14\) is not divisible by 2\*cp = 4"):
        sp.plan(gpt_model, gpt_rules.rules_over(mesh), mesh, units=gpt_rules.UNITS, trace=(x, x))


def _train(rank, world, meshes):
    out = []
    for text in meshes:
        model, ref = gpt.build("tiny").init_weights(0), gpt.build("tiny").init_weights(0)
        shape = sp.Mesh.parse(text).shape
        local = torch.zeros(4 // shape.get("dp", 1), 32 // shape.get("cp", 1), dtype=torch.long)
        plan = _plan_for(model, text, trace=(local, local))    # traced: the K/V ops are in the schedule
        sp.shard(model, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1)
        losses, ref_losses = [], []
        for _ in range(3):
            x = torch.randint(0, 256, (4, 32), generator=g)
            y = torch.roll(x, -1, 1)
            xs, ys, pos = sp.context_parallel.shard_batch(plan, rank, x, y)
            loss = model(xs, ys, positions=pos)
            loss.backward()
            sp.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            torch.distributed.all_reduce(t)
            losses.append(t.item() / world)
            r = ref(x, y)                 # plain: the cp group is bound to `model`, only while it runs
            r.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(r.item())
        with sp.record_ops(model) as ops:                       # attention() records the plan's K/V ops
            model(xs, ys, positions=pos).backward()
        opt.zero_grad()
        recorded = (ops == list(plan.ops()), collections.Counter(ops) == collections.Counter(plan.ops()),
                    sum(o.in_module and o.axes == ("cp",) for o in ops))
        q = torch.zeros(1, 1, 8, 4)
        mask = torch.ones(8, 8, dtype=torch.bool)
        for call, says in ((lambda: sp.context_parallel.attention(q, q, q, attn_mask=mask), "attn_mask"),
                           # a model's own F.scaled_dot_product_attention would attend over local chunks only
                           (lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True),
                            "called directly while context parallelism is on")):
            h = model.layers[0].register_forward_pre_hook(lambda *_, _c=call: _c() and None)  # inside its forward
            with pytest.raises(sp.errors.RuntimeShardingError, match=says):
                model(xs, ys, positions=pos)
            h.remove()
            assert call().shape == q.shape                      # outside the model's step: the plain call
        out.append((text, losses, ref_losses, recorded))
    # once the context-parallel model is gone, attention is plain again: nothing of it stays in the process
    import gc
    del model, opt
    gc.collect()
    q = torch.zeros(1, 1, 8, 4)
    assert sp.context_parallel.active() is None
    assert torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).shape == q.shape
    return out


@pytest.mark.timeout(300)
def test_cp_at_4_ranks_equals_one_process():
    for results in run(_train, 4, ["dp=2,cp=2", "cp=4"]):
        for text, losses, ref_losses, (same, _, n) in results:
            assert losses == pytest.approx(ref_losses, abs=1e-5), text
            assert same and n == 2 * 4, text          # record_ops: exactly the plan's ops, 2 layers x (K, V) x 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cp_with_tp_at_4_ranks_equals_one_process():
    for results in run(_train, 4, ["cp=2,tp=2", "tp=2,cp=2"]):
        for text, losses, ref_losses, (_, same_ops, n) in results:
            assert losses == pytest.approx(ref_losses, abs=1e-5), text
            # the plan lists a unit's tensor-parallel ops before its K/V ops, attention issues them between: the
            # same ops, in another order within the step
            assert same_ops and n == 2 * 4, text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_gpt_example_with_cp_equals_one_process(tmp_path):
    from example_runs import losses
    one = losses(tmp_path, 1, "examples/train_gpt.py", "--steps", "5")
    assert losses(tmp_path, 4, "examples/train_gpt.py", "--steps", "5", "--mesh", "dp=2,cp=2") == pytest.approx(one, abs=1e-5)


def _checkpointed_attention(model):
    """Each layer's attention under activation checkpointing, inside its module's forward: the recompute in
    backward calls attention() again with no module hook of the model running."""
    from torch.utils.checkpoint import checkpoint
    for layer in model.layers:
        inner = layer.attention.forward
        layer.attention.forward = lambda x, _f=inner: checkpoint(_f, x, use_reentrant=False)
    return model


def _bound_worker(rank, world):
    """A cp-sharded model and plain models in one process, no disabled(): the group is the cp model's."""
    from torch.nn.functional import scaled_dot_product_attention as bound_sdpa
    F = torch.nn.functional
    mesh = sp.Mesh(cp=world)
    model = _checkpointed_attention(gpt.build("tiny").init_weights(0))
    ref = gpt.build("tiny").init_weights(0)
    plan = sp.plan(model, gpt_rules.rules_over(mesh), mesh, units=gpt_rules.UNITS, min_unit_bytes=0)
    sp.shard(model, plan)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    q = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(5))
    want = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    out = {"plain": []}
    # a block of the cp model called on its own, on this rank's chunks: it attends over the whole sequence too
    h = torch.randn(1, 32, ref.layers[0].attention_norm.weight.shape[0], generator=torch.Generator().manual_seed(9))
    pos = sp.context_parallel.positions(32, world, rank)
    with torch.no_grad():
        out["block alone"] = (model.layers[0](h[:, pos]) - ref.layers[0](h)[:, pos]).abs().max().item()
    g = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(2):
        x = torch.randint(0, 256, (2, 32), generator=g)
        y = torch.roll(x, -1, 1)
        xs, ys, pos = sp.context_parallel.shard_batch(plan, rank, x, y)
        loss = model(xs, ys, positions=pos)
        # between the cp model's forward and its backward (which recomputes attention): plain, not refused
        out["plain"].append((F.scaled_dot_product_attention(q, q, q, is_causal=True) - want).abs().max().item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(sp.context_parallel.loss_mean(loss, model).item())
        r = ref(x, y)                      # a plain model after the cp model's step: whole sequences, no disabled()
        r.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(r.item())
        out["plain"].append((sp.context_parallel.attention(q, q, q, is_causal=True) - want).abs().max().item())
        out["plain"].append((F.scaled_dot_product_attention(q, q, q, is_causal=True) - want).abs().max().item())
    out["losses"] = (losses, ref_losses)
    out["active after"] = sp.context_parallel.active() is not None
    out["group"] = sp.context_parallel.group_of(model).size, sp.context_parallel.group_of(ref)
    # inside the cp model's forward, attention the model computes itself is refused (through F, or a name of its own)
    attn = model.layers[1].attention
    inner = attn.forward
    refused = {}
    for label, call in (("F", lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)),
                        ("bound", lambda: bound_sdpa(q, q, q, is_causal=True)),
                        ("disabled", lambda: _plain_inside(q))):
        attn.forward = lambda x, _c=call: (_c(), inner(x))[1]
        try:
            model(xs, ys, positions=pos).backward()
            refused[label] = "ran"
        except sp.errors.RuntimeShardingError as exc:
            refused[label] = str(exc)
        opt.zero_grad()
    attn.forward = inner
    out["refused"] = refused
    out["modes left"] = len(torch.overrides._get_current_function_mode_stack())
    out["after refusal"] = (F.scaled_dot_product_attention(q, q, q, is_causal=True) - want).abs().max().item()
    return out


def _plain_inside(q):
    with sp.context_parallel.disabled():
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


@pytest.mark.timeout(300)
def test_cp_group_is_the_models_not_the_process():
    """A plan with cp > 1 made F.scaled_dot_product_attention raise in the whole process (torch's function
    replaced by a guard) and every attention() context-parallel, until the model was collected: a plain
    reference model in the same process ran only inside disabled(). The group is now bound to the sharded
    model's forward and backward (an activation-checkpointed attention's recompute included): a plain model
    attends over its whole sequences before, between and after, and inside the cp model's forward the model's
    own attention is still refused, naming the fix."""
    for out in run(_bound_worker, 2):
        assert out["block alone"] < 1e-5, out["block alone"]  # a unit called directly binds the group too
        assert out["plain"] and max(out["plain"]) == 0.0, out["plain"]
        losses, ref_losses = out["losses"]
        assert losses == pytest.approx(ref_losses, abs=1e-5)       # the recompute in backward gathered K/V too
        assert not out["active after"] and out["group"] == (2, None)
        for label in ("F", "bound"):
            assert re.search(r"F.scaled_dot_product_attention was called directly while context parallelism is on "
                             r"\(cp=2\).*shardplan.context_parallel.attention\(q, k, v, is_causal=True\)",
                             out["refused"][label]), (label, out["refused"][label])
        assert out["refused"]["disabled"] == "ran"
        assert out["modes left"] == 0 and out["after refusal"] == 0.0


def test_one_backward_through_two_cp_models_refuses_a_recompute_it_cannot_attribute():
    """Two context-parallel models (each its own cp group) whose outputs meet in one loss: one backward runs both.
    A checkpointed attention's recompute in it found its group by the graph task alone, which named one model for
    both: the other model's keys and values gathered over the wrong group, silently. It is refused now, naming
    the two models' groups and the fix; a backward through one model (or the same model twice) is unchanged."""
    from shardplan.runtime import collectives as C
    from shardplan.runtime import context_parallel as CP
    a, b = (CP.ContextGroup(C.Group(None, 2, 0)) for _ in range(2))
    seen = []

    class Recompute(torch.autograd.Function):  # stands in for a checkpointed unit recomputing its attention
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(CP.active())
            return g

    x = torch.ones(3, requires_grad=True)
    one = Recompute.apply(x) * 2
    CP._bind_backward(a, one)
    (one.sum() + (one * 3).sum()).backward()        # one model, its output used twice: its group
    assert seen == [a] and not CP._BACKWARD
    out_a, out_b = Recompute.apply(x) * 2, Recompute.apply(x) * 3
    CP._bind_backward(a, out_a)
    CP._bind_backward(b, out_b)
    with pytest.raises(sp.errors.RuntimeShardingError, match=r"(?s)two context-parallel models.*one backward"):
        (out_a.sum() + out_b.sum()).backward()
    CP._BACKWARD.clear()


# -- attention a cp plan cannot see, on models this project did not write ------------------------------------

transformers = pytest.importorskip("transformers")


def _llama(impl, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation=impl, use_cache=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


_LLAMA_RULES = [(r".*", sp.P(("dp", "cp")))]
_LLAMA_UNITS = [r"model\.layers\.\d+"]


def test_hf_attention_other_than_shardplan_cp_is_refused_at_plan_time():
    x = torch.zeros(2, 8, dtype=torch.long)
    pos = sp.context_parallel.positions(16, 2, 0)
    for impl in ("eager", "sdpa"):
        for trace in (None, ((), dict(input_ids=x, position_ids=pos[None]))):
            with pytest.raises(sp.errors.PlanError, match=rf"'<root>' \(LlamaForCausalLM\) attends with Hugging Face's "
                                                   rf"attention '{impl}'.*attn_implementation='shardplan_cp'"):
                sp.plan(_llama(impl), _LLAMA_RULES, sp.Mesh(dp=1, cp=2), units=_LLAMA_UNITS, trace=trace)
        sp.plan(_llama(impl), _LLAMA_RULES, sp.Mesh(dp=2, cp=1), units=_LLAMA_UNITS)      # cp=1: nothing split
    # a function of one's own under another name is refused too (it does not gather keys and values)
    transformers.AttentionInterface.register("mine", transformers.AttentionInterface._global_mapping["sdpa"])
    with pytest.raises(sp.errors.PlanError, match=r"attention 'mine'"):
        sp.plan(_llama("mine"), _LLAMA_RULES, sp.Mesh(dp=1, cp=2), units=_LLAMA_UNITS)
    name = sp.context_parallel.hf_attention()
    traced = sp.plan(_llama(name), _LLAMA_RULES, sp.Mesh(dp=1, cp=2), units=_LLAMA_UNITS, min_unit_bytes=0,
                     trace=((), dict(input_ids=x, position_ids=pos[None])))
    kv = [o for o in traced.ops() if o.in_module and o.axes == ("cp",)]
    # per layer K and V of the 2 key/value heads gathered (not repeated to the 4 query heads first), 16 tokens wide 8
    assert [o.at for o in kv[:2]] == ["model.layers.0.self_attn"] * 2 and {o.bytes for o in kv} == {2 * 2 * 16 * 8 * 4}
    # Hugging Face's labels= shifts each rank's chunks by one, across the chunk boundaries: refused, naming the fix
    with pytest.raises(sp.errors.PlanError, match=r"pad in the root module.*shift_labels="):
        sp.plan(_llama(name), _LLAMA_RULES, sp.Mesh(dp=1, cp=2), units=_LLAMA_UNITS,
                trace=((), dict(input_ids=x, position_ids=pos[None], labels=x)))


class _TorchEncoder(torch.nn.Module):
    """torch's own attention (nn.TransformerEncoderLayer: matmul-softmax inside multi_head_attention_forward)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 16)
        self.layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.out = torch.nn.Linear(16, 50)

    def forward(self, x):
        return self.out(self.layer(self.emb(x)))


class _EagerAttention(torch.nn.Module):
    """Hand-written eager attention (what Hugging Face's 'eager' computes): matmul, softmax, matmul."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 16)
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(self.emb(x)).chunk(3, -1)
        w = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
        return w @ v


def test_attention_the_plan_cannot_see_is_refused_at_plan_time():
    x = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(sp.errors.PlanError, match=r"multi_head_attention_forward in 'layer.self_attn' holds the keys.*"
                                           r"sp.context_parallel.attention"):
        sp.plan(_TorchEncoder(), [(r".*", sp.P("cp"))], sp.Mesh(cp=2), trace=x)
    with pytest.raises(sp.errors.PlanError, match=r"softmax in the root module.*sp.context_parallel.attention"):
        sp.plan(_EagerAttention(), [(r".*", sp.P("cp"))], sp.Mesh(cp=2), trace=x)
    sp.plan(_EagerAttention(), [(r".*", sp.P("dp"))], sp.Mesh(dp=2), trace=x)           # no cp: fine


def _guarded_worker(rank, world):
    """Untraced plans: what a cp plan cannot see is refused at the first step, on every rank."""
    mesh = sp.Mesh(dp=world // 2, cp=2)
    out = {}
    x = torch.randint(0, 50, (world // 2 * 2, 16), generator=torch.Generator().manual_seed(0))
    for label, model in (("encoder", _TorchEncoder()), ("eager", _EagerAttention())):
        plan = sp.plan(model, [(r".*", sp.P(("dp", "cp")))], mesh)
        sp.shard(model, plan)
        xs, pos = sp.context_parallel.shard_batch(plan, rank, x)
        try:
            model(xs).sum().backward()
            out[label] = "ran"
        except sp.errors.RuntimeShardingError as exc:
            out[label] = str(exc)
    name = sp.context_parallel.hf_attention()
    model = _llama(name)
    plan = sp.plan(model, _LLAMA_RULES, mesh, units=_LLAMA_UNITS)
    model.set_attn_implementation("eager")          # switched after planning: shard() sees it
    try:
        sp.shard(model, plan)
        out["switched"] = "ran"
    except sp.errors.RuntimeShardingError as exc:
        out["switched"] = str(exc)
    model = _llama(name)
    sp.shard(model, sp.plan(model, _LLAMA_RULES, mesh, units=_LLAMA_UNITS))
    ids = torch.randint(0, 97, (world // 2 * 2, 16), generator=torch.Generator().manual_seed(0))
    xs, pos = sp.context_parallel.shard_batch(plan, rank, ids)
    for label, kwargs in (("labels", dict(labels=xs, position_ids=pos[None])), ("no positions", {})):
        try:
            model(input_ids=xs, **kwargs)
            out[label] = "ran"
        except sp.errors.RuntimeShardingError as exc:
            out[label] = str(exc)
    return out


@pytest.mark.timeout(300)
def test_attention_the_plan_cannot_see_is_refused_at_the_first_step():
    for world in (2, 4):
        for got in run(_guarded_worker, world):
            assert re.search(r"multi_head_attention_forward in 'layer.self_attn'.*each rank holds 2 of 4 chunks",
                             got["encoder"]), got["encoder"]
            assert re.search(r"softmax in the root module.*sp.context_parallel.attention", got["eager"]), got["eager"]
            assert re.search(r"attends with Hugging Face's attention 'eager'", got["switched"]), got["switched"]
            assert re.search(r"pad in the root module.*shift_labels=", got["labels"]), got["labels"]
            # (Hugging Face numbers the chunks 0..T/cp-1 itself when position_ids are left out)
            assert re.search(r"got position_ids that are not this rank's positions", got["no positions"]), \
                got["no positions"]


def _hf_train(rank, world, text):
    name = sp.context_parallel.hf_attention()
    mesh = sp.Mesh.parse(text)
    model, ref, sdpa = _llama(name), _llama("sdpa"), _llama("sdpa")
    plan = sp.plan(model, _LLAMA_RULES, mesh, units=_LLAMA_UNITS, min_unit_bytes=0)
    sp.shard(model, plan)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    g = torch.Generator().manual_seed(3)
    losses, ref_losses = [], []
    for _ in range(3):
        ids = torch.randint(0, 97, (4, 16), generator=g)
        y = torch.roll(ids, -1, 1)                          # shifted over the whole sequences, then sharded
        xs, ys, pos = sp.context_parallel.shard_batch(plan, rank, ids, y)
        loss = model(input_ids=xs, position_ids=pos[None], labels=ys, shift_labels=ys).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = sp.context_parallel.loss_mean(loss)
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
        with sp.context_parallel.disabled():               # Hugging Face's sdpa, plain, in the same process
            r = ref(input_ids=ids, labels=y, shift_labels=y).loss
        r.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(r.item())
    # "shardplan_cp" outside context parallelism is Hugging Face's sdpa
    with sp.context_parallel.disabled():
        a = model_free = _llama(name)(input_ids=ids).logits
        b = sdpa(input_ids=ids).logits
    return losses, ref_losses, (a - b).abs().max().item(), model_free.shape


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hf_llama_with_shardplan_cp_attention_equals_one_process():
    for world, text in ((2, "dp=1,cp=2"), (4, "dp=2,cp=2")):
        for losses, ref_losses, plain_diff, _ in run(_hf_train, world, text):
            assert losses == pytest.approx(ref_losses, abs=1e-5), text
            assert plain_diff == 0.0
