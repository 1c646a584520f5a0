"""Rehearsal (one rank of an N-rank plan under torch's fake process group) and the activation profile in
the plan's memory. Rehearsals run in a forked process each (a fake default process group of their own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardplan as sp
from shardplan.step_call import token_inputs
from shardplan.errors import RehearsalError
from shardplan.rehearsal.run import check

from distributed import cli, run, script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import gpt  # noqa: E402


def traced_plan(model_fn, mesh, batch=(2, 32), **kw):
    with torch.device("meta"):
        model = model_fn()
    tokens = torch.zeros(*batch, dtype=torch.long, device="meta")
    return sp.plan(model, [(r".*", sp.P("dp"))], mesh, trace=token_inputs(model, tokens), min_unit_bytes=0, **kw)


# -- a Hugging Face-style model: forward(input_ids, labels) -> an output with .loss; a rotary buffer ------------

@dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class HFBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), persistent=False)

    def forward(self, x):
        x = x + self.q(x) * self.inv_freq.repeat(2)
        return x + self.down(F.gelu(self.up(x)))


class HFStyle(nn.Module):
    def __init__(self, vocab=97, d=32, n=3):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(HFBlock(d) for _ in range(n))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids=None, labels=None):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return Output(loss, logits)


def _rehearse_worker(_rank, _world, which, dp, rank, checkpoint):
    torch.set_num_threads(1)
    model_fn = (lambda: gpt.build("small")) if which.startswith("gpt") else HFStyle
    if which == "gpt-tp":  # tensor parallelism: one rank of Mesh(dp=dp/2, tp=2)
        with torch.device("meta"):
            model = model_fn()
        plan = sp.plan(model, TP_RULES, sp.Mesh(dp=dp // 2, tp=2), compute_axes="tp", units=[r"layers\.\d+"],
                       trace=token_inputs(model, torch.zeros(2, 32, dtype=torch.long, device="meta")), min_unit_bytes=0)
    else:
        plan = traced_plan(model_fn, sp.Mesh(dp=dp), units=[r"layers\.\d+"])
    r = sp.rehearse(model_fn, plan, rank=rank, batch=(2, 32), steps=2, checkpoint=checkpoint)
    return r.to_dict(), str(r), [u.name for u in plan.units]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which,dp,rank,checkpoint", [("gpt", 8, 3, False), ("gpt", 4, 1, True), ("hf", 4, 2, False),
                                                     ("gpt-tp", 4, 3, True)])
def test_rehearse_one_rank(which, dp, rank, checkpoint):
    d, text, units = run(_rehearse_worker, 1, which, dp, rank, checkpoint, init=False, timeout=110)[0]
    assert (d["rank"], d["world"], d["checkpoint"], len(d["step_s"])) == (rank, dp, checkpoint, 2)
    # the runtime held exactly the parameter and gradient bytes the plan walks for this rank
    assert d["states_peak_measured"] == d["states_peak_planned"] > 0
    assert d["planned_activations"] > 0 and d["planned_peak"] > d["planned_states_peak"] - 1
    assert [u["unit"] for u in d["units"]] == units
    assert all(u["forward_s"] >= 0 and u["backward_s"] >= 0 for u in d["units"])
    assert d["measured_peak"] is None  # CPU: not measured, and said so
    assert "ONE RANK ONLY" in text and "loss" in text and "not meaningful" in text
    assert not any(k.startswith("loss") for k in d)
    if which == "hf":
        assert any("filled with ones" in n for n in d["notes"])  # the meta-built rotary buffers
    cm = sp.forecast.ComputeModel.from_dict(d)  # the forecast reads a rehearsal's JSON
    assert cm.measured.keys() == set(units) and cm.batch == (2, 32)


# -- the activation profile in the plan's memory -------------------------------------------------------

def test_traced_plan_counts_activations():
    plan = traced_plan(lambda: gpt.build("small"), sp.Mesh(dp=4), units=[r"layers\.\d+"])
    plain, ck = plan.memory(1), plan.memory(1, recompute=True)
    assert plain.activations > 0 and ck.activations > 0
    assert plain.peak > plain.states_peak and plain.peak <= plain.states_peak + max(p.peak for p in plan.activations.plain)
    assert ck.peak < plain.peak  # checkpointing keeps less
    assert plain.states_peak == ck.states_peak
    # activations accumulate through the forward and are released through the backward
    live = {p.event: p.live for p in plan.activations.plain}
    assert live["post_forward(layers.0)"] < live["post_forward(layers.3)"] <= live["begin_backward"]
    assert live["post_backward(layers.0)"] < live["post_backward(layers.3)"]
    assert live["end_backward"] < live["post_forward(layers.0)"]
    ckl = {p.event: p.live for p in plan.activations.recompute}
    assert ckl["post_forward(layers.3)"] < live["post_forward(layers.3)"]
    assert "activations included" in str(plan)


def test_profile_counts_gradients_as_they_form():
    """A parameter's gradient is in the profile from the op that forms it until its unit completes: freezing
    the head and the final norm removes exactly their gradients from what is alive when layers.0 completes,
    and nothing once the backward ends."""
    from shardplan.activations import profile
    units = [(f"layers.{i}", [f"layers.{i}"]) for i in range(4)]
    trace = (torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long))

    def points(freeze_head):
        with torch.device("meta"):
            m = gpt.build("small", tie_embeddings=False)
        for name in ("norm", "output"):
            m.get_submodule(name).requires_grad_(not freeze_head)
        acts = profile(m, trace, units, compute_dtype="bfloat16")
        assert acts.grads
        return {p.event: p for p in acts.plain}, {p.event: p for p in acts.recompute}
    (full, full_ck), (frozen, frozen_ck) = points(False), points(True)
    c = gpt.CONFIGS["small"]
    head = (c.vocab * c.dim + c.dim) * 2  # output.weight and norm.weight in bf16
    for a, b in ((full, frozen), (full_ck, frozen_ck)):
        assert a["post_backward(layers.0)"].live - b["post_backward(layers.0)"].live == head
        assert a["end_backward"].live == b["end_backward"].live


TP_RULES = [
    (r"layers\.\d+\.attention\.w[qkv]\.weight", sp.P(("tp", "dp"))),
    (r"layers\.\d+\.attention\.wo\.weight", sp.P("dp", "tp")),
    (r"layers\.\d+\.feed_forward\.w[13]\.weight", sp.P(("tp", "dp"))),
    (r"layers\.\d+\.feed_forward\.w2\.weight", sp.P("dp", "tp")),
    (r"tok_embeddings\.weight", sp.P(("tp", "dp"))),     # vocabulary-parallel; the tied head gathers its logits
    (r".*", sp.P("dp")),
]


def test_tensor_parallel_profile_has_local_shapes():
    """A traced tensor-parallel plan counts one tp rank's activations: the blocks' inner activations are
    tp-local (the whole profile is smaller than at tp=1, by less than half: the residual stream stays
    whole), and the head's logits, all-gathered by its colwise_gather style, are whole (the fp32 loss
    over them holds three vocabulary-wide tensors at the head's backward)."""
    vocab, (b, t) = 4096, (2, 32)
    x = torch.zeros(b, t, dtype=torch.long, device="meta")
    with torch.device("meta"):
        m = gpt.build("small", vocab=vocab)
    one = sp.plan(m, [(r".*", sp.P("dp"))], sp.Mesh(dp=2), units=[r"layers\.\d+"], trace=(x, x), min_unit_bytes=0)
    two = sp.plan(m, TP_RULES, sp.Mesh(dp=2, tp=2), compute_axes="tp", units=[r"layers\.\d+"], trace=(x, x),
                  min_unit_bytes=0)
    assert two.axis("tp").module("output").style == "colwise_gather"
    for ck in (False, True):
        a1, a2 = one.memory(0, recompute=ck).activations, two.memory(0, recompute=ck).activations
        assert a2 is not None and 0.5 * a1 < a2 < a1, (ck, a1, a2)
    head = {p.event: p.peak for p in two.activations.plain}["pre_backward(layers.3)"]
    assert head >= 3 * b * t * vocab * 4
    block = [p.live - q.live for p, q in zip(two.activations.plain, two.activations.plain[1:])
             if q.event == "post_forward(layers.0)"]  # what layers.0's forward keeps, at tp=2 and at tp=1
    block1 = [p.live - q.live for p, q in zip(one.activations.plain, one.activations.plain[1:])
              if q.event == "post_forward(layers.0)"]
    assert block and block1 and -block[0] < -block1[0]


