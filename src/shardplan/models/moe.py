"""A small mixture-of-experts GPT: :mod:`shardplan.models.gpt`'s decoder with each feed-forward replaced by routed experts.

Each MoE layer has a top-k router (softmax over experts, the k largest renormalised), stacked SwiGLU
experts (``w1``, ``w3``: ``[num_experts, ffn, dim]``; ``w2``: ``[num_experts, dim, ffn]``, the layout of
torchtitan's grouped experts) and a load-balancing auxiliary loss. Routing is dropless: every token
reaches its k experts, whatever the load. Under ``shard()`` with a rule putting ``ep`` first in dim 0 of
the expert weights, tokens travel to the ranks holding their experts by all-to-all
(``shardplan.expert_parallel``); in one process the same code runs every expert locally.

The auxiliary loss is the Switch Transformer's ``num_experts * sum_e f_e * p_e`` (``f_e``: the share of
routed slots sent to expert ``e``, ``p_e``: its mean router probability), computed *per sequence* and
averaged, as DeepSeek-V3's sequence-wise balance loss: so the mean over data-parallel ranks of their
losses is exactly the loss of the whole batch in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardplan as sp

from .gpt import Attention, GPTConfig, RMSNorm

__all__ = ["MoEConfig", "CONFIGS", "Router", "GroupedExperts", "MoE", "Block", "MoEGPT", "build", "tiny", "rules_for",
           "UNITS"]


@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    experts: int = 4
    top_k: int = 2
    aux_weight: float = 0.01


CONFIGS = {
    "tiny": MoEConfig(ffn=64),
    "small": MoEConfig(vocab=512, dim=128, layers=4, heads=4, kv_heads=2, ffn=128, max_seq=128, experts=8),
    "350M": MoEConfig(vocab=32000, dim=1024, layers=8, heads=16, kv_heads=8, ffn=1408, max_seq=2048, experts=8,
                      tie_embeddings=False),  # benchmarks/cp_ep_overhead.py on one GPU
}


class Router(nn.Module):
    def __init__(self, c: MoEConfig):
        super().__init__()
        self.top_k = c.top_k
        self.gate = nn.Linear(c.dim, c.experts, bias=False)

    def forward(self, x):
        """(router probabilities [N, E], top-k weights [N, k], top-k expert indices [N, k])."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        return probs, (weights / weights.sum(-1, keepdim=True)).type_as(x), index


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stacked on dim 0; under expert parallelism this rank holds
    ``w1.shape[0]`` of them (a contiguous block) and :func:`shardplan.expert_parallel.dispatch` brings it
    the tokens routed to them."""

    def __init__(self, c: MoEConfig):
        super().__init__()
        self.num_experts = c.experts
        self.w1 = nn.Parameter(torch.empty(c.experts, c.ffn, c.dim))
        self.w2 = nn.Parameter(torch.empty(c.experts, c.dim, c.ffn))
        self.w3 = nn.Parameter(torch.empty(c.experts, c.ffn, c.dim))

    def forward(self, x, top_k_index, top_k_weights):
        routed = sp.expert_parallel.dispatch(self, x, top_k_index)
        outs = []
        for e, rows in enumerate(routed.tokens.split(routed.counts)):  # this rank's experts, in order
            outs.append(F.linear(F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e]), self.w2[e]))
        y = sp.expert_parallel.combine(routed, torch.cat(outs) if outs else routed.tokens)
        return (y * top_k_weights.unsqueeze(-1)).sum(1)


class MoE(nn.Module):
    def __init__(self, c: MoEConfig):
        super().__init__()
        self.router = Router(c)
        self.experts = GroupedExperts(c)
        self.aux = None  # the last forward's load-balancing loss (a scalar tensor)

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        probs, weights, index = self.router(flat)
        # sequence-wise balance: f and p per sequence, then the mean over sequences
        e = probs.shape[-1]
        share = F.one_hot(index, e).sum(1).view(b, t, e).float().mean(1) / index.shape[-1]   # [b, E]
        self.aux = e * (share * probs.view(b, t, e).mean(1)).sum(-1).mean()
        return self.experts(flat, index, weights).view(b, t, d)


class Block(nn.Module):
    def __init__(self, c: MoEConfig):
        super().__init__()
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.moe = MoE(c)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.ffn_norm(x))


class MoEGPT(nn.Module):
    def __init__(self, c: MoEConfig):
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.pos_embeddings = nn.Embedding(c.max_seq, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)
        if c.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens, targets=None):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        aux = sum(layer.moe.aux for layer in self.layers) / len(self.layers)
        return loss + self.config.aux_weight * aux

    def init_weights(self, seed: int = 0):
        """Deterministic init, the same on every rank."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 0.0))
        return self


def build(config: str = "tiny", **overrides) -> MoEGPT:
    c = CONFIGS[config]
    if overrides:
        c = MoEConfig(**{**c.__dict__, **overrides})
    return MoEGPT(c)


def tiny() -> MoEGPT:
    return build("tiny")


def rules_for(mesh: sp.Mesh, expert_axis: str = "ep") -> list:
    """Rules for ``mesh``: expert weights split by expert over ``ep`` and ZeRO-sharded over the other data
    axes; everything else ZeRO-sharded over every data axis (``ep`` included: it splits the batch too).

    >>> rules_for(sp.Mesh(dp=2, ep=2))[0]
    ('.*experts\\\\.w\\\\d', P(('ep', 'dp'), None, None))
    """
    data = [a for a in mesh.axis_names if a not in (expert_axis, "tp")]
    ep = [expert_axis] if expert_axis in mesh.axis_names else []
    experts = tuple(ep + data)
    dense = tuple(data + ep)
    return [(r".*experts\.w\d", sp.P(experts[0] if len(experts) == 1 else experts or None, None, None)),
            (r".*", sp.P(dense[0] if len(dense) == 1 else dense or None))]


UNITS = [r"layers\.\d+"]
