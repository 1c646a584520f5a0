"""Probe: a column-parallel output read by something other than its row-parallel sibling (documented: unseen)."""
import os, sys
import torch, torch.nn as nn, torch.nn.functional as F
import shardplan as sp
from distributed import run
sys.path.insert(0, os.path.dirname(__file__))
import p_tp
class Pair2(p_tp.Pair):
    def forward(s, x):
        u = s.up(s.norm(x))
        return x + s.down(F.gelu(u)) + u.mean(-1, keepdim=True)   # the mean mixes the column-parallel features
def w(rank, world, trace):
    p_tp.Pair = Pair2
    m, ref = p_tp.M(), p_tp.M()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 32, (4, 6), generator=g), torch.randint(0, 32, (4, 6), generator=g)
    want = ref(x, y).item()
    try:
        plan = sp.plan(m, p_tp.rules_vocab(()), sp.Mesh(tp=world), compute_axes=("tp",), units=[r"pairs\.\d+"], min_unit_bytes=0,
                       trace=(x, y) if trace else None)
        sp.shard(m, plan)
        return abs(m(x, y).item() - want)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"
for trace in (False, True):
    print("traced" if trace else "untraced", run(w, 2, trace, timeout=120))
