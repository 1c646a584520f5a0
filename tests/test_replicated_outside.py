"""A block's replicated parameter read outside its unit (issue 36, item 7): a 0-d gain multiplying the block's
output in the root's forward, a bias added there, a gain read before the block runs. Its local tensor is the
whole value, so it trains in parity with one process on the whole batch (``sp.shard`` with a ``P()`` rule,
``sp.fully_shard``, whose scalars are replicated; FSDP2 refuses scalar parameters), under ``no_sync`` too; a
sharded parameter read outside still raises naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardplan as sp
from distributed import run

STEPS, LR = 3, 1e-2


class Blk(nn.Module):
    def __init__(self, d=8, bias_dim=()):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.shift = nn.Parameter(torch.full(bias_dim, 0.25))  # 0-d, or (d,) for sp.shard's P() rule

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, d=8, bias_dim=(), seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Blk(d, bias_dim) for _ in range(3))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        b0, b1, b2 = self.blocks
        h = b0(h) * b0.gain + b0.shift     # after the block ran: its local (whole) tensors
        h = b1(h * b1.gain)                # before the block runs
        h = b2(h) + b1.shift               # another block's, later
        return self.out(h) * b2.gain


def _data(world, n=STEPS, b=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(b * world, 4, generator=g), torch.randn(b * world, 3, generator=g)) for _ in range(n)]


def _reference(bias_dim, world, micro):
    m = Net(bias_dim=bias_dim)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    for x, y in _data(world):
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            (F.mse_loss(m(xs), ys) / micro).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in m.state_dict().items()}


def _train(model, rank, world, micro):
    """AdamW on this rank's slice of each batch, in ``micro`` micro-steps (all but the last under no_sync)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for x, y in _data(world):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            if i < micro - 1:
                with sp.no_sync(model):
                    (F.mse_loss(model(xs), ys) / micro).backward()
            else:
                (F.mse_loss(model(xs), ys) / micro).backward()
        opt.step()
        opt.zero_grad()


def _full(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return {k: v.detach().clone() for k, v in
            get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}


def _diff(got, want) -> float:
    assert set(got) == set(want), (set(got) ^ set(want))
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def _worker(rank, world):
    out = {}
    # sp.shard: 0-d gains and (d,) biases replicated by rule, ZeRO-3 blocks; both orders; no_sync micro-steps
    for order in ("static", "dynamic"):
        for micro in (1, 2):
            m = Net(bias_dim=(8,))
            plan = sp.plan(m, [(r".*\.(gain|shift)", sp.P()), (r".*", sp.P("dp"))], sp.Mesh(dp=world),
                           units=[r"blocks\.\d+"], min_unit_bytes=0, layout="chunked", order=order)
            sp.shard(m, plan)
            _train(m, rank, world, micro)
            out[f"shard_{order}_{micro}"] = _diff(_full(m), _reference((8,), world, micro))
    # sp.fully_shard (blocks, then root): its scalars are replicated
    for micro in (1, 2):
        m = Net()
        for b in m.blocks:
            sp.fully_shard(b)
        sp.fully_shard(m)
        _train(m, rank, world, micro)
        out[f"fully_shard_{micro}"] = _diff(_full(m), _reference((), world, micro))
    # a sharded parameter read outside its unit still refuses, naming it
    m = Net()
    for b in m.blocks:
        sp.fully_shard(b)
    sp.fully_shard(m)
    x, y = _data(world)[0]
    try:
        (F.mse_loss(m(x), y) + m.blocks[0].fc.bias.sum()).backward()
        out["sharded"] = "no error"
    except sp.ShardingError as exc:
        out["sharded"] = str(exc)
    return out


def _check(results):
    for rank, res in enumerate(results):
        msg = res.pop("sharded")
        assert "'blocks.0.fc.bias'" in msg and "It is sharded" in msg and "reshard_after_forward=False" in msg, msg
        for key, d in res.items():
            assert d <= 1e-6, f"rank {rank} {key}: differs from one process by {d:.2e}"


@pytest.mark.timeout(200)
def test_replicated_parameter_outside_its_unit_two_ranks():
    _check(run(_worker, 2, timeout=180))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_replicated_parameter_outside_its_unit_four_ranks():
    _check(run(_worker, 4, timeout=280))
