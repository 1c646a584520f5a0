"""Loops with more than one model in a step, from the outside-model sweep (once benchmarks/runs/sweep_misc.py):
alternating GAN steps (the generator's loss flows through the discriminator, whose gradients are dropped), a
frozen sharded teacher and a sharded student, and a WGAN-GP critic (a gradient penalty through
``torch.autograd.grad(create_graph=True)``: double backward through the units). Each trains on 2 gloo ranks
and matches unsharded data-parallel training in one process (fp32: losses rel 1e-5, parameters abs 1e-5).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardplan as sp
from distributed import run

pytestmark = pytest.mark.slow


def _mlp(seed, d=16, n=3, out=1):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(n)], nn.Linear(d, out))


def _shard(m, world, **kw):
    return sp.shard(m, sp.plan(m, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"\d+"], min_unit_bytes=0, **kw))


def _mean(loss):
    t = loss.detach().float().clone().reshape(())
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _compare(losses, ref, full, model):
    return (max(abs(a - b) / abs(b) for a, b in zip(losses, ref)),
            max((full[n] - p).abs().max().item() for n, p in model.named_parameters()))


def _gan_steps(G, D, rank, world, sharded):
    og, od = torch.optim.Adam(G.parameters(), lr=1e-3), torch.optim.Adam(D.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(3):
        z, real = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
        ranks = [rank] if sharded else range(world)
        tot = 0.0
        for r in ranks:
            zs, rs = z[r * 2:(r + 1) * 2], real[r * 2:(r + 1) * 2]
            ld = (F.softplus(-D(rs)).mean() + F.softplus(D(G(zs).detach())).mean()) / (1 if sharded else world)
            ld.backward()
            tot += _mean(ld) if sharded else ld.item()
        od.step()
        od.zero_grad()
        for r in ranks:
            lg = F.softplus(-D(G(z[r * 2:(r + 1) * 2]))).mean() / (1 if sharded else world)
            lg.backward()
            tot += _mean(lg) if sharded else lg.item()
        og.step()
        og.zero_grad()
        od.zero_grad()
        out.append(tot)
    return out


def _gan_worker(rank, world, order):
    G, D = _shard(_mlp(0, out=16), world, order=order), _shard(_mlp(1), world, order=order)
    losses = _gan_steps(G, D, rank, world, True)
    fg, fd = sp.checkpoint.full_state_dict(G), sp.checkpoint.full_state_dict(D)
    if rank:
        return None
    rG, rD = _mlp(0, out=16), _mlp(1)
    ref = _gan_steps(rG, rD, 0, world, False)
    return _compare(losses, ref, fg, rG), _compare(losses, ref, fd, rD)


def test_alternating_gan_steps_train_like_unsharded():
    """The discriminator runs twice per backward (real and generated): order='dynamic' (a fixed order refuses
    it, naming that option)."""
    for loss_rel, param_abs in run(_gan_worker, 2, "dynamic", timeout=120)[0]:
        assert loss_rel < 1e-5 and param_abs < 1e-5


def _teacher_worker(rank, world):
    T = _mlp(0)
    for p in T.parameters():
        p.requires_grad_(False)
    T, St = _shard(T, world), _shard(_mlp(1), world)
    opt = torch.optim.AdamW(St.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(3):
        x = torch.randn(4, 16, generator=g)[rank * 2:(rank + 1) * 2]
        with torch.no_grad():
            t = T(x)
        loss = (St(x) - t).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_mean(loss))
    full = sp.checkpoint.full_state_dict(St)
    if rank:
        return None
    rT, rS = _mlp(0), _mlp(1)
    ropt = torch.optim.AdamW(rS.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    ref = []
    for _ in range(3):
        x = torch.randn(4, 16, generator=g)
        loss = sum((rS(x[r * 2:(r + 1) * 2]) - rT(x[r * 2:(r + 1) * 2])).pow(2).mean() / world for r in range(world))
        loss.backward()
        ropt.step()
        ropt.zero_grad()
        ref.append(loss.item())
    return _compare(losses, ref, full, rS)


def test_a_frozen_sharded_teacher_distils_into_a_sharded_student():
    loss_rel, param_abs = run(_teacher_worker, 2, timeout=120)[0]
    assert loss_rel < 1e-5 and param_abs < 1e-5


def _gp_steps(D, rank, world, sharded, saliency):
    opt = torch.optim.Adam(D.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(3):
        real, fake, eps = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g), torch.rand(4, 1, generator=g)
        tot = 0.0
        for r in ([rank] if sharded else range(world)):
            sl = slice(r * 2, (r + 1) * 2)
            xh = (eps[sl] * real[sl] + (1 - eps[sl]) * fake[sl]).requires_grad_(True)
            gr, = torch.autograd.grad(D(xh).sum(), xh, create_graph=True)
            gp = (gr.norm(dim=1) - 1).pow(2).mean()
            loss = (D(fake[sl]).mean() - D(real[sl]).mean() + 10 * gp) / (1 if sharded else world)
            loss.backward()
            tot += _mean(loss) if sharded else loss.item()
        opt.step()
        opt.zero_grad()
        if saliency:  # an input-gradient call between steps
            x = real[:2].clone().requires_grad_(True)
            torch.autograd.grad(D(x).sum(), x)
        out.append(tot)
    return out


def _gp_worker(rank, world, order, saliency):
    D = _shard(_mlp(1), world, order=order)
    losses = _gp_steps(D, rank, world, True, saliency)
    full = sp.checkpoint.full_state_dict(D)
    if rank:
        return None
    rD = _mlp(1)
    return _compare(losses, _gp_steps(rD, 0, world, False, saliency), full, rD)


def test_a_gradient_penalty_through_double_backward_trains_like_unsharded():
    """The critic runs three times per step (order='dynamic'), with an input-gradient call between steps."""
    loss_rel, param_abs = run(_gp_worker, 2, "dynamic", True, timeout=120)[0]
    assert loss_rel < 1e-5 and param_abs < 1e-5
