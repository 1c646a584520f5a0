"""Replicated parameters inside a tensor-parallel region (issue 36 item 12): a per-head norm between a
column-parallel projection and its row-parallel sibling (Qwen3's and Gemma3's ``q_norm`` / ``k_norm``) reads
only this rank's heads, so its gradient on each rank is a partial sum. The plan sums it over ``tp`` before
the unit's reduction (``all_reduce partial_grads``), found by following the traced activations or, untraced,
by the parameters' size; training matches one process, the tp replicas stay equal and the recorded step is
``plan.ops()`` op for op. Plain torch, Hugging Face Qwen3 and Gemma3, at tp=2 and dp=2 x tp=2."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import shardplan as sp
from distributed import run

LR = 1e-2


class HeadNorm(nn.Module):
    """The plain-torch reproduction: a column-parallel ``q``, a ``LayerNorm(head_dim)`` on its viewed heads,
    a row-parallel ``o``; a pre-norm over the hidden width (the block's replicated input) beside them."""

    class Block(nn.Module):
        def __init__(self, d=16, heads=4, head_dim=4, gate=False):
            super().__init__()
            self.head_dim = head_dim
            self.pre = nn.LayerNorm(d)                        # reads the replicated input: a whole gradient
            self.q = nn.Linear(d, heads * head_dim, bias=False)
            self.norm = nn.LayerNorm(head_dim)                # reads this rank's heads: a partial gradient
            self.gate = nn.Linear(head_dim, head_dim) if gate else None
            self.o = nn.Linear(heads * head_dim, d, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            h = self.norm(self.q(self.pre(x)).view(b, t, -1, self.head_dim))
            if self.gate is not None:
                h = h * torch.sigmoid(self.gate(h))
            return x + self.o(torch.tanh(h).reshape(b, t, -1))

    def __init__(self, vocab=32, d=16, gate=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([self.Block(d, gate=gate), self.Block(d, gate=gate)])
        self.out = nn.Linear(d, vocab)
        for blk in self.layers:  # LayerNorm starts at ones and zeros: make its gradient's partial sums visible
            nn.init.normal_(blk.norm.weight, 1.0, 0.3)
            nn.init.normal_(blk.norm.bias, 0.0, 0.3)

    def forward(self, x, y):
        h = self.emb(x)
        for blk in self.layers:
            h = blk(h)
        return nn.functional.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


HEAD_RULES = [(r"layers\.\d+\.q\.weight", sp.P(("tp", "dp"))), (r"layers\.\d+\.o\.weight", sp.P("dp", "tp")),
              (r".*", sp.P("dp"))]
HF_RULES = [
    (r".*\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight", sp.P(("tp", "dp"))),   # column-parallel
    (r".*\.(o_proj|down_proj)\.weight", sp.P("dp", "tp")),                            # row-parallel
    (r"model\.embed_tokens\.weight", sp.P(("tp", "dp"))),                             # vocab-parallel, tied head
    (r".*", sp.P("dp")),                                                              # norms (q_norm too): P(dp)
]
OPTS = dict(compute_axes="tp", min_unit_bytes=0)


def _qwen3():
    import transformers
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                                   tie_word_embeddings=True, use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    return _perturb_norms(transformers.Qwen3ForCausalLM(cfg))


def _gemma3():
    import transformers
    cfg = transformers.Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=64, sliding_window=8, use_cache=False,
                                        attn_implementation="eager")
    torch.manual_seed(0)
    return _perturb_norms(transformers.Gemma3ForCausalLM(cfg))


def _perturb_norms(model):
    with torch.no_grad():  # the norms start constant (ones, zeros): per-head differences show only after a step
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn(p.shape) * 0.3)
    return model


def _hf_trace(ids):
    # (an explicit mask and eager attention: without a cache Hugging Face looks for packed sequences, and with
    # SDPA whether the mask can be skipped, with .item(), which the planner's meta-device activation profile
    # cannot answer)
    return (), {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}


def _hf_loss(model, x, y):
    return model(input_ids=x, labels=x).loss


def _head_loss(model, x, y):
    return model(x, y)


# -- the planner ------------------------------------------------------------------------------------

def _partial(plan) -> set:
    return {n for b in plan.buffers if b.partial_axes for n in b.params}


def test_head_norm_gradients_are_summed_over_tp_in_the_plan():
    x = torch.randint(0, 32, (4, 6))
    norms = {f"layers.{i}.norm.{w}" for i in (0, 1) for w in ("weight", "bias")}
    for trace in (None, (x, x)):
        plan = sp.plan(HeadNorm(), HEAD_RULES, sp.Mesh(dp=2, tp=2), units=[r"layers\.\d+"], trace=trace, **OPTS)
        assert _partial(plan) == norms, (trace is not None, _partial(plan))   # the pre-norm is not partial
        assert all(plan.buffers[plan.param(n).buffer].partial_axes == ("tp",) for n in norms)
        ops = list(plan.ops())
        summed = [o for o in ops if o.what == "partial_grads"]
        assert [(o.kind, o.unit, o.axes, o.trigger, o.when) for o in summed] == [
            ("all_reduce", f"layers.{i}", ("tp",), f"post_backward(layers.{i})", "sync") for i in (1, 0)]
        for o in summed:  # before the unit's reduction, counted in comm_bytes
            rs = next(k for k, p in enumerate(ops) if p.kind == "reduce_scatter" and p.unit == o.unit)
            assert ops.index(o) < rs and o.bytes == plan.buffers[o.buffers[0]].gathered_numel * 4  # the fp32 input
        ring = lambda o: 2 * o.bytes * (plan.mesh.axis_size(o.axes) - 1) // plan.mesh.axis_size(o.axes)  # noqa: E731
        assert plan.comm_bytes()["all_reduce"] == sum(ring(o) for o in ops if o.kind == "all_reduce" and not o.in_module)
        assert sum(ring(o) for o in summed) == sum(o.bytes for o in summed) > 0     # counted there (tp=2: 2(n-1)/n = 1)
        assert any("partial sum" in n for n in plan.notes)
        assert sp.Plan.from_json(plan.to_json()).buffers == plan.buffers
        # a schedule without the sum leaves those gradients partial: refused
        with pytest.raises(sp.errors.PlanError, match="partial_grads of buffer"):
            plan.with_schedule([o for o in plan.schedule if o.what != "partial_grads"])
        late = [o for o in plan.schedule if o.what != "partial_grads"]
        rs = next(k for k, o in enumerate(late) if o.kind == "reduce_scatter" and o.unit == "layers.1")
        late.insert(rs + 1, summed[0])
        with pytest.raises(sp.errors.PlanError, match="after their reduction"):
            plan.with_schedule(late)
    # one tp rank shards nothing: nothing partial
    assert not _partial(sp.plan(HeadNorm(), HEAD_RULES, sp.Mesh(dp=4, tp=1), units=[r"layers\.\d+"], **OPTS))


def test_untraced_plans_warn_where_they_cannot_tell_and_traced_ones_know():
    x = torch.randint(0, 32, (4, 6))
    with pytest.warns(sp.errors.PlanWarning, match=r"layers\.0\.gate\.weight \(4, 4\).*trace="):
        untraced = sp.plan(HeadNorm(gate=True), HEAD_RULES, sp.Mesh(dp=1, tp=2), units=[r"layers\.\d+"], **OPTS)
    assert not any("gate" in n for n in _partial(untraced))
    with warnings.catch_warnings():
        warnings.simplefilter("error", sp.errors.PlanWarning)
        traced = sp.plan(HeadNorm(gate=True), HEAD_RULES, sp.Mesh(dp=1, tp=2), units=[r"layers\.\d+"], trace=(x, x), **OPTS)
    assert {f"layers.0.gate.{w}" for w in ("weight", "bias")} <= _partial(traced)

    class Shared(HeadNorm):  # one LayerNorm read on the heads and on the replicated hidden state
        def forward(self, x, y):
            h = self.emb(x)
            for blk in self.layers:
                h = blk(h)
                h = h + blk.norm(h.view(*h.shape[:2], -1, 4)).flatten(2)
            return nn.functional.cross_entropy(self.out(h).flatten(0, 1), y.flatten())

    with pytest.raises(sp.errors.PlanError, match=r"layers\.0\.norm\.(weight|bias).*both.*separate parameters"):
        sp.plan(Shared(), HEAD_RULES, sp.Mesh(dp=1, tp=2), units=[r"layers\.\d+"], trace=(x, x), **OPTS)


@pytest.mark.parametrize("build", [_qwen3, pytest.param(_gemma3, marks=pytest.mark.slow)])
def test_hf_per_head_norms_are_found_traced_and_untraced(build):
    pytest.importorskip("transformers")
    ids = torch.randint(0, 96, (2, 12))
    want = {f"model.layers.{i}.self_attn.{n}_norm.weight" for i in (0, 1) for n in ("q", "k")}
    for trace in (None, _hf_trace(ids)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", sp.errors.PlanWarning)   # nothing left unjudged in these models
            plan = sp.plan(build(), HF_RULES, sp.Mesh(dp=2, tp=2), units=[r"model\.layers\.\d+"], trace=trace, **OPTS)
        assert _partial(plan) == want, (trace is not None, _partial(plan))


# -- training -------------------------------------------------------------------------------------------

def _data(vocab, n=3, batch=4, seq=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(n)]


def _reference(build, loss_fn, data):
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in data:
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_worker(rank, world, with_hf):
    """(what, losses, reference losses, largest parameter difference, tp replicas equal, recorded == planned)
    for each model and plan, at Mesh(tp=2) on 2 ranks or Mesh(dp=2, tp=2) on 4."""
    mesh = sp.Mesh(dp=1, tp=2) if world == 2 else sp.Mesh(dp=2, tp=2)
    cases = [("head norm", HeadNorm, HEAD_RULES, [r"layers\.\d+"], _head_loss, 32, "optim_grads_params")]
    if world == 4:  # every strategy: the sum comes before whichever reduction the buffer takes
        cases += [("head norm " + st, HeadNorm, HEAD_RULES, [r"layers\.\d+"], _head_loss, 32, st)
                  for st in ("optim_grads", "optim", "no_shard")]
    if with_hf:
        cases += [("qwen3", _qwen3, HF_RULES, [r"model\.layers\.\d+"], _hf_loss, 96, "optim_grads_params"),
                  ("gemma3", _gemma3, HF_RULES, [r"model\.layers\.\d+"], _hf_loss, 96, "optim_grads_params")]
    out = []
    for what, build, rules, units, loss_fn, vocab, strategy in cases:
        data = _data(vocab)
        ref_losses, ref_params = _reference(build, loss_fn, data)
        x0 = data[0][0][: 4 // mesh.axis_size("dp")]
        traces = [None, ((x0, x0) if loss_fn is _head_loss else _hf_trace(x0))]
        for trace in traces:
            model = build()
            plan = sp.plan(model, rules, mesh, units=units, trace=trace, strategy=strategy, **OPTS)
            sp.shard(model, plan)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            losses, recorded, expected = [], [], []
            i, n = plan.data_index(rank), plan.data_size
            for x, y in data:
                with sp.record_ops(model) as ops:
                    loss = loss_fn(model, x.chunk(n)[i], y.chunk(n)[i])
                    loss.backward()
                recorded += ops
                expected += plan.ops(stale=len(expected) == 0 or strategy != "optim_grads_params")
                opt.step()
                opt.zero_grad()
                t = loss.detach().clone()
                dist.all_reduce(t)
                losses.append(t.item() / world)
            # the tp replicas of every replicated parameter hold one value
            mine = {p.name: model.get_parameter(p.name).detach().clone() for p in plan.params if p.compute is None}
            every = [None] * world
            dist.all_gather_object(every, mine)
            replicas = all(torch.equal(every[g[0]][k], every[r][k]) for g in plan.mesh.groups(["tp"]) for r in g
                           for k in mine)
            full = sp.checkpoint.full_state_dict(model)
            diff = max((full[k] - v).abs().max().item() for k, v in ref_params.items()) if rank == 0 else 0.0
            out.append((f"{what} {'traced' if trace else 'untraced'}", losses, ref_losses, diff, replicas,
                        recorded == expected, sum(o.what == "partial_grads" for o in recorded),
                        [(len(recorded), len(expected))] + [(str(a), str(b)) for a, b in zip(recorded, expected) if a != b][:2]))
    # the functional face: the same sums, through value_and_grad and the pure SGD
    model = HeadNorm()
    plan = sp.plan(model, HEAD_RULES, mesh, units=[r"layers\.\d+"], **OPTS)
    params = sp.shard_tree(dict(model.named_parameters()), plan)
    vg = sp.value_and_grad(lambda p, x, y: sp.functional_call(model, plan, p, (x, y)), plan)
    sgd = sp.optim.sgd(lr=LR)
    state, losses, recorded = sgd.init(params), [], []
    data, i, n = _data(32), plan.data_index(rank), plan.data_size
    for k, (x, y) in enumerate(data):
        with sp.record_ops(model, plan) if k else contextlib.nullcontext([]) as ops:  # (its runtime: after a call)
            loss, grads = vg(params, x.chunk(n)[i], y.chunk(n)[i])
        recorded += ops
        params, state = sgd.update(grads, state, params)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    full = sp.unshard_tree(params, plan)
    ref_losses, ref_params = _reference(HeadNorm, _head_loss, data)
    diff = max((full[k] - v).abs().max().item() for k, v in ref_params.items())
    out.append(("head norm, functional face", losses, ref_losses, diff, True, recorded == list(plan.ops()) * (len(data) - 1),
                sum(o.what == "partial_grads" for o in recorded) + 2, [(len(recorded),)]))
    return out


def _check(results, world):
    bad = []
    for what, losses, ref_losses, diff, replicas, same_ops, summed, first_diff in results[0]:
        dl = max(abs(a - b) for a, b in zip(losses, ref_losses))
        if dl > 1e-5 or diff > 1e-5 or not replicas or not same_ops or summed != 2 * 3:
            bad.append(f"{what} at {world} ranks: losses {dl:.2e}, params {diff:.2e}, tp replicas equal {replicas}, "
                       f"recorded == plan.ops() {same_ops} {first_diff}, partial sums run {summed}")
    assert not bad, "\n".join(bad)
    assert len(results[0]) == 2 * (1 + 3 * (world == 4) + 2 * _with_hf()) + 1, [r[0] for r in results[0]]


def _with_hf():
    try:
        import transformers  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_per_head_norms_train_like_one_process_at_tp2():
    _check(run(_train_worker, 2, _with_hf(), timeout=540), 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_per_head_norms_train_like_one_process_at_dp2_tp2():
    _check(run(_train_worker, 4, _with_hf(), timeout=540), 4)


class SharedKey(nn.Module):
    """One key head computed replicated (its projection keeps tp out of its spec), normed by a head_dim-sized
    norm. ``mixed``: the sharded queries multiply it, so its gradient is a partial sum (refused when traced);
    else it only joins the residual through a replicated projection, and an untraced plan, taking the
    head_dim-sized norm to read sharded heads, would sum a whole gradient."""

    def __init__(self, mixed, d=16, heads=4, head_dim=4):
        super().__init__()
        torch.manual_seed(0)
        self.head_dim, self.mixed = head_dim, mixed
        self.q, self.k = nn.Linear(d, heads * head_dim, bias=False), nn.Linear(d, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim)
        self.up = nn.Linear(head_dim, d, bias=False)
        self.o = nn.Linear(heads * head_dim, d, bias=False)

    def forward(self, x):
        q = torch.tanh(self.q(x).view(*x.shape[:2], -1, self.head_dim))
        k = self.k_norm(self.k(x))
        if self.mixed:
            return (x + self.o((q * k.unsqueeze(2)).flatten(2))).square().mean()
        return (x + self.o(q.flatten(2)) + self.up(k)).square().mean()


KEY_RULES = [(r"q\.weight", sp.P(("tp", "dp"))), (r"o\.weight", sp.P("dp", "tp")), (r".*", sp.P("dp"))]


def test_replicated_activations_meeting_sharded_ones_are_refused_when_traced():
    x = torch.randn(2, 3, 16)
    with pytest.raises(sp.errors.PlanError, match=r"module '<root>' combines .*replicated activation that takes a gradient"):
        sp.plan(SharedKey(True), KEY_RULES, sp.Mesh(dp=1, tp=2), units=[], trace=(x,), **OPTS)
    with pytest.warns(sp.errors.PlanWarning, match="trace="):
        untraced = sp.plan(SharedKey(False), KEY_RULES, sp.Mesh(dp=1, tp=2), units=[], **OPTS)
    assert _partial(untraced) == {"k_norm.weight", "k_norm.bias"}          # head_dim-sized: taken as per head
    assert not _partial(sp.plan(SharedKey(False), KEY_RULES, sp.Mesh(dp=1, tp=2), units=[], trace=(x,), **OPTS))


def _runtime_check_worker(rank, world):
    """The first backward compares replicated gradients across the tp group: an untraced plan that missed a
    partial gradient (the gate it warned about; the shared key) or summed a whole one (the key's norm) raises."""
    out = {}
    mesh = sp.Mesh(dp=1, tp=2)
    x, h = torch.randint(0, 32, (2, 6)), torch.randn(2, 3, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sp.errors.PlanWarning)
        for what, build, rules, units, args in [
                ("gate", lambda: HeadNorm(gate=True), HEAD_RULES, [r"layers\.\d+"], (x, x)),
                ("shared key", lambda: SharedKey(True), KEY_RULES, [], (h,)),
                ("key norm", lambda: SharedKey(False), KEY_RULES, [], (h,))]:
            for trace in ((None, args) if what != "shared key" else (None,)):
                model = build()
                plan = sp.plan(model, rules, mesh, units=units, trace=trace, **OPTS)
                sp.shard(model, plan)
                try:
                    for _ in range(2):
                        model(*args).backward()
                    out[(what, trace is not None)] = "ok"
                except sp.errors.RuntimeShardingError as exc:
                    out[(what, trace is not None)] = str(exc)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_first_backward_catches_what_an_untraced_plan_judged_wrong():
    for out in run(_runtime_check_worker, 2):
        assert out[("gate", True)] == out[("key norm", True)] == "ok", out     # traced plans know
        for what, name in (("gate", "layers.1.gate.weight"), ("shared key", "k.weight")):
            assert "differ between the ranks" in out[(what, False)] and name in out[(what, False)], out
            assert "trace=" in out[(what, False)]
        assert "k_norm.bias" in out[("key norm", False)] and "same on every rank" in out[("key norm", False)], out
