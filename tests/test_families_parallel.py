"""Hugging Face families under context and tensor parallelism (issue 49, items 2 and 3), at 2 and 4 gloo ranks,
from tiny configs (nothing downloads): MoE models at cp=2, dp=2 x cp=2 and cp=2 x ep=2 with the losses of one
process; the refusals of what cp cannot compute (a capacity-limited router, an experts module that drops tokens,
the load-balancing loss's product of means)."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import shardplan as sp
from distributed import run

transformers = pytest.importorskip("transformers")

MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
UNITS = [r"model\.layers\.\d+"]


def _moe(kind, seed=0, **extra):
    """A tiny Hugging Face MoE causal LM of ``kind`` attending with ``"shardplan_cp"`` (no sliding windows), its
    matrices drawn from ``seed`` (routers too: some initialise them to zeros, which ties every routing decision)."""
    name = sp.context_parallel.hf_attention()
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2, use_cache=False,
                attn_implementation=name, **extra)
    torch.manual_seed(seed)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**base, num_local_experts=4, sliding_window=None)
        model = transformers.MixtralForCausalLM(cfg)
    elif kind == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **base, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            use_sliding_window=False))
    elif kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **base, num_experts=4, moe_intermediate_size=32, use_sliding_window=False))
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **base, n_routed_experts=4, moe_intermediate_size=32, n_group=1, topk_group=1, first_k_dense_replace=0,
            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    return model


def _cp_trace(local=8, cp=2, **kwargs):
    x = torch.zeros(2, local, dtype=torch.long)
    pos = sp.context_parallel.positions(local * cp, cp, 0)
    return ((), dict(input_ids=x, position_ids=pos[None], **kwargs))
