"""The same FSDP2 user code run with torch's ``fully_shard`` and with shardplan's: the numbers must agree (fp32,
rtol=atol=1e-6) or shardplan must refuse with its own error naming the call. Each spawned group runs many checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import shardplan as sp
from distributed import run

TOL = dict(rtol=1e-6, atol=1e-6)


class Blk(nn.Module):
    def __init__(self, d=8, h=12):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d=8, n=3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Blk(d) for _ in range(n))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _impl(kind):
    if kind == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        return fully_shard, MixedPrecisionPolicy
    return sp.fully_shard, sp.MixedPrecisionPolicy


def _wrap(kind, model, **kw):
    fully_shard, _ = _impl(kind)
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


def _data(rank, world, n=4, b=4):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x, y = torch.randn(b * world, 4, generator=g), torch.randn(b * world, 3, generator=g)
        out.append((x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]))
    return out


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _params(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().float().clone() for k, v in sd.items()}


def _both(fn, rank, world):
    out = {}
    for kind in ("torch", "sp"):
        try:
            out[kind] = fn(kind, rank, world)
        except Exception as exc:  # noqa: BLE001 - compared by the parent
            out[kind] = f"RAISES {type(exc).__name__}: {exc}"
        dist.barrier()
    return out


def _close(a, b) -> bool:
    if isinstance(a, dict):
        return set(a) == set(b) and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


def _check_same(results, names):
    for rank, res in enumerate(results):
        for name in names:
            got, want = res[name]["sp"], res[name]["torch"]
            assert not isinstance(want, str), (name, want)
            assert _close(got, want), (name, rank, got if isinstance(got, str) else "differs")


# -- checks ----------------------------------------------------------------------------------------------

def c_clip_grad_norm(kind, rank, world):
    """torch.nn.utils.clip_grad_norm_ on model.parameters(): the global norm (2 and inf), as over DTensors."""
    m = _wrap(kind, Net())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    out = []
    for i, (x, y) in enumerate(_data(rank, world)):
        F.mse_loss(m(x), y).backward()
        norm_type = float("inf") if i % 2 else 2.0
        out.append(_full(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, norm_type=norm_type)))
        grads = [p.grad for p in m.parameters() if p.grad is not None]  # torchtitan's spelling
        out.append(_full(torch.nn.utils.get_total_norm(grads, 2.0)))
        opt.step()
        opt.zero_grad()
    return dict(norms=out, p=_params(m))


def c_optimizer_state_dicts(kind, rank, world):
    """get_optimizer_state_dict(full) holds the full moments; set_* into a fresh model continues the same run;
    optimizer.state_dict() gives DTensor moments."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    d = _data(rank, world)
    m = _wrap(kind, Net())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x, y in d[:2]:
        F.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    types = sorted({type(v).__name__ for st in opt.state_dict()["state"].values() for v in st.values()})
    msd, osd = get_model_state_dict(m, options=full), get_optimizer_state_dict(m, opt, options=full)
    moments = {k: {s: _full(v) for s, v in st.items()} for k, st in osd["state"].items()} if rank == 0 else {}
    m2 = _wrap(kind, Net(seed=5))
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    bcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(m2, msd, options=bcast)
    set_optimizer_state_dict(m2, opt2, osd, options=bcast)
    losses = []
    for x, y in d[2:]:
        loss = F.mse_loss(m2(x), y)
        loss.backward()
        opt2.step()
        opt2.zero_grad()
        losses.append(loss.item())
    return dict(types=",".join(types), moments=moments, losses=losses, p=_params(m2))


CHECKS = [c_clip_grad_norm, c_optimizer_state_dicts]


def _worker(rank, world, names):
    return {f.__name__: _both(f, rank, world) for f in CHECKS if f.__name__ in names}


@pytest.mark.timeout(120)
def test_numbers_match_fsdp2_two_ranks():
    names = [c.__name__ for c in CHECKS]
    _check_same(run(_worker, 2, names, timeout=100), names)
