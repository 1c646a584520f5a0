"""Loops that use more than one model or more than training: two sharded models in one step (GAN-style, a
frozen teacher), generation, load_full_state_dict, sync_module_states, BatchNorm buffers through checkpoints,
mixed precision with accumulation vs FSDP2.   PYTHONPATH=src:tests python benchmarks/runs/sweep_misc.py
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import sweep_outside as S  # noqa: E402
import shardplan as sp  # noqa: E402
from distributed import run  # noqa: E402


def mlp(seed, d=16, n=3, out=1):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(n)], nn.Linear(d, out))


def _shard(m, world, units=r"\d+"):
    return sp.shard(m, sp.plan(m, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[units], min_unit_bytes=0))


def gan_steps(G, D, rank, world, sharded):
    """Alternating GAN steps: D on real and G(z).detach(); then G through D (D's grads flow but are dropped)."""
    og = torch.optim.Adam(G.parameters(), lr=1e-3)
    od = torch.optim.Adam(D.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(3):
        z = torch.randn(4, 16, generator=g)
        real = torch.randn(4, 16, generator=g)
        ranks = [rank] if sharded else range(world)
        tot = 0.0
        for r in ranks:
            zs, rs = z[r * 2:(r + 1) * 2], real[r * 2:(r + 1) * 2]
            ld = (F.softplus(-D(rs)).mean() + F.softplus(D(G(zs).detach())).mean()) / (1 if sharded else world)
            ld.backward()
            tot += S.mean_loss(ld) if sharded else ld.item()
        od.step()
        od.zero_grad()
        for r in ranks:
            zs = z[r * 2:(r + 1) * 2]
            lg = F.softplus(-D(G(zs))).mean() / (1 if sharded else world)
            lg.backward()
            tot += S.mean_loss(lg) if sharded else lg.item()
        og.step()
        og.zero_grad()
        od.zero_grad()
        out.append(tot)
    return out


def w_gan(rank, world, order):
    G, D = mlp(0, out=16), mlp(1)
    kw = {"order": order} if order else {}
    G = sp.shard(G, sp.plan(G, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"\d+"], min_unit_bytes=0, **kw))
    D = sp.shard(D, sp.plan(D, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"\d+"], min_unit_bytes=0, **kw))
    losses = gan_steps(G, D, rank, world, True)
    fg, fd = sp.checkpoint.full_state_dict(G), sp.checkpoint.full_state_dict(D)
    if rank:
        return None
    rG, rD = mlp(0, out=16), mlp(1)
    ref = gan_steps(rG, rD, 0, world, False)
    diff = max((fg[n] - p).abs().max().item() for n, p in rG.named_parameters())
    diff = max(diff, max((fd[n] - p).abs().max().item() for n, p in rD.named_parameters()))
    return {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref)), "param_abs": diff}


def w_teacher(rank, world):
    """Distillation: a frozen sharded teacher and a sharded student in one step."""
    T, St = mlp(0), mlp(1)
    for p in T.parameters():
        p.requires_grad_(False)
    T, St = _shard(T, world), _shard(St, world)
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
        losses.append(S.mean_loss(loss))
    full = sp.checkpoint.full_state_dict(St)
    if rank:
        return None
    rT, rS = mlp(0), mlp(1)
    ropt = torch.optim.AdamW(rS.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    ref = []
    for _ in range(3):
        x = torch.randn(4, 16, generator=g)
        l = sum((rS(x[r * 2:(r + 1) * 2]) - rT(x[r * 2:(r + 1) * 2])).pow(2).mean() / world for r in range(world))
        l.backward()
        ropt.step()
        ropt.zero_grad()
        ref.append(l.item())
    return {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref)),
            "param_abs": max((full[n] - p).abs().max().item() for n, p in rS.named_parameters())}


def w_generate(rank, world):
    model, _, _, units = S.build("llama")
    ref = copy.deepcopy(model)
    plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=units, min_unit_bytes=0)
    sp.shard(model, plan)
    ids = torch.randint(1, S.V, (2, 5), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        logits = model(ids).logits
    model.train()
    # training still works after generation
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    ref.eval()
    with torch.no_grad():
        rout = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        rlogits = ref(ids).logits
    return {"tokens_equal": torch.equal(out, rout), "logit_abs": (logits - rlogits).abs().max().item()}


def w_load_full(rank, world):
    """Build with another seed, load_full_state_dict the seed-0 weights (held by rank 0), train 3 steps."""
    torch.manual_seed(1)
    model, _, loss_fn, units = S.MODELS["gpt2"]()
    src, _, _, _ = S.build("gpt2")
    sp.shard(model, sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=units, min_unit_bytes=0),
             sync_module_states=True)
    sp.checkpoint.load_full_state_dict(model, src.state_dict() if rank == 0 else {})
    opt = torch.optim.AdamW(model.parameters(), lr=S.LR, weight_decay=0.01)
    losses = []
    for (mb,) in S.batches("gpt2"):
        loss = loss_fn(model, S.chunk(mb, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(S.mean_loss(loss))
    full = sp.checkpoint.full_state_dict(model)
    if rank:
        return None
    ref, ref_losses, _ = S.reference("gpt2", world, {})
    return S.compare(ref, ref_losses, [{}] * world, losses, full, [{}] * world, world)


def w_sync_states(rank, world):
    """Ranks built with different seeds, sync_module_states=True: rank 0's values everywhere."""
    torch.manual_seed(rank)
    model, _, loss_fn, units = S.MODELS["bn"]()
    sp.shard(model, sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=units, min_unit_bytes=0),
             sync_module_states=True)
    full = sp.checkpoint.full_state_dict(model)
    if rank:
        return None
    torch.manual_seed(0)
    ref, _, _, _ = S.MODELS["bn"]()
    return {"param_abs": max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())}


