"""Small models for runtime tests: tied weights, a frozen parameter, odd shapes, biases, a buffer."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import shardplan as sp


class Block(nn.Module):
    def __init__(self, d: int, h: int, ckpt: bool = False):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)
        self.ckpt = ckpt

    def _f(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))

    def forward(self, x):
        return checkpoint(self._f, x, use_reentrant=False) if self.ckpt and torch.is_grad_enabled() else self._f(x)


class Toy(nn.Module):
    def __init__(self, vocab: int = 37, d: int = 13, h: int = 29, n: int = 3, ckpt: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, h, ckpt) for _ in range(n))
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, idx, y):
        x = self.emb(idx) * self.scale + 0.01 * self.frozen.sum()
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), y.flatten())


def toy_rules(axis: str = "dp", odd: bool = True):
    rules = [(r"blocks\.\d+\.ln\..*", sp.P())]
    if odd:  # a spec over dim 1: interleaved layout, copy-out after the gather
        rules.append((r"blocks\.1\.fc2\.weight", sp.P(None, axis)))
    rules.append((r".*", sp.P(axis)))
    return rules


def batches(n: int, batch: int = 8, seq: int = 6, vocab: int = 37, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(n)]