@pytest.mark.slow  # an 8B rehearsal; measured == planned: test_rehearse_one_rank
def test_planned_peak_matches_h200_measurement():
    """The plan's peak against rank 0 of Llama-3 8B shapes at dp=8 measured on one H200
    (benchmarks/results/rehearse_check_h200.json, before the forming-gradient fix: 0.959 and 0.914)."""
    _against_h200("8B")


@pytest.mark.slow
def test_planned_peak_matches_h200_measurement_70b():
    _against_h200("70B")


def _against_h200(config):
    import gpt_rules_tp
    with open(os.path.join(ROOT, "benchmarks", "results", "rehearse_check_h200.json")) as f:
        cases = [c for c in json.load(f)["cases"] if c["config"] == config and c.get("measured_peak")]
    assert cases
    with torch.device("meta"):
        model = gpt.build(config)
    plans = {}
    for c in cases:
        key = (c["dp"], c.get("tp", 1))
        if key not in plans:  # as benchmarks/rehearse_check.py plans each case
            tokens = torch.zeros(*c["batch"], dtype=torch.long, device="meta")
            if key[1] > 1:
                rules, mesh, kw = gpt_rules_tp.rules, sp.Mesh(dp=key[0], tp=key[1]), {"compute_axes": gpt_rules_tp.compute_axes}
            else:
                rules, mesh, kw = [(r".*", sp.P("dp"))], sp.Mesh(dp=key[0]), {}
            plan = sp.plan(model, rules, mesh, units=[r"layers\.\d+"], compute_dtype="bfloat16",
                           trace=token_inputs(model, tokens), **kw)
            # [Note: these runs were planned when the last unit stayed gathered into backward by default;
            # today every unit is freed after its forward, so the same plans are asked for explicitly]
            plans[key] = plan.with_reshard_after_forward({plan.units[-1].name: False})
        m = plans[key].memory(0, recompute=c["checkpoint"])
        assert m.states_peak - m.optimizer == c["states_peak_measured"], key
        # within 1%; what the plan leaves out is the CUDA libraries' workspaces (about 64 MiB here)
        assert abs(c["measured_peak"] / m.peak - 1) < 0.01, (key, c["checkpoint"], c["measured_peak"], m.peak)
        assert 0 <= c["measured_peak"] - m.peak < 80 * 2 ** 20, (key, c["checkpoint"])


