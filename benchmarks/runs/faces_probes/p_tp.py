"""Probe: tensor parallelism (both faces) vs one process. PYTHONPATH=src:tests python benchmarks/runs/faces_probes/p_tp.py WORLD [case...]"""
import sys, traceback
import optree, torch, torch.nn as nn, torch.nn.functional as F
import shardplan as sp
from distributed import run

TOL = 1e-5

class Pair(nn.Module):
    def __init__(s, d, h, bias=True):
        super().__init__(); s.norm = nn.LayerNorm(d); s.up = nn.Linear(d, h, bias=bias); s.down = nn.Linear(h, d, bias=bias)
    def forward(s, x): return x + s.down(F.gelu(s.up(s.norm(x))))

class M(nn.Module):
    def __init__(s, vocab=32, d=8, h=16, tied=True, n=2, bias=True):
        super().__init__(); torch.manual_seed(0)
        s.emb = nn.Embedding(vocab, d); s.pairs = nn.ModuleList(Pair(d, h, bias) for _ in range(n))
        s.head = nn.Linear(d, vocab, bias=False)
        if tied: s.head.weight = s.emb.weight
    def forward(s, x, y):
        h = s.emb(x)
        for p in s.pairs: h = p(h)
        return F.cross_entropy(s.head(h).flatten(0, 1), y.flatten())

def rules_vocab(data=("dp",)):
    d = data[0] if data else None
    cw = ("tp",) + tuple(data)
    return [(r"emb\.weight|head\.weight", sp.P(cw)), (r"pairs\.\d+\.up\.(weight|bias)", sp.P(cw)),
            (r"pairs\.\d+\.down\.weight", sp.P(d, "tp")), (r".*", sp.P(d) if d else sp.P())]

def rules_embpar(data=("dp",)):
    r = rules_vocab(data); d = data[0] if data else None
    return [(r"emb\.weight|head\.weight", sp.P(d, "tp"))] + r[1:]

def worker(rank, world, cases):
    out = {}
    for name, c in cases.items():
        try:
            out[name] = one(rank, world, **c)
        except Exception as exc:
            out[name] = "EXC " + type(exc).__name__ + ": " + str(exc)[:800] + "\n" + traceback.format_exc()[-1200:]
    return out

def one(rank, world, mesh, rules, strategy="optim_grads_params", vocab=32, tied=True, face="both", steps=3, clip=None, d=8, h=16, bias=True):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, vocab, (4, 6), generator=g), torch.randint(0, vocab, (4, 6), generator=g)) for _ in range(steps)]
    mk = lambda: M(vocab=vocab, tied=tied, d=d, h=h, bias=bias)
    ref = mk(); o = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1); rl = []
    for x, y in data:
        l = ref(x, y); l.backward(); rl.append(l.item())
        if clip: torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        o.step(); o.zero_grad()
    refp = {n: p.detach() for n, p in ref.state_dict().items()}
    res = {}
    mesh = sp.Mesh(**mesh)
    for f in (("module", "functional") if face == "both" else (face,)):
        model = mk()
        plan = sp.plan(model, rules, mesh, strategy=strategy, compute_axes=("tp",), units=[r"pairs\.\d+"], min_unit_bytes=0)
        D, di = plan.data_size, plan.data_index(rank)
        losses = []
        if f == "module":
            sp.shard(model, plan)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1)
            for x, y in data:
                l = model(x.chunk(D)[di], y.chunk(D)[di]); l.backward()
                if clip: sp.clip_grad_norm_(model, clip)
                opt.step(); opt.zero_grad()
                t = l.detach().clone(); torch.distributed.all_reduce(t); losses.append(t.item() / world)
            full = sp.checkpoint.full_state_dict(model)
            if rank != 0: full = None
        else:
            local = sp.shard_tree(dict(model.named_parameters()), plan)
            opt = sp.optim.adamw(lr=1e-2, eps=1e-6, weight_decay=0.1, mask=sp.optim.trainable(plan)); st = opt.init(local)
            vg = sp.value_and_grad(lambda p, a, b: sp.functional_call(model, plan, p, (a, b)), plan)
            for x, y in data:
                l, gr = vg(local, x.chunk(D)[di], y.chunk(D)[di])
                if clip: gr, _ = sp.optim.clip_by_global_norm(gr, clip, plan)
                local, st = opt.update(gr, st, local)
                t = l.detach().clone(); torch.distributed.all_reduce(t); losses.append(t.item() / world)
            full = sp.unshard_tree(local, plan)
        lw = max(abs(a - b) for a, b in zip(losses, rl))
        worst = max((full[n] - refp[n]).abs().max().item() for n in full) if full is not None else 0.0
        res[f] = dict(lossdiff=lw, worst=worst, ok=lw <= TOL and worst <= TOL)
    return res

def cases(world):
    c = {}
    if world == 2:
        c["tp2_vocab"] = dict(mesh={"tp": 2}, rules=rules_vocab(()))
        c["tp2_embpar"] = dict(mesh={"tp": 2}, rules=rules_embpar(()))
        c["dp1tp2"] = dict(mesh={"dp": 1, "tp": 2}, rules=rules_vocab())
        c["tp2_odd_vocab"] = dict(mesh={"tp": 2}, rules=rules_vocab(()), vocab=33)
        c["tp2_nobias_untied"] = dict(mesh={"tp": 2}, rules=rules_vocab(()), tied=False, bias=False)
    else:
        for s in ("optim_grads_params", "optim", "no_shard"):
            c[f"dp2tp2_vocab_{s}"] = dict(mesh={"dp": 2, "tp": 2}, rules=rules_vocab(), strategy=s)
        c["tp2dp2_vocab"] = dict(mesh={"tp": 2, "dp": 2}, rules=rules_vocab())
        c["dp2tp2_embpar"] = dict(mesh={"dp": 2, "tp": 2}, rules=rules_embpar())
        c["tp2dp2_embpar_clip"] = dict(mesh={"tp": 2, "dp": 2}, rules=rules_embpar(), clip=0.05)
        c["tp4_vocab"] = dict(mesh={"tp": 4}, rules=rules_vocab(()))
        c["tp4_h12"] = dict(mesh={"tp": 4}, rules=rules_vocab(()), h=12, vocab=36)
        c["dp2tp2_odd_d"] = dict(mesh={"dp": 2, "tp": 2}, rules=rules_vocab(), d=7, vocab=34)
        c["dp2tp2_untied_clip"] = dict(mesh={"dp": 2, "tp": 2}, rules=rules_vocab(), tied=False, clip=0.05)
    return c

if __name__ == "__main__":
    world = int(sys.argv[1]); cs = cases(world)
    if sys.argv[2:]: cs = {k: v for k, v in cs.items() if k in sys.argv[2:]}
    res = run(worker, world, cs, timeout=1200)
    for k in cs:
        print(k, res[0][k], flush=True)
