"""Probe: loading checkpoints of other models must raise naming the parameter."""
import os, sys, tempfile
import torch, torch.distributed as dist
import shardplan as sp
from distributed import run
sys.path.insert(0, os.path.dirname(__file__))
from p_tp import M

def w(rank, world, path):
    out = {}
    def mk(**kw):
        m = M(**kw)
        plan = sp.plan(m, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"pairs\.\d+"], min_unit_bytes=0)
        sp.shard(m, plan)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3), plan
    m, o, plan = mk()
    sp.checkpoint.save(path, m, o, step=1)
    local = sp.shard_tree(dict(M().named_parameters()), plan)
    sp.checkpoint.save_tree(path + "_tree", plan, {"params": local}, step=1)
    for tag, kw in {"h12": dict(h=12), "untied": dict(tied=False), "n3": dict(n=3), "n1": dict(n=1), "nobias": dict(bias=False), "vocab40": dict(vocab=40)}.items():
        m2, o2, p2 = mk(**kw)
        try:
            s = sp.checkpoint.load(path, m2, o2); out[tag] = f"NO ERROR step={s}"
        except Exception as exc:
            out[tag] = f"{type(exc).__name__}: {str(exc)[:400]}"
        try:
            s = sp.checkpoint.load(path, m2, None); out[tag + "/noopt"] = f"NO ERROR step={s}"
        except Exception as exc:
            out[tag + "/noopt"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    # a tree checkpoint loaded with a different plan's template
    m3 = M(h=12)
    p3 = sp.plan(m3, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), min_unit_bytes=0)
    try:
        sp.checkpoint.load_tree(path + "_tree", p3, {"params": sp.shard_tree(dict(m3.named_parameters()), p3)}); out["tree_h12"] = "NO ERROR"
    except Exception as exc:
        out["tree_h12"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    try:
        sp.checkpoint.load_tree(path, p3, {"params": sp.shard_tree(dict(m3.named_parameters()), p3)}); out["tree_from_module"] = "NO ERROR"
    except Exception as exc:
        out["tree_from_module"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out

if __name__ == "__main__":
    res = run(w, 2, tempfile.mkdtemp() + "/ck", timeout=300, expect_errors=True)
    for r, (s, v) in enumerate(res):
        if s != "ok": print("rank", r, v[-2000:]); continue
        if r == 0:
            for k, val in v.items(): print(k, "->", val.replace("\n", " | ")); 