def test_activation_profile_scales_with_tokens_and_dtype():
    small = traced_plan(lambda: gpt.build("small"), sp.Mesh(dp=2), batch=(1, 32), units=[r"layers\.\d+"])
    big = traced_plan(lambda: gpt.build("small"), sp.Mesh(dp=2), batch=(2, 32), units=[r"layers\.\d+"])
    half = traced_plan(lambda: gpt.build("small"), sp.Mesh(dp=2), batch=(2, 32), units=[r"layers\.\d+"],
                       compute_dtype=torch.bfloat16)
    a1, a2 = (p.activations.plain[-1 - 8].live for p in (small, big))  # an event inside the backward
    assert 1.8 < a2 / a1 < 2.2
    assert half.memory().activations < big.memory().activations


def test_untraced_plan_and_old_json():
    with torch.device("meta"):
        model = gpt.build("small")
    plain = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=4), units=[r"layers\.\d+"], min_unit_bytes=0)
    m = plain.memory(0)
    assert m.activations is None and m.peak == m.states_peak
    assert "activations not counted" in str(plain)
    traced = traced_plan(lambda: gpt.build("small"), sp.Mesh(dp=4), units=[r"layers\.\d+"])
    back = sp.Plan.from_json(traced.to_json())
    assert back == traced and back.memory(2) == traced.memory(2) and back.fingerprint() == traced.fingerprint()
    d = json.loads(traced.to_json())
    d.pop("activations")  # a plan saved before activation profiles
    old = sp.Plan.from_json(json.dumps(d))
    assert old.activations is None and old.memory(2).peak == traced.memory(2).states_peak
    assert "activations" not in json.loads(plain.to_json())  # untraced plans keep their JSON (and fingerprints)


