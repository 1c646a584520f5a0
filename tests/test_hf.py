"""A HuggingFace Llama built locally from a tiny config trains under rules over its parameter names."""

from __future__ import annotations

import pytest
import torch

import shardplan as sp
from distributed import run

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers; without it this check cannot run")

RULES = [(r".*norm\.weight", sp.P()), (r"model\.embed_tokens\.weight", sp.P("dp")), (r".*", sp.P("dp"))]


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _worker(rank, world):
    ref = _llama()
    model = _llama()
    plan = sp.plan(model, RULES, sp.Mesh(dp=world), units=[r"model\.layers\.\d+"], min_unit_bytes=0)
    sp.shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    losses, ref_losses = [], []
    for _ in range(3):
        ids = torch.randint(0, 97, (4, 12), generator=g)
        per = 4 // world
        out = model(input_ids=ids[rank * per:(rank + 1) * per], labels=ids[rank * per:(rank + 1) * per])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        t = out.loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
        r = ref(input_ids=ids, labels=ids).loss
        r.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(r.item())
    full = sp.checkpoint.full_state_dict(model)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()) if rank == 0 else 0.0
    return losses, ref_losses, diff, plan.param("lm_head.weight").name


@pytest.mark.timeout(300)
def test_hf_llama_trains_sharded():
    for losses, ref_losses, diff, tied in run(_worker, 2):
        # HF's loss averages over the valid tokens of each rank's micro-batch; equal sizes make the mean exact
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert diff < 1e-5
        assert tied == "model.embed_tokens.weight"


def test_capturable_attention_computes_what_sdpa_computes():
    """hf.capturable_attention: the same logits and gradients as "sdpa", bit for bit, with and without a padding
    mask; its mask function passes is_causal (None) for a plain causal mask and builds transformers' mask else."""
    from shardplan import hf
    ref, model = _llama(), _llama()
    assert ref.config._attn_implementation == "sdpa"
    assert hf.capturable_attention(model) is model and model.config._attn_implementation == hf.CAPTURABLE_SDPA
    assert hf.capturable_attention(model) is model  # twice: nothing changes
    x = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    pad = torch.ones(2, 12, dtype=torch.long)
    pad[0, :3] = 0
    for kw in ({}, {"attention_mask": pad}):
        a, b = ref(input_ids=x, labels=x, **kw), model(input_ids=x, labels=x, **kw)
        assert torch.equal(a.logits, b.logits), kw
        a.loss.backward()
        b.loss.backward()
        for (n, p), q in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), (n, kw)
        ref.zero_grad()
        model.zero_grad()
    args = dict(batch_size=2, q_length=12, kv_length=12, device="cpu")
    assert hf._causal_or_sdpa_mask(**args) is None
    assert hf._causal_or_sdpa_mask(**args, attention_mask=pad.bool()).shape == (2, 1, 12, 12)
    assert hf._causal_or_sdpa_mask(**dict(args, q_length=4, q_offset=8)) is not None  # queries after a cache: a mask


def test_capture_problem_names_the_transformers_versions_and_the_fix(monkeypatch):
    """transformers 5.0-5.17 build a causal mask under a CUDA-graph capture only: capture refuses such a model
    (runtime/capture/session.py asks hf.capture_problem at the capture), naming capturable_attention."""
    from shardplan import hf
    model = _llama()
    monkeypatch.setattr(hf, "_transformers_version", lambda: "5.17.0")
    why = hf.capture_problem(model)
    assert "capturable_attention" in why and "LlamaForCausalLM" in why and "5.17.0" in why
    monkeypatch.setattr(hf, "_transformers_version", lambda: "5.18.0")
    assert hf.capture_problem(model) is None
    monkeypatch.setattr(hf, "_transformers_version", lambda: "5.3.1")
    assert hf.capture_problem(hf.capturable_attention(model)) is None  # fixed by the helper
    eager = _llama()
    eager.set_attn_implementation("eager")
    assert hf.capture_problem(eager) is None  # no SDPA, no mask question
    with pytest.raises(sp.ShardingError, match="attn_implementation='eager'"):
        hf.capturable_attention(eager)


def test_capturable_attention_refuses_a_model_that_asks_for_sdpa_by_name():
    """Gemma 4 checks ``config._attn_implementation == "sdpa"`` itself: under that name it keeps every query of its
    KV-shared layers when a causal mask was skipped (is_causal). Renamed "shardplan_sdpa", it sliced them to
    ``logits_to_keep`` while SDPA still took ``is_causal=True``: other logits than "sdpa", silently. Refused now."""
    from shardplan import hf
    gemma4 = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    cfg = transformers.Gemma4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        num_kv_shared_layers=2, sliding_window=512, hidden_size_per_layer_input=8,
                                        vocab_size_per_layer_input=64, attn_implementation="sdpa",
                                        layer_types=["sliding_attention", "full_attention"] * 2)
    torch.manual_seed(0)
    model = gemma4.Gemma4ForCausalLM(cfg).eval()
    with pytest.raises(sp.ShardingError, match=r"(?s)Gemma4.*'sdpa' by name.*modeling_gemma4"):
        hf.capturable_attention(model)
    assert model.config._attn_implementation == "sdpa"  # left as it was
