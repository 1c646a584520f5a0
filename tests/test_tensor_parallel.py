"""Tensor parallelism from the same specs: compute axes in the plan (styles, shapes, boxes, bytes, errors)
and in training (parity with one process on a 2-D and a 1-D mesh, every strategy, GPT and a Hugging Face
Llama, clipping, accumulation, checkpoints across parallelisms), on real gloo groups of 4."""

from __future__ import annotations

import json
import re
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import shardplan as sp
from distributed import run
from shardplan.planner.geometry import replicas

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import gpt  # noqa: E402
import gpt_rules  # noqa: E402
import gpt_rules_tp  # noqa: E402

STRATEGIES = ("optim_grads_params", "optim_grads", "optim", "no_shard")
# Adam divides by sqrt(v) + eps: at torch's 1e-8, fp32 rounding differences of 1e-10 in near-zero gradients
# (tensor parallelism sums partial products in another order) would move parameters by 1e-4. At 1e-6 the
# comparison stays a test of the gradients, at atol 1e-5.
LR, EPS, CLIP = 1e-2, 1e-6, 0.5
TP = dict(compute_axes=("tp",), units=gpt_rules_tp.UNITS, min_unit_bytes=0)


def _data(n=4, batch=4, seq=16, vocab=96, seed=1):  # tokens both models know
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(n)]


# -- the planner ------------------------------------------------------------------------------------

def test_styles_inferred_from_specs():
    plan = sp.plan(gpt.build("tiny", tie_embeddings=False), gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2), **TP)
    styles = {m.path: (m.kind, m.style) for m in plan.axis("tp").modules}
    assert styles["layers.0.attention.wq"] == ("linear", "colwise")      # a row-parallel sibling: output stays sharded
    assert styles["layers.0.attention.wo"] == ("linear", "rowwise")
    assert styles["layers.1.feed_forward.w2"] == ("linear", "rowwise")
    assert styles["output"] == ("linear", "colwise_gather")              # LM head: no row-parallel sibling
    assert styles["tok_embeddings"] == ("embedding", "rowwise")          # vocabulary-parallel
    assert "pos_embeddings" not in styles and "norm" not in styles
    every = sp.plan(_Styles(), STYLES_RULES, sp.Mesh(dp=2, tp=2), compute_axes="tp")  # the parity test's model
    assert {m.path: m.style for m in every.axis("tp").modules} == {
        "emb": "colwise_gather", "pairs.0.up": "colwise", "pairs.0.down": "rowwise", "pairs.1.up": "colwise",
        "pairs.1.down": "rowwise", "split.proj": "rowwise_split", "head.proj": "colwise_gather"}
    wq = plan.param("layers.0.attention.wq.weight")
    assert (wq.global_shape, wq.shape, wq.tp_dim, wq.tp_axis) == ((64, 64), (32, 64), 0, "tp")
    wo = plan.param("layers.0.attention.wo.weight")
    assert (wo.global_shape, wo.shape, wo.tp_dim) == ((64, 64), (64, 32), 1)
    table = str(plan)
    assert "tp-local shape" in table and "compute axes tp" in table
    row = next(line for line in table.splitlines() if line.startswith("layers.0.attention.wq.weight"))
    local = "(" + ", ".join(map(str, plan.local_shape("layers.0.attention.wq.weight", 0))) + ")"
    assert row.split()[1:3] == ["(64,", "64)"] and "(32, 64)" in row and local in row  # global, tp-local, shard
    assert plan.data_axes == ("dp",) and plan.data_size == 2
    assert [plan.data_index(r) for r in range(4)] == [0, 0, 1, 1]
    # explicit styles override the inference; the plan round-trips and rebuilds from its declarative form
    forced = sp.plan(gpt.build("tiny", tie_embeddings=False), gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2),
                     styles=[(r"output", "colwise")], **TP)
    assert forced.axis("tp").module("output").style == "colwise"
    again = sp.Plan.from_json(plan.to_json())
    assert again.fingerprint() == plan.fingerprint() and again.axis("tp") == plan.axis("tp")
    model = gpt.build("tiny", tie_embeddings=False)
    assert sp.plan(model, **plan.declarative()).equivalent(plan)