# -- errors: one line naming the fix --------------------------------------------------------------------

def test_errors_name_the_fix():
    plan = traced_plan(lambda: gpt.build("small"), sp.Mesh(dp=8), units=[r"layers\.\d+"])
    cpu = torch.device("cpu")
    with pytest.raises(RehearsalError, match=r"rank 8 is outside the plan's 8 ranks.*0\.\.7"):
        check(plan, 8, None, cpu, False)
    with pytest.raises(RehearsalError, match=r"has 8 ranks but world=16 .*multiply to 16"):
        check(plan, 0, 16, cpu, False)
    with pytest.raises(RehearsalError, match=r"does not fit this device even for one rank.*activation checkpointing"):
        check(plan, 0, None, cpu, False, capacity=1000)
    check(plan, 7, 8, cpu, True)  # fits
    with torch.device("meta"):
        model = gpt.build("small")
    tp = sp.plan(model, __import__("gpt_rules_tp").rules, sp.Mesh(dp=2, tp=2), compute_axes=("tp",))
    check(tp, 3, None, cpu, False)  # tensor parallelism rehearses too
    for e in (RehearsalError,):
        assert issubclass(e, sp.ShardingError)


def _cli(*args, timeout=150):
    return cli(*args, cwd=ROOT, timeout=timeout)  # (forked: no interpreter start-up per command line)


@pytest.mark.timeout(200)
def test_cli_json_and_errors(tmp_path):
    out = tmp_path / "r.json"
    p = _cli("rehearse", "examples/gpt.py:tiny", "--mesh", "dp=8", "--rank", "3", "--batch", "2x16", "--steps", "2",
             "--json", "--out", str(out))
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d == json.loads(out.read_text())
    assert (d["rank"], d["world"], d["batch"], d["rehearsal"]) == (3, 8, [2, 16], 1)
    assert d["planned_activations"] > 0 and d["activation_inputs"].startswith("(2, 16)")
    assert d["states_peak_measured"] == d["states_peak_planned"]
    bad = _cli("rehearse", "examples/gpt.py:tiny", "--mesh", "dp=8", "--rank", "9", "--batch", "2x16")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--rank 9 is outside" in bad.stderr
    bad = _cli("rehearse", "examples/gpt.py:tiny", "--mesh", "dp=8", "--batch", "2by16")
    assert bad.returncode == 2 and "expected BxT" in bad.stderr
    f = _cli("forecast", "examples/gpt.py:tiny", "--mesh", "dp=8", "--network", "h100-8x-ib400", "--batch", "2x16",
             "--compute", str(out), "--json")
    assert f.returncode == 0, f.stderr
    assert json.loads(f.stdout)["compute"]["units"]


@pytest.mark.timeout(200)
def test_help_examples_run(tmp_path):
    from shardplan.cli import REHEARSE_EXAMPLES
    from test_docs import cli_lines
    lines = cli_lines(REHEARSE_EXAMPLES)
    assert len(lines) == 2
    (tmp_path / "examples").symlink_to(os.path.join(ROOT, "examples"))
    for line in lines:
        p = cli(*line.split()[1:], cwd=tmp_path, timeout=150)
        assert p.returncode == 0, (line, p.stderr)


