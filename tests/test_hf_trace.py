"""Tracing Hugging Face models as their users call them (``trace=``, CLI ``--trace-tokens``): default
arguments (``use_cache=True`` in the config), sdpa and eager attention, fp32 and bf16 parameters, dense and
MoE decoders, GPT-2's Conv1D, an encoder-decoder (T5). See src/shardplan/metatrace.py."""

from __future__ import annotations

import json

import pytest
import torch

import shardplan as sp
from shardplan.step_call import token_inputs
from shardplan.errors import PlanError

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

DENSE = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {  # tiny configs, as config.json files hold them (every other argument at its default)
    "llama": dict(model_type="llama", **DENSE),
    "qwen2": dict(model_type="qwen2", **DENSE),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **DENSE),
    "qwen2_moe": dict(model_type="qwen2_moe", moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      num_experts=4, num_experts_per_tok=2, **DENSE),
    "gpt2": dict(model_type="gpt2", vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    # t5-small's config.json sets decoder_start_token_id (T5's labels are shifted right into the decoder's inputs)
    "t5": dict(model_type="t5", vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
               decoder_start_token_id=0, pad_token_id=0),
}


def build(name: str, attn: str, dtype: torch.dtype):
    cfg = transformers.AutoConfig.for_model(**CONFIGS[name], attn_implementation=attn)
    auto = transformers.AutoModelForSeq2SeqLM if name == "t5" else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(cfg)
    assert model.config.use_cache  # HF's default, which the checkpointed profile used to append to twice
    return model.to(dtype)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n if n == "llama" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CONFIGS])  # one in the quick loop (HF MoE traces: test_expert_parallel.py)
def test_trace_hf_defaults(name):
    """Every model, sdpa and eager, fp32 and bf16 parameters, with and without bf16 compute: the plan traces,
    the profile holds both passes, and checkpointing every unit lowers the peak."""
    for attn in ("sdpa", "eager"):
        for dtype in (torch.float32, torch.bfloat16):
            model = build(name, attn, dtype)
            trace = token_inputs(model, torch.zeros(2, 16, dtype=torch.long, device="meta"))
            assert trace[1].keys() == {"input_ids", "labels"}  # the user's call: use_cache left at its default
            for compute in ((None, "bf16") if dtype == torch.float32 else (None,)):
                plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=2), trace=trace, compute_dtype=compute,
                               min_unit_bytes=0)
                acts = plan.activations
                assert acts.plain[-1].event == acts.recompute[-1].event == "end_backward", (attn, dtype, compute)
                assert [u.name for u in plan.units][1:3] != [] and plan.memory(0).activations > 0
                assert plan.memory(0, recompute=True).peak < plan.memory(0).peak, (attn, dtype, compute)


def test_cached_and_uncached_trace_agree():
    """use_cache=True (the default, left out of the call) traces as use_cache=False, a training step's call;
    an explicit use_cache=True is refused, naming the fix."""
    model = build("llama", "eager", torch.float32)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    plans = [sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=2), min_unit_bytes=0,
                     trace=((), dict({"input_ids": ids, "labels": ids}, **extra))) for extra in ({}, {"use_cache": False})]
    assert plans[0].activations == plans[1].activations
    with pytest.raises(PlanError, match=r"use_cache=True.*appends.*second time.*Fix: leave use_cache out"):
        sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=2), trace=((), {"input_ids": ids, "labels": ids, "use_cache": True}))


def test_meta_value_reads_are_refused_by_name():
    """A forward that reads a non-bool value (a data-dependent size) fails with a PlanError naming the line."""
    class Reads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            n = int(x.sum())  # a value the meta device has not got
            return self.lin(x)[:n]

    with torch.device("meta"):
        m = Reads()
    with pytest.raises(PlanError, match=r"reads a value of a tensor.*float32 Tensor.item\(\), at .*test_hf_trace.py:\d+ in forward"):
        sp.plan(m, [(r".*", sp.P("dp"))], sp.Mesh(dp=2), trace=torch.zeros(2, 4, device="meta"))


@pytest.mark.slow  # 24 CLI plans; tracing each config: test_trace_hf_defaults
@pytest.mark.timeout(300)
def test_cli_trace_tokens_hf_configs(tmp_path, capsys):
    """`shardplan plan hf:CONFIG --trace-tokens` for each config, sdpa (the default) and eager, fp32 and bf16."""
    from shardplan.cli import main
    for name, d in CONFIGS.items():
        for attn in ("sdpa", "eager"):
            path = tmp_path / f"{name}_{attn}.json"
            path.write_text(json.dumps(dict(d, attn_implementation=attn)))
            for extra in ([], ["--param-dtype", "bf16"]):
                rc = main(["plan", f"hf:{path}", "--mesh", "dp=2", "--trace-tokens", "2x16", "--summary", *extra])
                out, err = capsys.readouterr()
                assert rc == 0, (name, attn, extra, err)
                assert "activations included" in out and "checkpointed" in out, (name, attn, extra)
