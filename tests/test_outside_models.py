"""Model shapes found by the outside-model sweep (benchmarks/runs/sweep_outside.py, sweep_edges.py).

One module object registered at two places (``layers = ModuleList([blk, other, blk])``) crashed
``shard()`` with ``KeyError: 'layers.2.0'`` (start-up looked owners up in the de-duplicated module list);
it trains now, with the losses and parameters of unsharded data-parallel training.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardplan as sp
from distributed import run

V = 31


class Reused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, 16)
        blk = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.layers = nn.ModuleList([blk, nn.Sequential(nn.Linear(16, 16), nn.Tanh()), blk])
        self.head = nn.Linear(16, V)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V, (4, 6), generator=g) for _ in range(3)]


def _train(model, data, rank=None, world=1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids in data:
        if rank is None:  # data-parallel semantics in one process: every rank's half, loss / world
            loss = sum(model(ids[r * 2:(r + 1) * 2]) / 2 for r in range(2))
        else:
            loss = model(ids[rank * 2:(rank + 1) * 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if rank is not None:
            torch.distributed.all_reduce(t)
            t /= world
        losses.append(t.item())
    return losses


def _worker(rank, world):
    out = {}
    data = _batches()
    for face in ("shard_static", "shard_dynamic", "fully_shard"):
        model = Reused()
        if face == "fully_shard":
            for layer in model.layers:
                sp.fully_shard(layer)
            sp.fully_shard(model)
        else:
            order = face.split("_")[1]
            sp.shard(model, sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"layers\.\d+"],
                                    min_unit_bytes=0, order=order))
        losses = _train(model, data, rank, world)
        full = sp.full_state_dict(model)
        out[face] = (losses, full)
    return out


@pytest.mark.timeout(200)
def test_a_module_registered_twice_trains_like_unsharded():
    ref = Reused()
    ref_losses = _train(ref, _batches())
    out = run(_worker, 2, timeout=150)[0]
    for face, (losses, full) in out.items():
        assert losses == pytest.approx(ref_losses, rel=1e-5), face
        for n, p in ref.named_parameters():
            assert torch.allclose(full[n], p.detach(), atol=1e-6), (face, n)


class NaiveExperts(nn.Module):
    """Stacked experts whose forward indexes them by global expert id (as Hugging Face MoE modules do), without
    shardplan.expert_parallel.dispatch: split over ep, each rank would silently use its own experts in place of
    the ones routed to."""

    def __init__(self, num_experts=4, d=8):
        super().__init__()
        self.num_experts = num_experts
        self.w = nn.Parameter(torch.randn(num_experts, d, d))

    def forward(self, x, ids):
        return torch.stack([x[i] @ self.w[int(e)] for i, e in enumerate(ids)])


class NaiveMoE(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.experts = NaiveExperts()

    def forward(self, x):
        ids = torch.zeros(x.shape[0], dtype=torch.long)  # every token to expert 0 (held by ep rank 0 only)
        return self.experts(self.inp(x), ids).pow(2).mean()


def _ep_worker(rank, world):
    model = NaiveMoE()
    plan = sp.plan(model, [(r"experts\.w", sp.P("ep", None, None)), (r".*", sp.P())], sp.Mesh(ep=world),
                   units=(), min_unit_bytes=0)
    assert [m.path for m in plan.expert_modules] == ["experts"]
    sp.shard(model, plan)
    try:
        model(torch.randn(4, 8))
    except sp.RuntimeShardingError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_experts_split_over_ep_without_dispatch_are_refused():
    for msg in run(_ep_worker, 2, timeout=100):
        assert msg is not None and "'experts'" in msg and "dispatch" in msg and "P('dp', None, None)" in msg
