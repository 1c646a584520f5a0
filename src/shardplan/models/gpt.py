"""A GPT/Llama-style decoder (RMSNorm, rotary-free learned positions, SwiGLU) with named sizes.

``build("tiny")`` is the test size; ``llama_70b()`` has Llama-2-70B shapes (build it under
``torch.device("meta")``: the CLI does, ``shardplan plan shardplan.models.gpt:llama_70b``). Parameter names
follow torchtitan's Llama. Shipped with the package so that the documentation's snippets run anywhere;
``examples/gpt.py`` of a checkout re-exports it. ``python -m shardplan.models.gpt`` prints the sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardplan as sp

__all__ = ["GPTConfig", "CONFIGS", "RMSNorm", "Attention", "FeedForward", "Block", "GPT", "build", "tiny", "gpt_1b",
           "llama_8b", "llama_70b", "llama3_70b", "num_params"]

@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    ffn: int = 128
    max_seq: int = 64
    tie_embeddings: bool = True
    norm_eps: float = 1e-5


CONFIGS = {
    "tiny": GPTConfig(),
    "small": GPTConfig(vocab=512, dim=128, layers=4, heads=4, kv_heads=2, ffn=352, max_seq=128),
    "124M": GPTConfig(vocab=50304, dim=768, layers=12, heads=12, kv_heads=12, ffn=3072, max_seq=1024),
    "tiny200": GPTConfig(vocab=4096, dim=256, layers=200, heads=4, kv_heads=4, ffn=1024, max_seq=1024, tie_embeddings=False),
    "1B": GPTConfig(vocab=32000, dim=2048, layers=16, heads=16, kv_heads=16, ffn=5632, max_seq=2048, tie_embeddings=False),
    "3B": GPTConfig(vocab=128256, dim=3072, layers=28, heads=24, kv_heads=8, ffn=8192, max_seq=8192),  # Llama-3.2-3B shape
    "8B": GPTConfig(vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336, max_seq=8192, tie_embeddings=False),
    # the 8B's blocks (its matmul sizes), 8 of them: one H200 holds its fp32 states beside FSDP2's and torchao's
    "8B-L8": GPTConfig(vocab=128256, dim=4096, layers=8, heads=32, kv_heads=8, ffn=14336, max_seq=8192,
                       tie_embeddings=False),
    "70B": GPTConfig(vocab=32000, dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672, max_seq=4096, tie_embeddings=False),
    "L3-70B": GPTConfig(vocab=128256, dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672, max_seq=8192,
                        tie_embeddings=False),  # Llama-3-70B shape
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def reset_parameters(self):
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.wq = nn.Linear(c.dim, c.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * self.head_dim, c.dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        # heads from the local shapes (-1): under tensor parallelism each rank computes heads/tp of them
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        # F.scaled_dot_product_attention, or over the whole sequence under context parallelism (cp > 1)
        y = sp.context_parallel.attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.feed_forward = FeedForward(c)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.pos_embeddings = nn.Embedding(c.max_seq, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)
        if c.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens, targets=None, positions=None):
        """``positions``: of ``tokens`` in their sequences (default ``0..T-1``; under context parallelism, the
        full-sequence positions of this rank's chunks: ``shardplan.context_parallel.shard_batch``)."""
        pos = torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions
        x = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def init_weights(self, seed: int = 0):
        """Deterministic init, the same on every rank and for every device."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 0.0))
        return self


def build(config: str = "tiny", **overrides) -> GPT:
    c = CONFIGS[config]
    if overrides:
        c = GPTConfig(**{**c.__dict__, **overrides})
    return GPT(c)


def tiny() -> GPT:
    return build("tiny")


def gpt_1b() -> GPT:
    return build("1B")


def llama_8b() -> GPT:
    return build("8B")


def llama_70b() -> GPT:
    return build("70B")


def llama3_70b() -> GPT:
    return build("L3-70B")


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    with torch.device("meta"):
        for name in CONFIGS:
            print(f"{name:>8}: {num_params(build(name)) / 1e6:,.1f}M parameters")