def w_bn_ckpt(rank, world, path, phase):
    """BatchNorm running stats through sp.checkpoint: saved per rank? loaded how?"""
    model, _, loss_fn, units = S.build("bn")
    sp.shard(model, sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=units, min_unit_bytes=0))
    opt = torch.optim.AdamW(model.parameters(), lr=S.LR)
    if phase == "save":
        for (mb,) in S.batches("bn"):
            loss_fn(model, S.chunk(mb, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        sp.checkpoint.save(path, model, opt, step=3)
        return {k: v.clone() for k, v in model.named_buffers()}
    sp.checkpoint.load(path, model, opt)
    return {k: v.clone() for k, v in model.named_buffers()}


def w_mp_accum(rank, world):
    opts = {"mp": (torch.bfloat16, torch.float32), "accum": True, "clip": 0.05}
    return S.w_mp_pair(rank, world, "llama", opts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--gp", action="store_true")
    args = ap.parse_args()
    cases = {
        "gan_static": lambda: run(w_gan, 2, None, timeout=120)[0],
        "gan_dynamic": lambda: run(w_gan, 2, "dynamic", timeout=120)[0],
        "frozen_teacher": lambda: run(w_teacher, 2, timeout=120)[0],
        "generate_llama": lambda: run(w_generate, 2, timeout=120),
        "load_full_state_dict_gpt2": lambda: run(w_load_full, 2, timeout=120)[0],
        "sync_module_states_bn": lambda: run(w_sync_states, 2, timeout=120)[0],
        "mp_bf16_accum_clip_vs_fsdp2": lambda: run(w_mp_accum, 2, timeout=120)[0],
        "bn_buffers_ckpt_2to2": lambda: bn_ckpt(2, 2),
        "bn_buffers_ckpt_2to4": lambda: bn_ckpt(2, 4),
    }
    for name, fn in cases.items():
        if args.only and args.only not in name:
            continue
        t0 = time.time()
        try:
            res = fn()
            status = "ok"
        except BaseException as exc:  # noqa: BLE001
            res, status = str(exc)[-900:], "error"
        print(f"[{status}] {name} {res} {time.time() - t0:.1f}s", flush=True)


def bn_ckpt(ws, wl):
    with tempfile.TemporaryDirectory() as d:
        saved = run(w_bn_ckpt, ws, d + "/ck", "save", timeout=120)
        loaded = run(w_bn_ckpt, wl, d + "/ck", "load", timeout=120)
    out = {}
    for r, b in enumerate(loaded):
        src = saved[r] if r < len(saved) else None
        out[f"rank{r}_equals_saved_rank{r}"] = None if src is None else all(torch.equal(b[k], src[k]) for k in b)
        out[f"rank{r}_equals_saved_rank0"] = all(torch.equal(b[k], saved[0][k]) for k in b)
    out["saved_ranks_differ"] = not all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0] if saved[0][k].is_floating_point())
    return out


if __name__ == "__main__" and "--gp" not in sys.argv:
    main()


def gp_steps(D, rank, world, sharded, saliency=False):
    """WGAN-GP critic steps: a gradient penalty through torch.autograd.grad(create_graph=True), then backward
    (double backward through the units); with ``saliency``, an input-gradient call between steps."""
    opt = torch.optim.Adam(D.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(3):
        real = torch.randn(4, 16, generator=g)
        fake = torch.randn(4, 16, generator=g)
        eps = torch.rand(4, 1, generator=g)
        tot = 0.0
        for r in ([rank] if sharded else range(world)):
            sl = slice(r * 2, (r + 1) * 2)
            xh = (eps[sl] * real[sl] + (1 - eps[sl]) * fake[sl]).requires_grad_(True)
            gr, = torch.autograd.grad(D(xh).sum(), xh, create_graph=True)
            gp = (gr.norm(dim=1) - 1).pow(2).mean()
            loss = (D(fake[sl]).mean() - D(real[sl]).mean() + 10 * gp) / (1 if sharded else world)
            loss.backward()
            tot += S.mean_loss(loss) if sharded else loss.item()
        opt.step()
        opt.zero_grad()
        if saliency:
            x = real[:2].clone().requires_grad_(True)
            torch.autograd.grad(D(x).sum(), x)
        out.append(tot)
    return out


def w_gp(rank, world, order, saliency):
    D = mlp(1)
    kw = {"order": order} if order else {}
    D = sp.shard(D, sp.plan(D, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"\d+"], min_unit_bytes=0, **kw))
    losses = gp_steps(D, rank, world, True, saliency)
    fd = sp.checkpoint.full_state_dict(D)
    if rank:
        return None
    rD = mlp(1)
    ref = gp_steps(rD, 0, world, False, saliency)
    return {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref)),
            "param_abs": max((fd[n] - p).abs().max().item() for n, p in rD.named_parameters())}


def main2():
    for order in (None, "dynamic"):
        for sal in (False, True):
            try:
                res = run(w_gp, 2, order, sal, timeout=120)[0]
                status = "ok"
            except BaseException as exc:  # noqa: BLE001
                res, status = str(exc)[-700:], "error"
            print(f"[{status}] wgan_gp order={order} saliency={sal} {res}", flush=True)


if __name__ == "__main__" and "--gp" in sys.argv:
    main2()