def test_hf_llama_styles_and_70b_memory():
    transformers = pytest.importorskip("transformers")
    plan = sp.plan(_llama(transformers, 2), LLAMA_RULES, sp.Mesh(dp=2, tp=2), compute_axes="tp")
    styles = {m.path.split(".")[-1]: m.style for m in plan.axis("tp").modules}
    assert styles == {"embed_tokens": "rowwise", "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise",
                      "o_proj": "rowwise", "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise",
                      "lm_head": "colwise_gather"}
    assert plan.param("lm_head.weight").name == "model.embed_tokens.weight"  # tied: one DTensor for both modules
    # memory counts tensor-parallel-local storage: 70B at dp=16 x tp=8 holds what dp=128 would
    model = _meta(gpt.llama_70b)
    fsdp_tp = sp.plan(model, gpt_rules_tp.rules, sp.Mesh(dp=16, tp=8), compute_axes=("tp",))
    fsdp = sp.plan(model, gpt_rules.rules, sp.Mesh(dp=128))
    assert abs(fsdp_tp.memory().params / fsdp.memory().params - 1) < 0.01
    local = sum(torch.Size(fsdp_tp.local_shape(p.name, 5)).numel() * 4 for p in fsdp_tp.params)
    per_buffer = sum(b.shard_numel * b.itemsize for b in fsdp_tp.buffers)
    assert fsdp_tp.memory(5).params == per_buffer >= local


def _meta(fn):
    with torch.device("meta"):
        return fn()


class _MLP(nn.Module):
    def __init__(self, d=8, h=16, bias=True):
        super().__init__()
        self.up = nn.Linear(d, h, bias=bias)
        self.down = nn.Linear(h, d, bias=bias)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def test_comm_bytes_estimated_only_when_traced():
    rules = [(r"up\.weight", sp.P(("tp", "dp"))), (r"down\.weight", sp.P("dp", "tp")), (r".*", sp.P())]
    mesh = sp.Mesh(dp=2, tp=2)
    untraced = sp.plan(_MLP(), rules, mesh, compute_axes="tp")
    assert untraced.comm_bytes()["tensor_parallel"] is None
    assert "not estimated" in str(untraced)
    x = torch.randn(3, 5, 8, requires_grad=True)
    traced = sp.plan(_MLP(), rules, mesh, compute_axes="tp", trace=x)
    # colwise up: backward all-reduce of its input (3*5*8 fp32); rowwise down: forward all-reduce of its output
    # (3*5*8); a ring all-reduce over 2 ranks sends 2*(n-1)/n = 1x the tensor
    assert traced.comm_bytes()["tensor_parallel"] == 2 * 3 * 5 * 8 * 4
    # an input that takes no gradient (the model's data) has none to reduce: the trace knows
    no_grad_input = sp.plan(_MLP(), rules, mesh, compute_axes="tp", trace=x.detach())
    assert no_grad_input.comm_bytes()["tensor_parallel"] == 3 * 5 * 8 * 4
    assert traced.comm_bytes()["total"] == untraced.comm_bytes()["total"] + 2 * 3 * 5 * 8 * 4
    ups = {m.path: m.style for m in traced.axis("tp").modules}
    assert ups == {"up": "colwise", "down": "rowwise"}
    # the bias follows its weight: column-parallel bias sharded on dim 0, row-parallel bias replicated
    assert traced.param("up.bias").tp_dim == 0 and traced.param("down.bias").tp_dim == -1


@pytest.mark.parametrize("rules, axes, error, words", [
    ([(r"norm\.weight", sp.P("tp")), (r".*", sp.P())], "tp", sp.errors.PlanError, ["norm.weight", "LayerNorm", "#0", "keep 'tp' out"]),
    ([(r"up\.weight", sp.P(("dp", "tp"))), (r".*", sp.P())], "tp", sp.errors.SpecError, ["up.weight", "must come first", "P(('tp', 'dp'))"]),
    ([(r"up\.weight", sp.P("tp")), (r".*", sp.P())], "tp", sp.errors.SpecError, ["up.weight", "not divisible", "16"]),
    ([(r"down\.bias", sp.P("tp")), (r"down\.weight", sp.P(None, "tp")), (r".*", sp.P())], "tp", sp.errors.PlanError,
     ["down.bias", "row-parallel", "replicated"]),
    ([(r"up\.weight", sp.P("tp", "dp")), (r".*", sp.P())], "cp", sp.errors.PlanError, ["'cp'", "Mesh("]),
])
def test_impossible_specs_raise_at_plan_time(rules, axes, error, words):
    mesh = sp.Mesh(dp=2, tp=3) if "not divisible" in words else sp.Mesh(dp=2, tp=2)
    with pytest.raises(error) as exc:
        sp.plan(_MLP(), rules, mesh, compute_axes=axes)
    for w in words:
        assert w in str(exc.value), (w, str(exc.value))


def test_style_errors_name_the_fix():
    rules = [(r"up\.weight", sp.P("tp")), (r".*", sp.P())]
    with pytest.raises(sp.errors.PlanError, match="unknown style 'diagonal'"):
        sp.plan(_MLP(), rules, sp.Mesh(dp=2, tp=2), compute_axes="tp", styles={"up": "diagonal"})
    with pytest.raises(sp.errors.PlanError, match="shards a linear weight on dim 1"):
        sp.plan(_MLP(), rules, sp.Mesh(dp=2, tp=2), compute_axes="tp", styles={"up": "rowwise"})
    with pytest.raises(sp.errors.PlanError, match="needs an nn.Module"):
        sp.plan({"w": torch.zeros(4, 4)}, [(r".*", sp.P("tp"))], sp.Mesh(dp=2, tp=2), compute_axes="tp")


