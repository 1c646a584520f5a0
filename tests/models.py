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


def accumulating_step(model, opt, loss_of):
    """A training step of two micro-batches (the first under ``sp.no_sync``), clipped by the global norm to 0.5,
    then ``opt``'s step: one optimizer step per call, returning the second micro-batch's loss."""
    def step(x, y):
        with sp.no_sync(model):
            (loss_of(x[:2], y[:2]) / 2).backward()
        loss = loss_of(x[2:], y[2:]) / 2
        loss.backward()
        sp.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


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


# -- models whose parameter use depends on the data, the step or the call pattern -----------------------

class BranchBlock(nn.Module):
    """``fc_b`` runs only on the samples ``flag`` marks; a rank none of whose samples are marked skips it."""

    def __init__(self, d: int):
        super().__init__()
        self.fc_a = nn.Linear(d, d)
        self.fc_b = nn.Linear(d, d)

    def forward(self, x, flag=None):
        y = self.fc_a(x)
        if flag is None:
            y = y + self.fc_b(x)
        elif bool(flag.any()):
            y = y + torch.where(flag[:, None, None], self.fc_b(x), torch.zeros_like(x))
        return x + F.gelu(y)


class Expert(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """Top-1 mixture of experts; ``choice`` (one expert per token) comes from the token ids, so ranks that
    hold different tokens reach different experts. Unreached experts are not called at all."""

    def __init__(self, d: int, h: int, n_experts: int):
        super().__init__()
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(n_experts))

    def forward(self, x, choice):
        gates = self.router(x).softmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            m = choice == e
            if bool(m.any()):
                out = out.index_put((m,), expert(x[m]) * gates[m][:, e:e + 1])
        return x + out


class Dynamic(nn.Module):
    """Embedding, ``n`` blocks, a tied head and a root ``gain``; what runs is chosen per step by ``mode``:

    * ``branch``: blocks[1].fc_b only on samples whose first token is in the lower half of the vocabulary
    * ``moe``: every block is a mixture of experts routed by token id
    * ``skip``: blocks[1] skipped on odd steps (``self.step``)
    * ``twice``: blocks[1] called twice
    * ``reentrant``: every block under ``checkpoint(..., use_reentrant=True)`` called from outside it
    * ``gain``: plain blocks; the caller multiplies the loss by the root's 0-d ``gain``
    """

    def __init__(self, mode: str, vocab: int = 32, d: int = 12, h: int = 20, n: int = 3, experts: int = 4, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.mode, self.vocab, self.step = mode, vocab, 0
        self.emb = nn.Embedding(vocab, d)
        if mode == "moe":
            self.blocks = nn.ModuleList(MoE(d, h, experts) for _ in range(n))
        else:
            self.blocks = nn.ModuleList(BranchBlock(d) for _ in range(n))
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, y):
        x = self.emb(idx)
        if self.mode == "moe":
            choice = idx * len(self.blocks[0].experts) // self.vocab
            for b in self.blocks:
                x = b(x, choice)
        elif self.mode == "reentrant":
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=True)
        else:
            order = list(range(len(self.blocks)))
            if self.mode == "skip" and self.step % 2 == 1:
                order.remove(1)
            if self.mode == "twice":
                order.insert(2, 1)
            flag = idx[:, 0] < self.vocab // 2 if self.mode == "branch" else None
            for i in order:
                x = self.blocks[i](x, flag if i == 1 else None)
        return F.cross_entropy(self.head(x).flatten(0, 1), y.flatten())


def rank_batches(n: int, world: int, batch: int = 8, seq: int = 5, vocab: int = 32, seed: int = 1):
    """Global batches whose rank-``r`` slice holds only token ids of the ``r``-th part of the vocabulary,
    so each rank routes to its own experts / branches."""
    g = torch.Generator().manual_seed(seed)
    per, part = batch // world, vocab // world
    out = []
    for _ in range(n):
        xs = [torch.randint(r * part, (r + 1) * part, (per, seq), generator=g) for r in range(world)]
        out.append((torch.cat(xs), torch.randint(0, vocab, (batch, seq), generator=g)))
    return out
