"""Edge cases of ordinary training loops, on 2 gloo CPU ranks, against data-parallel semantics computed in one
process (see sweep_outside.py).   PYTHONPATH=src:tests python benchmarks/runs/sweep_edges.py [--only SUBSTR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import sweep_outside as S  # noqa: E402
import shardplan as sp  # noqa: E402
from distributed import run  # noqa: E402

V = S.V


class Cond(nn.Module):
    """layers (units) + a branch used only at step 1, one used only on ranks whose chunk starts with an even token,
    and an aux head computed but never in the loss."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)])
        self.only_step1 = nn.Linear(32, 32)
        self.rank_dep = nn.Linear(32, 32)
        self.aux = nn.Linear(32, 5)
        self.head = nn.Linear(32, V)
        self.step = 0

    def forward(self, ids):
        x = self.emb(ids)
        for l in self.layers:
            x = l(x)
        if self.step == 1:
            x = x + self.only_step1(x)
        if int(ids[0, 0]) % 2 == 0:
            x = x + self.rank_dep(x)
        self.last_aux = self.aux(x.detach())
        return self.head(x)


class Scalars(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.tiny = nn.Parameter(torch.randn(3))
        self.row = nn.Parameter(torch.randn(1, 32))
        self.head = nn.Linear(32, V)

    def forward(self, ids):
        x = self.emb(ids) + self.row
        for l in self.layers:
            x = torch.tanh(l(x))
        x = x * self.scale + self.tiny.sum()
        return self.head(x)


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(32, V)

    def enc(self, ids):
        x = self.emb(ids)
        for l in self.layers:
            x = l(x)
        return x

    def forward(self, ids):
        a, b = self.enc(ids), self.enc(ids.flip(1))
        return self.head(a + b)


class Reused(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        blk = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.layers = nn.ModuleList([blk, nn.Sequential(nn.Linear(32, 32), nn.Tanh()), blk])
        self.head = nn.Linear(32, V)

    def forward(self, ids):
        x = self.emb(ids)
        for l in self.layers:
            x = l(x)
        return self.head(x)


class CkptBlocks(nn.Module):
    """torch.utils.checkpoint around each unit."""

    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(V, 32)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)])
        self.head = nn.Linear(32, V)

    def forward(self, ids):
        x = self.emb(ids)
        for l in self.layers:
            x = x + torch.utils.checkpoint.checkpoint(l, x, use_reentrant=self.reentrant)
        return self.head(x)


def llama_gc(reentrant):
    def b():
        m, mk, lf, u = S.m_llama()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.config.use_cache = False
        return m, mk, lf, u
    return b


