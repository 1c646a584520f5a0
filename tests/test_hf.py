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
    full = sp.full_state_dict(model)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()) if rank == 0 else 0.0
    return losses, ref_losses, diff, plan.param("lm_head.weight").name


@pytest.mark.timeout(300)
def test_hf_llama_trains_sharded():
    for losses, ref_losses, diff, tied in run(_worker, 2):
        # HF's loss averages over the valid tokens of each rank's micro-batch; equal sizes make the mean exact
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert diff < 1e-5
        assert tied == "model.embed_tokens.weight"