@settings(max_examples=40, deadline=None)
@given(out=st.integers(1, 4), inp=st.integers(1, 5), tp=st.sampled_from([1, 2, 4]), dp=st.sampled_from([1, 2, 3]),
       col=st.sampled_from(["P(('tp','dp'))", "P('tp','dp')", "P('tp')"]),
       row=st.sampled_from(["P('dp','tp')", "P(None,('tp','dp'))", "P(None,'tp')"]),
       strategy=st.sampled_from(STRATEGIES), replica=st.sampled_from([1, 2]))
def test_every_element_held_by_its_replicas_and_gathers_back(out, inp, tp, dp, col, row, strategy, replica):
    """local_slices is the exact global box across storage and compute axes: over all ranks, each element is
    held by exactly ``replicas(plan, name)`` ranks, and assembling every rank's shard_tree gives the tensor back."""
    model = _MLP(d=inp * tp, h=out * tp)
    P = sp.P
    rules = [(r"up\.weight", eval(col)), (r"down\.weight", eval(row)), (r".*", P("dp"))]
    mesh = sp.Mesh(replica=replica, dp=dp, tp=tp)
    plan = sp.plan(model, rules, mesh, compute_axes=("tp",), strategy=strategy)
    full = {n: p.detach() for n, p in model.named_parameters()}
    for p in plan.params:
        count = torch.zeros(p.global_shape, dtype=torch.int32)
        for r in range(mesh.size):
            box = plan.local_slices(p.name, r)
            if box is not None:
                count[box] += 1
                assert tuple(s.stop - s.start for s in box) == plan.local_shape(p.name, r)
        assert (count == replicas(plan, p.name)).all(), p.name
    trees = {r: sp.shard_tree(full, plan, rank=r) for r in range(mesh.size)}
    back = sp.tree.assemble(plan, trees)
    assert all(torch.equal(back[n], full[n]) for n in full)


@pytest.mark.slow  # a 70B plan; TP plans: the fast cases
def test_cli_prints_a_70b_fsdp_by_tp_plan():
    from shardplan.cli import main
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["plan", "examples/gpt.py:llama_70b", "--mesh", "dp=16,tp=8", "--rules", "examples/gpt_rules_tp.py",
                   "--summary"])
    assert rc == 0
    text = buf.getvalue()
    assert "Mesh(dp=16, tp=8)" in text and "compute axes tp" in text and "linear rowwise over tp" in text
    assert "tensor-parallel activations not estimated" in text
    # --trace-tokens BxT traces on meta tensors: the CLI's figure is the API's with trace=
    args = ["plan", "examples/gpt.py:tiny", "--mesh", "dp=2,tp=2", "--rules", "examples/gpt_rules_tp.py", "--json"]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(args + ["--trace-tokens", "2x16"]) == 0
    traced = sp.plan(gpt.build("tiny"), gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2), **TP, trace=torch.zeros(2, 16, dtype=torch.long))
    got = json.loads(out.getvalue())["comm_bytes_per_step"]["tensor_parallel"]
    assert got == traced.comm_bytes()["tensor_parallel"] > 0
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(args + ["--trace-tokens", "2by16"]) == 2
    assert "expected BxT" in err.getvalue()


# -- training -----------------------------------------------------------------------------------------

LLAMA_RULES = [
    (r".*\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight", sp.P(("tp", "dp"))),   # column-parallel
    (r".*\.(o_proj|down_proj)\.weight", sp.P("dp", "tp")),                            # row-parallel
    (r"model\.embed_tokens\.weight", sp.P(("tp", "dp"))),                             # vocab-parallel, tied head
    (r".*", sp.P("dp")),
]


def _llama(transformers, kv_heads=2):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _gpt_loss(model, x, y):
    return model(x, y)