SCEN = {
    # name: (builder -> (model, batch_fn, loss_fn, units), options)
    "cond_unused": (lambda: (Cond(), S._tok_batch, S._ce, [r"layers\.\d+"]), {}),
    "cond_unused_functional": (lambda: (Cond(), S._tok_batch, S._ce, [r"layers\.\d+"]), {"face": "functional"}),
    "cond_unused_fully_shard": (lambda: (Cond(), S._tok_batch, S._ce, [r"layers\.\d+"]), {"face": "fully_shard"}),
    "cond_unused_optim": (lambda: (Cond(), S._tok_batch, S._ce, [r"layers\.\d+"]), {"plan": {"strategy": "optim"}}),
    "cond_unused_grads": (lambda: (Cond(), S._tok_batch, S._ce, [r"layers\.\d+"]), {"plan": {"strategy": "optim_grads"}}),
    "cond_unused_accum": (lambda: (Cond(), S._tok_batch, S._ce, [r"layers\.\d+"]), {"accum": "no_sync"}),
    "freeze_after_shard": (S.m_llama, {"freeze_after": r"model\.layers\.0\..*"}),
    "freeze_after_shard_fully": (S.m_llama, {"freeze_after": r"model\.layers\.0\..*", "face": "fully_shard"}),
    "freeze_partial_unit": (S.m_llama, {"frozen": r"model\.layers\.1\.self_attn\.q_proj\.weight"}),
    "accum_both_sync": (S.m_llama, {"accum": "sync"}),
    "zero_grad_not_none": (S.m_gpt2, {"set_to_none": False, "accum": "no_sync"}),
    "eval_nograd_between": (S.m_llama, {"eval": "no_grad"}),
    "eval_grad_between": (S.m_llama, {"eval": "grad"}),
    "eval_nograd_between_noraf": (S.m_llama, {"eval": "no_grad", "plan": {"reshard_after_forward": False}}),
    "inference_mode_between": (S.m_llama, {"eval": "inference_mode"}),
    "gc_llama_nonreentrant": (llama_gc(False), {}),
    "gc_llama_reentrant": (llama_gc(True), {}),
    "ckpt_blocks_nonreentrant": (lambda: (CkptBlocks(False), S._tok_batch, S._ce, [r"layers\.\d+"]), {}),
    "ckpt_blocks_reentrant": (lambda: (CkptBlocks(True), S._tok_batch, S._ce, [r"layers\.\d+"]), {}),
    "scalars_w2": (lambda: (Scalars(), S._tok_batch, S._ce, [r"layers\.\d+"]), {}),
    "scalars_w4": (lambda: (Scalars(), S._tok_batch, S._ce, [r"layers\.\d+"]), {"world": 4}),
    "scalars_w4_functional": (lambda: (Scalars(), S._tok_batch, S._ce, [r"layers\.\d+"]), {"world": 4, "face": "functional"}),
    "siamese_static": (lambda: (Siamese(), S._tok_batch, S._ce, [r"layers\.\d+"]), {}),
    "siamese_dynamic": (lambda: (Siamese(), S._tok_batch, S._ce, [r"layers\.\d+"]), {"plan": {"order": "dynamic"}}),
    "reused_block": (lambda: (Reused(), S._tok_batch, S._ce, [r"layers\.\d+"]), {}),
    "reused_block_dynamic": (lambda: (Reused(), S._tok_batch, S._ce, [r"layers\.\d+"]), {"plan": {"order": "dynamic"}}),
    "reused_block_fully_shard": (lambda: (Reused(), S._tok_batch, S._ce, [r"layers\.\d+"]), {"face": "fully_shard"}),
    "reused_block_functional": (lambda: (Reused(), S._tok_batch, S._ce, [r"layers\.\d+"]), {"face": "functional"}),
    "shared_fully_shard_w4": (S.m_shared, {"face": "fully_shard", "world": 4}),
    "rnn_w4_functional": (S.m_rnn, {"face": "functional", "world": 4}),
    "t5_w4_fully_shard": (S.m_t5, {"face": "fully_shard", "world": 4}),
    "clip_zero1_accum": (S.m_llama, {"clip": 0.01, "accum": "no_sync", "plan": {"strategy": "optim"}}),
    "clip_zero0": (S.m_gpt2, {"clip": 0.01, "plan": {"strategy": "no_shard"}}),
    "clip_zero2_w4_frozen": (S.m_t5, {"clip": 0.01, "plan": {"strategy": "optim_grads"}, "world": 4,
                                      "frozen": r"decoder\.block\.0\..*"}),
    "clip_inf_zero1": (S.m_llama, {"clip": 0.01, "norm_type": float("inf"), "plan": {"strategy": "optim"}}),
    "gc_llama_accum_clip": (llama_gc(False), {"accum": "no_sync", "clip": 0.05}),
    "frozen_tied_embedding": (S.m_llama, {"frozen": r"model\.embed_tokens\.weight"}),
    "frozen_tied_embedding_functional": (S.m_llama, {"frozen": r"model\.embed_tokens\.weight", "face": "functional"}),
    "clip_inf_frozen": (S.m_llama, {"clip": 0.01, "norm_type": float("inf"), "frozen": r"model\.layers\.0\..*"}),
    "clip_2_frozen_w4": (S.m_gpt2, {"clip": 0.01, "frozen": r"transformer\.h\.0\..*", "world": 4}),
}


def build(name):
    torch.manual_seed(0)
    return SCEN[name][0]()


def set_step(model, i):
    for m in model.modules():
        if hasattr(m, "step") and isinstance(getattr(m, "step"), int):
            m.step = i


def freeze(model, pattern):
    import re
    for n, p in model.named_parameters():
        if pattern and re.fullmatch(pattern, n):
            p.requires_grad_(False)


def step_batches(name, n_micro):
    g = torch.Generator().manual_seed(3)
    mk = build(name)[1]
    return [[mk(g, S.B) for _ in range(n_micro)] for _ in range(S.STEPS)]


def evaluate(model, batch, how, loss_fn):
    was = model.training
    model.eval()
    if how == "no_grad":
        with torch.no_grad():
            out = loss_fn(model, batch).item()
    elif how == "inference_mode":
        with torch.inference_mode():
            out = loss_fn(model, batch).item()
    else:
        out = loss_fn(model, batch).item()  # a forward whose graph is dropped without backward
    model.train(was)
    return out


