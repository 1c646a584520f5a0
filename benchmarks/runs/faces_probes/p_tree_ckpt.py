"""Probe: functional save_tree / load_tree across meshes (tp -> dp, dp -> tp) with AdamW state, vs one process."""
import os, sys, tempfile
import torch, torch.distributed as dist
import shardplan as sp
from distributed import run
sys.path.insert(0, os.path.dirname(__file__))
from p_tp import M, rules_vocab
N, K = 5, 2
def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 32, (4, 6), generator=g), torch.randint(0, 32, (4, 6), generator=g)) for _ in range(N)]
def cfg(name, world):
    return {"dp2tp2": (rules_vocab(), sp.Mesh(dp=2, tp=2), ("tp",), "optim_grads_params"),
            "tp2": (rules_vocab(()), sp.Mesh(tp=2), ("tp",), "optim"),
            "dp": ([(r".*", sp.P("dp"))], sp.Mesh(dp=world), (), "optim_grads"),
            "hsdp": ([(r".*", sp.P("dp"))], sp.Mesh(replica=2, dp=2), (), "optim_grads_params")}[name]
def w(rank, world, path, name, phase):
    rules, mesh, ca, strat = cfg(name, world)
    model = M()
    plan = sp.plan(model, rules, mesh, strategy=strat, compute_axes=ca, units=[r"pairs\.\d+"], min_unit_bytes=0)
    local = sp.shard_tree(dict(model.named_parameters()), plan)
    opt = sp.optim.adamw(lr=sp.optim.warmup_cosine(1e-2, 1, N), eps=1e-6, weight_decay=0.1); st = opt.init(local)
    vg = sp.value_and_grad(lambda p, a, b: sp.functional_call(model, plan, p, (a, b)), plan)
    D, di = plan.data_size, plan.data_index(rank)
    start = 0
    if phase == "load":
        tree, start = sp.checkpoint.load_tree(path, plan, {"params": local, "opt": st}); local, st = tree["params"], tree["opt"]
    losses = []
    for s, (x, y) in enumerate(data()):
        if s < start: continue
        if phase == "save" and s == K:
            sp.checkpoint.save_tree(path, plan, {"params": local, "opt": st}, step=K)
        l, g = vg(local, x.chunk(D)[di], y.chunk(D)[di]); local, st = opt.update(g, st, local)
        t = l.clone(); dist.all_reduce(t); losses.append(t.item() / world)
    return losses, sp.unshard_tree(local, plan), float(st["step"])
if __name__ == "__main__":
    m = M(); o = torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1); sch = sp.optim.as_lr_scheduler(o, sp.optim.warmup_cosine(1e-2, 1, N)); rl = []
    for x, y in data():
        l = m(x, y); l.backward(); o.step(); o.zero_grad(); sch.step(); rl.append(l.item())
    ref = {n: p.detach() for n, p in m.state_dict().items()}
    for w1, c1, w2, c2 in ((4, "dp2tp2", 2, "dp"), (2, "tp2", 4, "hsdp"), (4, "hsdp", 2, "tp2"), (2, "dp", 4, "dp2tp2")):
        path = tempfile.mkdtemp() + "/t"
        a = run(w, w1, path, c1, "save", timeout=300)[0]
        b = run(w, w2, path, c2, "load", timeout=300)[0]
        for tag, (losses, full, step) in (("uninterrupted", a), ("resumed", b)):
            lw = max(abs(p - q) for p, q in zip(losses, rl[N - len(losses):]))
            pw = max((full[n] - ref[n]).abs().max().item() for n in full)
            print(f"{'OK' if lw <= 1e-5 and pw <= 1e-5 else 'MISMATCH'} {w1}:{c1} -> {w2}:{c2} {tag}: loss {lw:.1e} params {pw:.1e} step {step}", flush=True)
