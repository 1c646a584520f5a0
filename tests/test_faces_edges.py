"""Edge cases of the faces found by sweeping them against single-process training: scalar parameters,
trees from other plans, rules that shard tiny or non-divisible parameters (each case once on real gloo
groups, several checks per spawned group)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import shardplan as sp
from distributed import run


class Scalars(nn.Module):
    """A block whose replicated buffer holds only 0-d parameters (one alone, or two together)."""

    def __init__(self, two: bool):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.a = nn.Parameter(torch.tensor(1.5))
        self.b = nn.Parameter(torch.tensor(-0.5)) if two else None

    def forward(self, x):
        y = self.lin(x) * self.a
        if self.b is not None:
            y = y + self.b
        return y.square().mean()


def _scalar_worker(rank, world):
    out = []
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    for two in (False, True):
        ref = Scalars(two)
        ref(x).backward()
        want = {n: p.grad for n, p in ref.named_parameters()}
        for face in ("functional", "shard"):
            model = Scalars(two)
            plan = sp.plan(model, [(r"lin\..*", sp.P("dp")), (r".*", sp.P())], sp.Mesh(dp=world), min_unit_bytes=0)
            if face == "functional":
                local = sp.shard_tree(dict(model.named_parameters()), plan)
                _, got = sp.value_and_grad(lambda p, x_: sp.functional_call(model, plan, p, (x_,)), plan)(local, x)
            else:
                sp.shard(model, plan)
                model(x).backward()
                got = {n: p.grad for n, p in model.named_parameters()}
            mine = {n: sp.shard_tree({m: want[m] for m in want}, plan, rank=rank)[n] for n in want}
            out.append((two, face, max(((got[n] - mine[n]).abs().max().item() if mine[n].numel() else 0.0)
                                       for n in want)))
    return out


@pytest.mark.timeout(120)
def test_a_buffer_of_scalar_parameters_lands_its_gradients():
    """A buffer holding only 0-d parameters: the one-call landing (torch._chunk_cat over dim 0) segfaulted
    the process for one scalar and raised for two; now the gradients land per view, as single-process."""
    for rank_results in run(_scalar_worker, 2, timeout=100):
        for two, face, diff in rank_results:
            assert diff <= 1e-6, (two, face, diff)