@pytest.mark.slow  # the benchmark script's own check; rehearsals are test_rehearse_one_rank's
@pytest.mark.timeout(250)
def test_benchmark_tiny(tmp_path):
    out = tmp_path / "check.json"
    p = script(os.path.join(ROOT, "benchmarks", "rehearse_check.py"), "--tiny", "--out", str(out), cwd=ROOT, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert len(d["cases"]) == 4 and all(c["states_peak_measured"] == c["states_peak_planned"] for c in d["cases"])


# -- Hugging Face configs, initialisation, positions, host memory -------------------------------------------

HF_CONFIGS = {  # tiny config.json contents, every other argument at its default (use_cache=True, sdpa)
    "llama": dict(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=97, hidden_size=32, intermediate_size=64,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_experts=4,
                      num_experts_per_tok=2),
    "gpt2": dict(model_type="gpt2", vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "t5": dict(model_type="t5", vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
               decoder_start_token_id=0, pad_token_id=0),
}


def _hf_rehearse_worker(_rank, _world, path, checkpoint):
    torch.set_num_threads(1)
    from shardplan.hf import model_from_config
    plan = traced_plan(lambda: model_from_config(path), sp.Mesh(dp=4), batch=(2, 16))
    r = sp.rehearse(lambda: model_from_config(path), plan, rank=1, batch=(2, 16), steps=2, checkpoint=checkpoint)
    return r.to_dict(), str(r)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,checkpoint", [("llama", True), ("qwen2_moe", False), ("gpt2", True), ("t5", False)])
def test_rehearse_hf_configs(tmp_path, name, checkpoint):
    """HF models rehearse under their defaults (checkpointed too: no KV cache appended twice), initialised by
    HF's own _init_weights one module at a time (norms and GPT-2's Conv1D have no reset_parameters), and say so."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_CONFIGS[name]))
    d, text = run(_hf_rehearse_worker, 1, str(path), checkpoint, init=False, timeout=280)[0]
    assert d["states_peak_measured"] == d["states_peak_planned"] > 0 and d["checkpoint"] == checkpoint
    init = next(n for n in d["notes"] if n.startswith("initialisation:"))
    assert "Hugging Face's own" in init and "._init_weights, one module at a time" in init and "generic" not in init
    assert "note: initialisation: Hugging Face's own" in text
    assert d["host_peak"] is not None and "host memory (RSS): peak" in text


class NoInit(nn.Module):
    """A module with parameters and no reset_parameters (as HF's norms and Conv1D)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.proj = nn.Parameter(torch.zeros(d, d))

    def forward(self, x):
        return (x * self.weight + self.bias) @ self.proj


class Custom(nn.Module):
    def __init__(self, vocab=64, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(d, d), NoInit(d)) for _ in range(2)])
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _generic_worker(_rank, _world):
    torch.set_num_threads(1)
    plan = traced_plan(Custom, sp.Mesh(dp=2), batch=(2, 8), units=[r"layers\.\d+"])
    r = sp.rehearse(Custom, plan, rank=0, batch=(2, 8), steps=1)
    return r.notes


@pytest.mark.timeout(120)
def test_rehearse_generic_init_is_said():
    notes = run(_generic_worker, 1, init=False, timeout=110)[0]
    init = next(n for n in notes if n.startswith("initialisation:"))
    assert "reset_parameters() for" in init
    assert "generic rehearsal initialisation (normal(0, 0.02) for matrices" in init
    assert "layers.0.1 (NoInit: weight, bias, proj)" in init and "layers.1.1 (NoInit" in init


def test_shard_meta_without_reset_parameters_names_the_module():
    """shard() of a meta module: the module without reset_parameters is named with its own parameters only,
    before anything is materialised, with the fixes."""
    from shardplan.errors import RuntimeShardingError
    from shardplan.runtime.init import materialize_unit
    with torch.device("meta"):
        lin, odd = nn.Linear(4, 4), NoInit(4)
    names = ["a.weight", "a.bias", "b.weight", "b.bias", "b.proj"]
    owners = [lin, lin, odd, odd, odd]
    with pytest.raises(RuntimeShardingError, match=r"parameters \['b.weight', 'b.bias', 'b.proj'\] .*\(NoInit\) has no "
                                                   r"reset_parameters.*init_fn=fn.*model._init_weights"):
        materialize_unit(owners, names, {}, None, torch.device("cpu"))
    assert lin.weight.device.type == "meta"  # refused before materialising anything


def _positions_worker(_rank, _world):
    plan = traced_plan(gpt.tiny, sp.Mesh(dp=2), batch=(2, 16))
    with pytest.raises(RehearsalError, match=r"batch 2x9999: 9999 tokens per sequence, but GPT has 64 positions "
                                             r"\(pos_embeddings: nn.Embedding\(64, 64\); config.max_seq = 64\).*--batch 2x64"):
        sp.rehearse(gpt.tiny, plan, rank=0, batch=(2, 9999), steps=1)
    return True


@pytest.mark.timeout(120)
def test_batch_longer_than_positions():
    assert run(_positions_worker, 1, init=False, timeout=110) == [True]


@pytest.mark.slow  # the CLI's rehearse: test_cli_json_and_errors; HF configs: test_rehearse_hf_configs
@pytest.mark.timeout(300)
def test_cli_rehearse_hf(tmp_path):
    """`shardplan rehearse hf:CONFIG` runs and says its initialisation; a batch past GPT-2's positions is one
    line naming them; --help offers only what runs."""
    pytest.importorskip("transformers")
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(HF_CONFIGS["gpt2"]))
    p = _cli("rehearse", f"hf:{path}", "--mesh", "dp=4", "--rank", "2", "--batch", "2x16", "--steps", "2", timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "note: initialisation: Hugging Face's own GPT2LMHeadModel._init_weights" in p.stdout
    assert "host memory (RSS): peak" in p.stdout
    bad = _cli("rehearse", f"hf:{path}", "--mesh", "dp=4", "--batch", "2x9999", "--steps", "1", timeout=280)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert "9999 tokens per sequence, but GPT2LMHeadModel has 64 positions (transformer.wpe" in bad.stderr
    h = _cli("rehearse", "--help")
    assert h.returncode == 0 and "--batch" in h.stdout and "--rank" in h.stdout
    assert not any(o in h.stdout for o in ("--summary", "--schedule", "--explain"))  # a rehearsal cannot show them


def _memory_worker(_rank, _world):
    torch.set_num_threads(1)
    kw = dict(dim=512, layers=40, heads=8, kv_heads=8, ffn=2048, vocab=512, max_seq=64, tie_embeddings=False)
    build = lambda: gpt.build("124M", **kw)  # noqa: E731
    plan = traced_plan(build, sp.Mesh(dp=64), batch=(1, 8), units=[r"layers\.\d+"])
    r = sp.rehearse(build, plan, rank=0, batch=(1, 8), steps=1)
    return r.host_peak, r.planned_peak, sum(p.numel for p in plan.params) * 4


@pytest.mark.slow  # a 670 MB model; rehearsals: test_rehearse_one_rank
@pytest.mark.timeout(200)
def test_rehearsal_host_memory_is_one_rank():
    """Rank 0 of 64 of a model whose fp32 parameters take 670 MB: the process's RSS grows by the plan's peak
    (this rank's shards and states, one or two gathered units, activations) plus a fixed overhead, never by
    the model."""
    host, planned, full = run(_memory_worker, 1, init=False, timeout=190)[0]
    assert full > 600e6 and planned < full / 3
    assert host is not None and host < planned + (96 << 20), (host, planned, full)


# -- the captured step rehearsed ------------------------------------------------------------------------

def _captured_worker(_rank, _world, dp, rank, checkpoint):
    torch.set_num_threads(1)
    plan = traced_plan(lambda: gpt.build("small"), sp.Mesh(dp=dp), units=[r"layers\.\d+"])
    r = sp.rehearse(lambda: gpt.build("small"), plan, rank=rank, batch=(2, 32), steps=3, checkpoint=checkpoint,
                    capture=True)
    try:
        sp.rehearse(lambda: gpt.build("small"), plan.with_order("dynamic"), rank=rank, batch=(2, 32), capture=True)
    except RehearsalError as exc:
        refused = str(exc)
    else:
        refused = None
    return r.to_dict(), str(r), refused


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp,rank,checkpoint", [(8, 5, False), (4, 0, True)])
def test_rehearse_captured_step(dp, rank, checkpoint):
    """``rehearse(capture=True)``: a larger plan's rank, its step warmed up, captured (CPU: the eager backend,
    the same static inputs and checks) and replayed ``steps`` times on the fake process group; the runtime
    held the plan's bytes; a plan that cannot be captured is refused naming the blocker and the fix."""
    d, text, refused = run(_captured_worker, 1, dp, rank, checkpoint, init=False, timeout=110)[0]
    assert d["captured"] and len(d["step_s"]) == 3 and d["units"] == []
    assert d["states_peak_measured"] == d["states_peak_planned"] > 0
    assert "captured step (replays)" in text and "not measured (one graph)" in text
    assert any("captured step (eager)" in n and "replays" in n for n in d["notes"])
    assert refused is not None and "dynamic_order" in refused and "fix:" in refused


@pytest.mark.timeout(200)
def test_cli_rehearse_capture():
    p = _cli("rehearse", "examples/gpt.py:tiny", "--mesh", "dp=8", "--rank", "1", "--batch", "2x16", "--steps", "2",
             "--capture", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["captured"] and len(d["step_s"]) == 2


# -- a real tensor-parallel run after a rehearsal, in the same process and in processes forked from it ---------

def _tp_plan(strategy: str):
    with torch.device("meta"):
        model = gpt.build("tiny")
    return sp.plan(model, __import__("gpt_rules_tp").rules, sp.Mesh(dp=2, tp=2), compute_axes="tp", units=[r"layers\.\d+"],
                   min_unit_bytes=0, strategy=strategy)


_TP_DATA = [(torch.arange(32).view(4, 8) * (k + 3) % 256, torch.arange(32).view(4, 8) * (k + 5) % 256)
            for k in range(2)]


def _rehearse_tp(rank: int, strategy: str) -> None:
    sp.rehearse(lambda: gpt.build("tiny"), _tp_plan(strategy), rank=rank, batch=(2, 8), steps=1)


def _real_tp_worker(rank, world, rehearse_first):
    """Real tensor-parallel training (gloo, dp=2 x tp=2, DTensor modules) of a plan whose process groups are
    made in another number than the rehearsals' (no_shard): the losses, averaged over the data ranks."""
    import torch.distributed as dist
    if rehearse_first:  # two rehearsals in this process, then a real run in it
        _rehearse_tp(rank, "optim_grads_params")
        _rehearse_tp(rank, "optim")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    plan = _tp_plan("no_shard")
    model = sp.shard(_tp_model(), plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    i, n = plan.data_index(rank), plan.data_size
    losses = []
    for x, y in _TP_DATA:
        loss = model(x.chunk(n)[i], y.chunk(n)[i])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _rehearse_then_fork_real() -> None:
    """This process rehearses (a fresh interpreter: pytest's own must not), then forks the real run's ranks."""
    _rehearse_tp(3, "optim_grads_params")
    print(json.dumps(run(_real_tp_worker, 4, False, timeout=150)))


def _tp_model():
    model = gpt.build("tiny")
    model.init_weights(0)
    return model


def _tp_reference() -> list[float]:
    model = _tp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _TP_DATA:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(240)
@pytest.mark.slow  # rehearsals with TP: test_rehearse_one_rank; real TP runs: test_tensor_parallel.py
@pytest.mark.parametrize("where", ["same process", "forked"])
def test_real_tensor_parallel_run_after_a_rehearsal(where):
    """DTensor caches sharding propagation process-wide, keyed by meshes that compare equal by shape and names:
    a rehearsal's (fake, destroyed) meshes must never come back to a later real run of the same mesh shape whose
    groups are made in another order ("Could not resolve the process group registered under the name 12")."""
    if where == "same process":
        results = run(_real_tp_worker, 4, True, init=False, timeout=200)
    else:
        code = (f"import sys; sys.path[:0] = [{os.path.join(ROOT, 'src')!r}, {os.path.join(ROOT, 'tests')!r}]; "
                f"import test_rehearse; test_rehearse._rehearse_then_fork_real()")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=200,
                           env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
        assert p.returncode == 0, p.stderr[-3000:]
        results = json.loads(p.stdout.strip().splitlines()[-1])
    want = _tp_reference()
    for losses in results:
        assert losses == pytest.approx(want, abs=1e-5)
