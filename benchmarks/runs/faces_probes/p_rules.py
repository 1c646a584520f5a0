"""Probe: odd shapes under rules on 4 ranks, both faces, vs one process. PYTHONPATH=src:tests python benchmarks/runs/faces_probes/p_rules.py"""
import sys, traceback, warnings
import torch, torch.nn as nn, torch.nn.functional as F
import shardplan as sp
from distributed import run

class Odd(nn.Module):
    def __init__(s):
        super().__init__(); torch.manual_seed(0)
        s.a = nn.Linear(7, 7); s.b = nn.Linear(7, 3)
        s.one = nn.Parameter(torch.tensor([0.7]))
        s.empty = nn.Parameter(torch.zeros(0, 5))
        s.scalar = nn.Parameter(torch.tensor(1.1))
        s.wide = nn.Parameter(torch.randn(3, 7) * 0.3)
        s.blk = nn.ModuleList([nn.Linear(7, 7) for _ in range(2)])
    def forward(s, x):
        h = torch.tanh(s.a(x)) * s.one + s.empty.sum()
        for b in s.blk: h = h + torch.tanh(b(h))
        h = h * s.scalar
        return (s.b(h) + h @ s.wide.T).square().mean()

RULESETS = {
  "dp_all": lambda ax: [(r"scalar", sp.P()), (r".*", sp.P(ax))],
  "dim1": lambda ax: [(r"scalar", sp.P()), (r".*\.weight|wide", sp.P(None, ax)), (r"empty", sp.P(None, ax)), (r".*", sp.P(ax))],
  "mixed": lambda ax: [(r"scalar|one", sp.P()), (r"blk\.0\..*", sp.P()), (r"blk\..*", sp.P(ax)), (r"a\.weight", "_ " + ax), (r".*", sp.P(ax))],
}

def worker(rank, world, cases):
    out = {}
    for name, c in cases.items():
        try: out[name] = one(rank, world, **c)
        except Exception as exc: out[name] = "EXC " + type(exc).__name__ + ": " + str(exc)[:600]
    return out

def one(rank, world, rules, mesh, strategy, face, layout="auto", steps=3):
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(24, 7, generator=g) for _ in range(steps)]
    ref = Odd(); o = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    for x in data:
        ref(x).backward(); o.step(); o.zero_grad()
    want = {n: p.detach() for n, p in ref.named_parameters()}
    m = sp.Mesh(**mesh); ax = "shard" if "shard" in mesh else "dp"
    model = Odd()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = sp.plan(model, RULESETS[rules](ax), m, strategy=strategy, units=[r"blk\.\d+"], min_unit_bytes=0, layout=layout)
    D, di = plan.data_size, plan.data_index(rank)
    if face == "module":
        sp.shard(model, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
        for x in data:
            model(x.chunk(D)[di]).backward(); sp.clip_grad_norm_(model, 1e9); opt.step(); opt.zero_grad()
        full = sp.checkpoint.full_state_dict(model)
        if rank: return 0.0
    else:
        local = sp.shard_tree(dict(model.named_parameters()), plan)
        opt = sp.optim.adamw(lr=1e-2, weight_decay=0.1, eps=1e-6); st = opt.init(local)
        vg = sp.value_and_grad(lambda p, x: sp.functional_call(model, plan, p, (x,)), plan)
        for x in data:
            l, gr = vg(local, x.chunk(D)[di]); gr, _ = sp.optim.clip_by_global_norm(gr, 1e9, plan); local, st = opt.update(gr, st, local)
        full = sp.unshard_tree(local, plan)
    return max((full[n] - want[n]).abs().max().item() if want[n].numel() else 0.0 for n in want)

if __name__ == "__main__":
    world = int(sys.argv[1])
    cases = {}
    meshes = [{"dp": world}] + ([{"replica": 2, "shard": 2}] if world == 4 else [])
    for r in RULESETS:
        for mi, mesh in enumerate(meshes):
            for s in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
                for face in ("module", "functional"):
                    for layout in ("auto", "chunked"):
                        cases[f"{r}/{mi}/{s}/{face}/{layout}"] = dict(rules=r, mesh=mesh, strategy=s, face=face, layout=layout)
    if sys.argv[2:]: cases = {k: v for k, v in cases.items() if any(a in k for a in sys.argv[2:])}
    res = run(worker, world, cases, timeout=1500)
    bad = 0
    for k in cases:
        v = [r[k] for r in res]
        worst = [x for x in v if isinstance(x, str) or x > 1e-5]
        if worst: bad += 1; print("BAD", k, worst[0] if isinstance(worst[0], str) else max(x for x in v if not isinstance(x, str)))
    print(f"{len(cases) - bad}/{len(cases)} ok")