class _Styles(nn.Module):
    """Every style with biases: an embedding-parallel embedding (dim 1), a column/row pair, a lone row-parallel
    linear on a replicated input (rowwise_split) and a lone column-parallel one with gathered output."""

    class Pair(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.up, self.down, self.norm = nn.Linear(d, h), nn.Linear(h, d), nn.LayerNorm(d)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    class Lone(nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.proj = nn.Linear(d_in, d_out)

        def forward(self, x):
            return self.proj(torch.tanh(x))

    def __init__(self, vocab=96, d=8, h=16):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.pairs = nn.ModuleList([self.Pair(d, h), self.Pair(d, h)])
        self.split, self.head = self.Lone(d, d), self.Lone(d, vocab)

    def forward(self, x, y):
        h = self.emb(x)
        for pair in self.pairs:
            h = pair(h)
        logits = self.head(self.split(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _checkpointed(model, reentrant):
    from torch.utils.checkpoint import checkpoint
    for block in model.layers:
        block.forward = (lambda x, _f=block.forward: checkpoint(_f, x, use_reentrant=reentrant))
    return model


def _styles_loss(model, x, y):
    return model(x, y)


STYLES_RULES = [
    (r"emb\.weight", sp.P("dp", "tp")),                               # embedding-parallel (dim 1)
    (r"pairs\.\d+\.up\.(weight|bias)", sp.P(("tp", "dp"))),          # colwise, bias sharded with it
    (r"pairs\.\d+\.down\.weight", sp.P("dp", "tp")),                 # rowwise, bias replicated compute
    (r"split\.proj\.weight", sp.P("dp", "tp")),                       # rowwise_split: no colwise sibling
    (r"head\.proj\.(weight|bias)", sp.P(("tp", "dp"))),                # colwise_gather: no rowwise sibling
    (r".*", sp.P("dp")),
]
_UNITS = {_gpt_loss: [r"layers\.\d+"], _styles_loss: [r"pairs\.\d+"]}


def _llama_loss(model, x, y):
    return model(input_ids=x, labels=x).loss


def _reference(build, loss_fn, data, accumulate=1):
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, norms = [], []
    for x, y in data:
        total = 0.0
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
            loss = loss_fn(model, xs, ys) / accumulate
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded(model, plan, loss_fn, data, rank, accumulate=1, opt=None):
    """Train on this rank's data slices; returns the mean losses, the clipped norms, the optimizer."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    i, n = plan.data_index(rank), plan.data_size
    losses, norms = [], []
    for x, y in data:
        total = torch.zeros(())
        for xs, ys in zip(x.chunk(n)[i].chunk(accumulate), y.chunk(n)[i].chunk(accumulate)):
            loss = loss_fn(model, xs, ys) / accumulate
            loss.backward()
            total += loss.detach()
        norms.append(sp.clip_grad_norm_(model, CLIP).item())
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)  # tensor-parallel ranks hold equal losses: the world mean is the data mean
        losses.append(total.item() / dist.get_world_size())
    return losses, norms, opt


def _full(model):
    return {n: t for n, t in sp.checkpoint.full_state_dict(model).items()}


def _parity_worker(rank, world, hf):
    """Every training check of one 4-rank group: (what, sharded losses, reference losses, norms, ref norms,
    largest parameter difference on rank 0)."""
    data = _data()
    out, mixed = [], []
    # shard() gives each tensor-parallel group its first rank's generators (dropout on the activations the
    # group shares must agree); data-parallel ranks keep their own
    torch.manual_seed(rank)
    model = sp.shard(gpt.build("tiny"), sp.plan(gpt.build("tiny"), gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2), **TP),
                     sync_module_states=True)  # built under per-rank seeds: rank 0's values everywhere
    draws = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(draws, torch.rand(4))
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[2], draws[3]), draws
    assert not torch.equal(draws[0], draws[2]), "data-parallel ranks keep their own generators"
    dropped = [torch.zeros(8, 16) for _ in range(world)]
    dist.all_gather(dropped, nn.functional.dropout(torch.ones(8, 16), 0.5))
    assert torch.equal(dropped[0], dropped[1]) and torch.equal(dropped[2], dropped[3])
    torch.manual_seed(0)
    # a batch split by rank rather than by data index gives one tensor-parallel group two inputs: refused
    x, y = data[0]
    with pytest.raises(sp.errors.RuntimeShardingError, match=r"were given other inputs.*data_index"):
        model(x.chunk(4)[rank], y.chunk(4)[rank])
    # the collectives one step issues: per layer the forward all-reduces of wo and w2 (DTensor's) and one
    # input-gradient all-reduce for wq/wk/wv and one for w1/w3 (siblings share it; shardplan's), plus the
    # embedding's and the LM head's; the traced estimate counts exactly these
    from torch.distributed.tensor.debug import CommDebugMode
    traced = sp.plan(gpt.build("tiny"), gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2), **TP, trace=(x.chunk(2)[0], y.chunk(2)[0]))
    xs, ys = x.chunk(2)[traced.data_index(rank)], y.chunk(2)[traced.data_index(rank)]
    with CommDebugMode() as mode:
        model(xs, ys).backward()
    counts = {str(k): v for k, v in mode.get_comm_counts().items()}
    comm = (counts, traced.comm_bytes()["tensor_parallel"], tuple(xs.shape))

    def train(build, rules, mesh, strategy, loss_fn, accumulate, compute_axes=("tp",), **options):
        model = build()
        plan = sp.plan(model, rules, mesh, strategy=strategy, compute_axes=compute_axes, min_unit_bytes=0,
                       units=_UNITS.get(loss_fn, [r"model\.layers\.\d+"]), **options)
        sp.shard(model, plan)
        seen = []  # the compute tensors: DTensors over tp > 1, plain tensors when the compute axis has one rank
        if plan.axis("tp") and plan.axis("tp").modules:
            module = model.get_submodule(plan.axis("tp").modules[0].path)
            module.register_forward_pre_hook(lambda m, a: seen.append((type(m.weight).__name__, m.weight.dtype)))
        losses, norms, _ = _sharded(model, plan, loss_fn, data, rank, accumulate)
        return losses, norms, _full(model), set(seen)

    def check(what, build, rules, mesh, strategy, loss_fn=_gpt_loss, accumulate=1):
        ref_losses, ref_norms, ref_params = _reference(build, loss_fn, data, accumulate)
        losses, norms, full, seen = train(build, rules, mesh, strategy, loss_fn, accumulate)
        assert seen == {("DTensor" if mesh.axis_size("tp") > 1 else "Parameter", torch.float32)}, (what, seen)
        diff = max((full[n] - p).abs().max().item() for n, p in ref_params.items()) if rank == 0 else 0.0
        out.append((what, losses, ref_losses, norms, ref_norms, diff))

    def check_mixed(what, build, rules, mesh):
        """bf16 compute, fp32 reduce: against the same mixed precision without TP (dp=4)."""
        bf16 = dict(compute_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        ref_losses, ref_norms, ref_params, _ = train(build, gpt_rules.rules, sp.Mesh(dp=4), "optim_grads_params",
                                                     _gpt_loss, 1, compute_axes=(), **bf16)
        losses, norms, full, seen = train(build, rules, mesh, "optim_grads_params", _gpt_loss, 1, **bf16)
        assert seen == {("DTensor", torch.bfloat16)}, (what, seen)
        diff = max((full[n] - p).abs().max().item() for n, p in ref_params.items()) if rank == 0 else 0.0
        mixed.append((what, losses, ref_losses, norms, ref_norms, diff))

    tiny = lambda **kw: (lambda: gpt.build("tiny", **kw).init_weights(0))  # noqa: E731
    mesh = sp.Mesh(dp=2, tp=2)
    for strategy in STRATEGIES:
        check(f"gpt tied {strategy}", tiny(), gpt_rules_tp.rules, mesh, strategy)
    check("gpt untied, 2 micro-batches", tiny(tie_embeddings=False), gpt_rules_tp.rules, mesh, "optim_grads_params",
          accumulate=2)
    check("gpt tp=4", tiny(), gpt_rules_tp.tp_rules(data=None), sp.Mesh(tp=4), "optim_grads_params")
    check("gpt tp=1", tiny(), gpt_rules_tp.rules, sp.Mesh(dp=4, tp=1), "optim_grads_params")
    check_mixed("gpt bf16 compute dp=2 x tp=2", tiny(), gpt_rules_tp.rules, mesh)
    for strategy in ("optim_grads_params", "optim"):
        check(f"every style with biases {strategy}", _Styles, STYLES_RULES, mesh, strategy, _styles_loss)
    for reentrant in (False, True):  # activation checkpointing: the recomputed forward runs the styles again
        check(f"gpt checkpointed blocks, reentrant={reentrant}", lambda: _checkpointed(tiny()(), reentrant),
              gpt_rules_tp.rules, mesh, "optim_grads_params")
    if hf is not None:
        import transformers
        for strategy in STRATEGIES:
            check(f"llama {strategy}", lambda: _llama(transformers), LLAMA_RULES, mesh, strategy, _llama_loss)
        rules_tp4 = [(r, sp.P(*[tuple(a for a in e if a != "dp") if isinstance(e, tuple) else (None if e == "dp" else e)
                                for e in s])) for r, s in LLAMA_RULES]
        check("llama tp=4", lambda: _llama(transformers, kv_heads=4), rules_tp4, sp.Mesh(tp=4), "optim_grads_params",
              _llama_loss)
    return out, mixed, comm


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tensor_parallel_training_matches_one_process():
    try:
        import transformers  # noqa: F401
        hf = True
    except ImportError:
        hf = None
    results = run(_parity_worker, 4, hf, timeout=540)
    checks, mixed, (counts, estimate, (b, t)) = results[0]
    c = gpt.CONFIGS["tiny"]
    # forward: DTensor's redistribute of the outputs (run by the executor's handlers); backward: the input-gradient
    # all-reduces shardplan issues itself (collectives.py), beside one all-reduce of the used-parameter flags
    forward, backward = counts.get("c10d_functional.all_reduce", 0), counts.get("c10d.allreduce_", 0) - 1
    assert forward == backward == 2 * c.layers + 1, counts
    reduces = forward + backward
    act = b * t * c.dim * 4  # fp32 activations; an all-reduce over 2 ranks sends 2 * (n-1)/n of it
    assert estimate == reduces * act + b * t * c.vocab * 4 // 2, (estimate, counts)  # + the logits' all-gather
    worst = []  # every check's largest differences, so one failing run shows them all
    for what, losses, ref_losses, norms, ref_norms, diff in checks:
        dl = max(abs(a - b) for a, b in zip(losses, ref_losses))
        dn = max(abs(a - b) for a, b in zip(norms, ref_norms))  # the global norm counts each element once
        # Losses and norms within 1e-5 (the parity criterion). Parameters within 1e-4 = 1% of one step's lr:
        # TP sums partial products in another order, and AdamW divides by sqrt(v), so an element whose
        # gradient is at roundoff level moves by up to lr either way (seen: 1.8e-5 on a 16-core host's BLAS).
        # A wrong shard or a missed reduction moves parameters by ~lr.
        if max(dl, dn) >= 1e-5 or diff >= 1e-4:
            worst.append(f"{what}: loss {dl:.2e}, norm {dn:.2e}, params {diff:.2e}")
    # bf16 compute: TP sums bf16 partial products (and the summed input gradients of column-parallel siblings)
    # in another order. Losses within 5e-3; gradient norms within 1% (about one bf16 ulp, 2^-7); AdamW moves an
    # element by at most ~lr per step, and bf16 roundoff can flip the small-gradient ones, so parameters only
    # within one lr per step (a corrupted shard is off by the parameters' own scale).
    for what, losses, ref_losses, norms, ref_norms, diff in mixed:
        if (max(abs(a - b) for a, b in zip(losses, ref_losses)) >= 5e-3 or diff >= len(losses) * LR
                or max(abs(a - b) / b for a, b in zip(norms, ref_norms)) >= 1e-2):
            worst.append(f"{what}: losses {losses} vs {ref_losses}, norms {norms} vs {ref_norms}, params {diff:.2e}")
    assert not worst, "sharded training differs from one process:\n" + "\n".join(worst)
    assert len(checks) == (11 + 5 if hf else 11) and len(mixed) == 1
    assert all([x[:5] for x in r[0]] == [x[:5] for x in checks] for r in results)  # every rank saw the same


def _three_d_worker(rank, world):
    """HSDP x TP on 8 ranks: replicas of an FSDP x TP model; the batch splits over replica and dp."""
    data = _data(batch=8)
    build = lambda: gpt.build("tiny").init_weights(0)  # noqa: E731
    ref_losses, ref_norms, ref_params = _reference(build, _gpt_loss, data)
    out = []
    for strategy in ("optim_grads_params", "optim_grads"):
        model = build()
        plan = sp.plan(model, gpt_rules_tp.rules, sp.Mesh(replica=2, dp=2, tp=2), strategy=strategy, **TP)
        sp.shard(model, plan)
        losses, norms, _ = _sharded(model, plan, _gpt_loss, data, rank)
        full = _full(model)
        diff = max((full[n] - p).abs().max().item() for n, p in ref_params.items()) if rank == 0 else 0.0
        out.append((strategy, plan.data_axes, plan.data_size, losses, ref_losses, norms, ref_norms, diff))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_on_a_3d_mesh_at_eight_ranks():
    for strategy, axes, size, losses, ref_losses, norms, ref_norms, diff in run(_three_d_worker, 8, timeout=240)[0]:
        assert (axes, size) == (("replica", "dp"), 4)
        assert losses == pytest.approx(ref_losses, abs=1e-5), strategy
        assert norms == pytest.approx(ref_norms, abs=1e-5), strategy
        assert diff < 1e-4, (strategy, diff)  # the parity test's parameter tolerance, for the same reason


# -- checkpoints across parallelisms ----------------------------------------------------------------------

SPLIT = 2


def _ckpt_worker(rank, world, path, stage):
    """stage "save": 2 steps under dp=2 x tp=2, save; then resume under Mesh(dp=4) and Mesh(replica=2, dp=1, tp=2)
    (and save under dp=4 for the way back); stage "one": resume under Mesh(dp=1); stage "back": resume the dp=4
    checkpoint under dp=2 x tp=2."""
    data = _data()
    build = lambda: gpt.build("tiny").init_weights(0)  # noqa: E731
    out = {}

    def resume(key, ck, rules, mesh, compute_axes):
        model = build()
        plan = sp.plan(model, rules, mesh, compute_axes=compute_axes, **{k: v for k, v in TP.items() if k != "compute_axes"})
        sp.shard(model, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
        step = sp.checkpoint.load(ck, model, opt)
        out[key] = (step, _sharded(model, plan, _gpt_loss, data[SPLIT:], rank, opt=opt)[0])

    if stage == "save":
        model = build()
        plan = sp.plan(model, gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2), **TP)
        sp.shard(model, plan)
        losses, _, opt = _sharded(model, plan, _gpt_loss, data[:SPLIT], rank)
        sp.checkpoint.save(os.path.join(path, "tp"), model, opt, step=SPLIT)
        out["first"] = losses
        resume("dp=4", os.path.join(path, "tp"), gpt_rules.rules, sp.Mesh(dp=4), ())
        resume("replica=2,dp=1,tp=2", os.path.join(path, "tp"), gpt_rules_tp.rules, sp.Mesh(replica=2, dp=1, tp=2), ("tp",))
        model = build()
        plan = sp.plan(model, gpt_rules.rules, sp.Mesh(dp=4), **{k: v for k, v in TP.items() if k != "compute_axes"})
        sp.shard(model, plan)
        _, _, opt = _sharded(model, plan, _gpt_loss, data[:SPLIT], rank)
        sp.checkpoint.save(os.path.join(path, "dp4"), model, opt, step=SPLIT)
    elif stage == "one":
        resume("dp=1", os.path.join(path, "tp"), gpt_rules.rules, sp.Mesh(dp=1), ())
    else:
        resume("dp4 -> dp=2,tp=2", os.path.join(path, "dp4"), gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2), ("tp",))
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_checkpoints_reshard_across_parallelisms(tmp_path):
    # the reference runs in a child too: after a backward in the parent, a CUDA host refuses to fork autograd
    ref_losses = run(lambda rank, world: _reference(lambda: gpt.build("tiny").init_weights(0), _gpt_loss, _data())[0],
                     1, init=False)[0]
    saved = run(_ckpt_worker, 4, str(tmp_path), "save")[0]
    assert saved["first"] == pytest.approx(ref_losses[:SPLIT], abs=1e-5)
    resumed = {**saved, **run(_ckpt_worker, 1, str(tmp_path), "one")[0], **run(_ckpt_worker, 4, str(tmp_path), "back")[0]}
    for key in ("dp=4", "replica=2,dp=1,tp=2", "dp=1", "dp4 -> dp=2,tp=2"):
        step, losses = resumed[key]
        assert step == SPLIT
        assert losses == pytest.approx(ref_losses[SPLIT:], abs=1e-5), key  # the uninterrupted run's losses


def _functional_steps(model, plan, params, state, opt, data, rank, world, seen=None):
    vg = sp.value_and_grad(lambda p, x, y: sp.functional_call(model, plan, p, (x, y)), plan)
    i, n = plan.data_index(rank), plan.data_size
    losses, norms = [], []
    for x, y in data:
        loss, grads = vg(params, x.chunk(n)[i], y.chunk(n)[i])
        grads, norm = sp.optim.clip_by_global_norm(grads, CLIP, plan)
        params, state = opt.update(grads, state, params)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        norms.append(norm.item())
    return losses, norms, params, state


def _functional_worker(rank, world, path):
    """The functional face on tensor-parallel plans: shard_tree, value_and_grad, clip_by_global_norm and the
    pure AdamW at dp=2 x tp=2 and tp=4 train like one process with torch's AdamW; save_tree under
    dp=2 x tp=2 resumes under dp=4 (no compute axis) with the uninterrupted losses."""
    data = _data()
    build = lambda: gpt.build("tiny").init_weights(0)  # noqa: E731
    ref_losses, ref_norms, ref_params = _reference(build, _gpt_loss, data)
    adamw = sp.optim.adamw(lr=LR, eps=EPS)
    out = []
    for rules, mesh in ((gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2)), (gpt_rules_tp.tp_rules(data=None), sp.Mesh(tp=4))):
        model = build()
        plan = sp.plan(model, rules, mesh, **TP)
        params = sp.shard_tree(dict(model.named_parameters()), plan)
        seen = []
        model.get_submodule(plan.axis("tp").modules[0].path).register_forward_pre_hook(
            lambda m, a: seen.append(type(m.weight).__name__))
        losses, norms, params, state = _functional_steps(model, plan, params, adamw.init(params), adamw,
                                                         data[:SPLIT], rank, world)
        if "dp" in mesh.axis_names:
            sp.checkpoint.save_tree(path, plan, {"params": params, "opt": state}, step=SPLIT)
        more = _functional_steps(model, plan, params, state, adamw, data[SPLIT:], rank, world)
        assert set(seen) == {"DTensor"}, seen
        full = sp.unshard_tree(more[2], plan)  # every rank: full tensors across storage and compute axes
        diff = max((full[n] - t).abs().max().item() for n, t in ref_params.items())
        assert diff < 1e-4, (rank, diff)  # on every rank
        out.append((repr(mesh), losses + more[0], norms + more[1], diff))
    model = build()  # resume without tensor parallelism
    plan = sp.plan(model, gpt_rules.rules, sp.Mesh(dp=4), **{k: v for k, v in TP.items() if k != "compute_axes"})
    params = sp.shard_tree(dict(model.named_parameters()), plan)
    tree, step = sp.checkpoint.load_tree(path, plan, {"params": params, "opt": adamw.init(params)})
    losses, norms, _, _ = _functional_steps(model, plan, tree["params"], tree["opt"], adamw, data[SPLIT:], rank, world)
    out.append(("resumed under Mesh(dp=4)", [None] * SPLIT + losses, [None] * SPLIT + norms, 0.0))
    # the first call checks that a tensor-parallel group was given one batch slice
    model = build()
    plan = sp.plan(model, gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2), **TP)
    x, y = data[0]
    with pytest.raises(sp.errors.RuntimeShardingError, match="were given other inputs"):
        sp.functional_call(model, plan, sp.shard_tree(dict(model.named_parameters()), plan),
                           (x.chunk(4)[rank], y.chunk(4)[rank]))
    return out, ref_losses, ref_norms


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_functional_face_runs_tensor_parallel_plans(tmp_path):
    results, ref_losses, ref_norms = run(_functional_worker, 4, str(tmp_path / "tree"), timeout=240)[0]
    assert len(results) == 3
    for what, losses, norms, diff in results:
        assert diff < 1e-4, (what, diff)  # unshard_tree: the parity test's parameter tolerance
        keep = [k for k, v in enumerate(losses) if v is not None]
        assert [losses[k] for k in keep] == pytest.approx([ref_losses[k] for k in keep], abs=1e-5), what
        assert [norms[k] for k in keep] == pytest.approx([ref_norms[k] for k in keep], abs=1e-5), what


class _ReadsColwise(nn.Module):
    """torch modules only: ``up`` column-parallel, ``down`` its row-parallel sibling, and a read of ``up``'s
    output that is not ``down``'s (``mode``), each of which would compute per-rank pieces under tp."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        h = self.up(x)
        F = torch.nn.functional
        if self.mode == "residual":        # an extra read beside the sibling's
            return self.down(F.gelu(h)) + h.mean(-1, keepdim=True)
        if self.mode == "norm":            # docs/tensor_parallel.md's case: a norm over the whole width
            return self.down(F.layer_norm(h, h.shape[-1:]))
        if self.mode == "heads":           # a head count fixed, the width inferred: every head spread over ranks
            b, t, _ = h.shape
            return self.down(torch.softmax(h.view(b, t, 4, -1), -1).flatten(2))
        if self.mode == "returned":        # the pieces leave the model
            return self.down(F.gelu(h)), h
        return self.down(F.gelu(h)) + x    # fine: only the sibling reads it


_READS_RULES = [(r"up\.weight", sp.P("tp")), (r"down\.weight", sp.P(None, "tp")), (r".*", sp.P())]
_READS_WORDS = {"residual": r"'up'.*is reduced over its split dimension in the root module \(mean\)",
                "norm": r"'up'.*is normalised over its split dimension in the root module \(layer_norm\)",
                "heads": r"'up'.*split into 4 groups of an inferred width",
                "returned": r"'up'.*reaches the model's output"}


@pytest.mark.parametrize("mode", sorted(_READS_WORDS))
def test_colwise_output_read_by_another_than_its_sibling_is_refused_at_plan_time(mode):
    x = torch.zeros(2, 4, 16)
    with pytest.raises(sp.errors.PlanError, match=_READS_WORDS[mode] + ".*'colwise_gather'"):
        sp.plan(_ReadsColwise(mode), _READS_RULES, sp.Mesh(dp=1, tp=2), compute_axes="tp", trace=x)
    sp.plan(_ReadsColwise("fine"), _READS_RULES, sp.Mesh(dp=1, tp=2), compute_axes="tp", trace=x)
    sp.plan(_ReadsColwise(mode), _READS_RULES, sp.Mesh(dp=2, tp=1), compute_axes="tp", trace=x)   # tp=1: no pieces
    # the fix it names: the output all-gathered, so any code may read it
    sp.plan(_ReadsColwise(mode), _READS_RULES, sp.Mesh(dp=1, tp=2), compute_axes="tp", trace=x,
            styles=[(r"up", "colwise_gather"), (r"down", "rowwise_split")])


def _reads_worker(rank, world, modes):
    out = {}
    for mode in modes:
        torch.manual_seed(0)
        model = _ReadsColwise(mode)
        plan = sp.plan(model, _READS_RULES, sp.Mesh(dp=world // 2, tp=2), compute_axes="tp")   # untraced
        sp.shard(model, plan)
        x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(plan.data_index(rank)))
        try:
            y = model(x)
            y = y[0] if isinstance(y, tuple) else y
            y.sum().backward()
            model(x)                       # the check ran once; later forwards are not observed
            out[mode] = "ran"
        except sp.errors.RuntimeShardingError as exc:
            out[mode] = str(exc)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_colwise_output_read_by_another_than_its_sibling_is_refused_at_the_first_step():
    for world in (2, 4):
        for got in run(_reads_worker, world, sorted(_READS_WORDS) + ["fine"]):
            assert got.pop("fine") == "ran"
            for mode, message in got.items():
                assert re.search(_READS_WORDS[mode], message), (world, mode, message)
