"""Probe: checkpoints across worlds, meshes, ZeRO levels, optimizers; PYTHONPATH=src:tests python benchmarks/runs/faces_probes/p_ckpt.py"""
import os, sys, tempfile, traceback, time
import torch, torch.distributed as dist
import shardplan as sp
from distributed import run
sys.path.insert(0, os.path.dirname(__file__))
from p_tp import M, rules_vocab, rules_embpar

N, K = 5, 2

def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 32, (4, 6), generator=g), torch.randint(0, 32, (4, 6), generator=g)) for _ in range(N)]

def groups(named, opt):
    dec = [p for n, p in named if p.dim() >= 2]; nod = [p for n, p in named if p.dim() < 2]
    if opt == "adamw":
        return torch.optim.AdamW([{"params": dec, "weight_decay": 0.1}, {"params": nod, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2, eps=1e-6)
    return torch.optim.SGD([{"params": dec, "weight_decay": 0.01}, {"params": nod, "weight_decay": 0.0, "lr": 0.02}], lr=0.05, momentum=0.9)

def reference(opt):
    m = M(); o = groups(list(m.named_parameters()), opt); losses = []
    for x, y in data():
        l = m(x, y); l.backward(); o.step(); o.zero_grad(); losses.append(l.item())
    return losses, {n: p.detach() for n, p in m.state_dict().items()}

def cfg(name, world):
    if name == "dp":
        return rules_vocab(()) and [(r".*", sp.P("dp"))], sp.Mesh(dp=world), (), "optim_grads_params"
    if name == "dp_zero1":
        return [(r".*norm.*", sp.P()), (r".*", sp.P("dp"))], sp.Mesh(dp=world), (), "optim"
    if name == "dp_zero2_dim1":
        return [(r".*up\.weight", sp.P(None, "dp")), (r".*", sp.P("dp"))], sp.Mesh(dp=world), (), "optim_grads"
    if name == "dp2tp2":
        return rules_vocab(), sp.Mesh(dp=2, tp=2), ("tp",), "optim"
    if name == "tp2dp2_embpar":
        return rules_embpar(), sp.Mesh(tp=2, dp=2), ("tp",), "optim_grads_params"
    if name == "tp2":
        return rules_vocab(()), sp.Mesh(tp=2), ("tp",), "optim_grads_params"
    if name == "hsdp":
        return [(r".*", sp.P("dp"))], sp.Mesh(replica=2, dp=2), (), "optim_grads_params"
    raise KeyError(name)

def make(rank, world, name, opt, seed=0):
    rules, mesh, ca, strat = cfg(name, world)
    model = M()
    if seed:
        with torch.no_grad():
            for p in model.parameters(): p.mul_(0.5).add_(0.1)
    plan = sp.plan(model, rules, mesh, strategy=strat, compute_axes=ca, units=[r"pairs\.\d+"], min_unit_bytes=0)
    sp.shard(model, plan)
    return model, groups(list(model.named_parameters()), opt), plan

def steps(model, o, plan, rank, world, batches):
    D, di = plan.data_size, plan.data_index(rank); out = []
    for x, y in batches:
        l = model(x.chunk(D)[di], y.chunk(D)[di]); l.backward(); o.step(); o.zero_grad()
        t = l.detach().clone(); dist.all_reduce(t); out.append(t.item() / world)
    return out

def save_w(rank, world, path, name, opt, mode):
    model, o, plan = make(rank, world, name, opt)
    d = data()
    first = steps(model, o, plan, rank, world, d[:K])
    if mode == "async":
        fut = sp.checkpoint.async_save(path, model, o, step=K)
        rest = steps(model, o, plan, rank, world, d[K:])  # trains while writing
        fut.result()
    else:
        sp.checkpoint.save(path, model, o, step=K)
        rest = steps(model, o, plan, rank, world, d[K:])
    full = sp.checkpoint.full_state_dict(model)
    return first + rest, full

def load_w(rank, world, path, name, opt):
    model, o, plan = make(rank, world, name, opt, seed=1)
    step = sp.checkpoint.load(path, model, o)
    lrs = [g["lr"] for g in o.param_groups]; wds = [g["weight_decay"] for g in o.param_groups]
    rest = steps(model, o, plan, rank, world, data()[step:])
    return step, rest, sp.checkpoint.full_state_dict(model), lrs, wds

def compare(tag, ref, got_losses, got_full, start=0):
    lw = max(abs(a - b) for a, b in zip(got_losses, ref[0][start:]))
    worst = max((got_full[n] - ref[1][n]).abs().max().item() for n in ref[1] if n in got_full)
    missing = [n for n in ref[1] if n not in got_full]
    ok = lw <= 1e-5 and worst <= 1e-5 and not missing
    print(f"{'OK ' if ok else 'MISMATCH '}{tag}: lossdiff={lw:.2e} paramdiff={worst:.2e} missing={missing}", flush=True)

if __name__ == "__main__":
    combos = [  # (save world, save cfg, load world, load cfg, opt, mode)
        (2, "dp", 4, "dp2tp2", "adamw", "sync"),
        (4, "dp2tp2", 2, "dp_zero2_dim1", "adamw", "sync"),
        (4, "tp2dp2_embpar", 2, "tp2", "sgd", "async"),
        (2, "tp2", 4, "hsdp", "sgd", "sync"),
        (4, "hsdp", 2, "dp_zero1", "adamw", "async"),
        (2, "dp_zero1", 4, "tp2dp2_embpar", "sgd", "async"),
    ]
    sel = sys.argv[1:]
    for i, (w1, c1, w2, c2, opt, mode) in enumerate(combos):
        if sel and str(i) not in sel: continue
        tag = f"{w1}:{c1} -> {w2}:{c2} {opt} {mode}"
        try:
            ref = reference(opt)
            path = tempfile.mkdtemp() + "/ck"
            r = run(save_w, w1, path, c1, opt, mode, timeout=300)
            compare(tag + " [uninterrupted]", ref, r[0][0], r[0][1])
            r2 = run(load_w, w2, path, c2, opt, timeout=300)
            step, rest, full, lrs, wds = r2[0]
            print("   groups after load: lr", lrs, "wd", wds)
            compare(tag + " [resumed]", ref, rest, full, start=step)
        except Exception as exc:
            print("EXC", tag, type(exc).__name__, str(exc)[-1500:], flush=True)