def loop(model, name, opts, rank, world, loss_fn, sharded):
    """One training loop for both the sharded model (sharded=True, this rank's chunk) and the reference
    (sharded=False: every rank's chunk in turn, loss / world)."""
    n_micro = 2 if opts.get("accum") else 1
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=S.LR, weight_decay=0.01)
    losses, evals, norms = [], [], []
    for i, mbs in enumerate(step_batches(name, n_micro)):
        set_step(model, i)
        if i == 1 and opts.get("freeze_after"):
            freeze(model, opts["freeze_after"])
        total = 0.0
        ranks = [rank] if sharded else range(world)
        for r in ranks:
            for j, mb in enumerate(mbs):
                loss = loss_fn(model, S.chunk(mb, r, world)) / n_micro
                if not sharded:
                    loss = loss / world
                if sharded and opts.get("accum") == "no_sync" and j < n_micro - 1:
                    with sp.no_sync(model):
                        loss.backward()
                else:
                    loss.backward()
                total += S.mean_loss(loss) if sharded else loss.item()
        if opts.get("clip"):
            nt = opts.get("norm_type", 2.0)
            if sharded:
                norms.append(float(sp.clip_grad_norm_(model, opts["clip"], nt)))
            else:
                norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], opts["clip"], nt)))
        opt.step()
        opt.zero_grad(set_to_none=opts.get("set_to_none", True))
        losses.append(total)
        if opts.get("eval") and i == 0:
            b = S.chunk(mbs[0], rank, world) if sharded else mbs[0]
            evals.append(evaluate(model, b, opts["eval"], loss_fn))
    return losses, norms


def functional_loop(model, name, opts, rank, world, loss_fn, plan):
    params = sp.shard_tree(dict(model.named_parameters()), plan)
    opt = sp.optim.adamw(lr=S.LR, weight_decay=0.01, mask=sp.optim.trainable(plan))
    state = opt.init(params)

    def fn(p, b):
        class Proxy:
            def __call__(self, *a, **k):
                return sp.functional_call(model, plan, p, a, k)
        return loss_fn(Proxy(), b)

    vg = sp.value_and_grad(fn, plan)
    losses = []
    for i, (mb,) in enumerate(step_batches(name, 1)):
        set_step(model, i)
        loss, grads = vg(params, S.chunk(mb, rank, world))
        params, state = opt.update(grads, state, params)
        losses.append(S.mean_loss(loss))
    return losses, sp.unshard_tree(params, plan)


def worker(rank, world, name):
    import re
    opts = SCEN[name][1]
    model, _, loss_fn, units = build(name)
    freeze(model, opts.get("frozen"))
    face = opts.get("face", "shard")
    norms = []
    if face == "fully_shard":
        for n, m in model.named_modules():
            if n and any(re.fullmatch(u, n) for u in units):
                sp.fully_shard(m)
        sp.fully_shard(model)
    else:
        rules = [(r"scale", sp.P())] if name.startswith("scalars") else []
        plan = sp.plan(model, rules + [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=units, min_unit_bytes=0,
                       **opts.get("plan", {}))
    if face == "functional":
        losses, full = functional_loop(model, name, opts, rank, world, loss_fn, plan)
    else:
        if face == "shard":
            sp.shard(model, plan)
        losses, norms = loop(model, name, opts, rank, world, loss_fn, True)
        full = sp.checkpoint.full_state_dict(model)
    if rank != 0:
        return None
    ref, _, _, _ = build(name)
    freeze(ref, opts.get("frozen"))
    ref_losses, ref_norms = loop(ref, name, opts, 0, world, loss_fn, False)
    res = S.compare(ref, ref_losses, [{}] * world, losses, full, [{}] * world, world)
    res["losses"], res["ref_losses"] = losses, ref_losses
    if norms:
        res["norm_rel"] = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    for name, (_, opts) in SCEN.items():
        if args.only and args.only not in name:
            continue
        t0 = time.time()
        try:
            res = run(worker, opts.get("world", 2), name, timeout=120)[0]
            status = "ok"
        except BaseException as exc:  # noqa: BLE001
            res, status = {"error": str(exc)[-1200:]}, "error"
        brief = {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in res.items()
                 if k in ("loss_rel", "param_abs", "worst_param", "norm_rel")}
        flag = "" if status != "ok" or (res["loss_rel"] < 1e-5 and res["param_abs"] < 1e-5) else " <-- MISMATCH"
        print(f"[{status}] {name} {brief} {time.time() - t0:.1f}s{flag}", flush=True)
        if status != "ok":
            print("   ", res["error"][-700:].replace("\n", "\n    "), flush=True)


if __name__ == "__main__":
    main()
