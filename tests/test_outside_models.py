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
