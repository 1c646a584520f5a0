"""Probe: context parallelism under both faces."""
import os, sys
import torch
import shardplan as sp
from distributed import run
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import gpt

def worker(rank, world, mesh_text, face, strategy):
    mesh = sp.Mesh.parse(mesh_text)
    model, ref = gpt.build("tiny").init_weights(0), gpt.build("tiny").init_weights(0)
    plan = sp.plan(model, [(r".*", sp.P(tuple(a for a in mesh.axis_names)))], mesh, strategy=strategy, units=[r"layers\.\d+"], min_unit_bytes=0)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (4, 32), generator=g) for _ in range(3)]
    ro = torch.optim.AdamW(ref.parameters(), lr=3e-3); rl = []
    for x in data:
        l = ref(x, torch.roll(x, -1, 1)); l.backward(); ro.step(); ro.zero_grad(); rl.append(l.item())
    losses = []
    if face == "module":
        sp.shard(model, plan); opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for x in data:
            xs, ys, pos = sp.context_parallel.shard_batch(plan, rank, x, torch.roll(x, -1, 1))
            l = model(xs, ys, positions=pos); l.backward(); opt.step(); opt.zero_grad()
            t = l.detach().clone(); torch.distributed.all_reduce(t); losses.append(t.item() / world)
        full = sp.checkpoint.full_state_dict(model)
    else:
        local = sp.shard_tree(dict(model.named_parameters()), plan)
        opt = sp.optim.adamw(lr=3e-3); st = opt.init(local)
        vg = sp.value_and_grad(lambda p, a, b, c: sp.functional_call(model, plan, p, (a, b), {"positions": c}), plan)
        for x in data:
            xs, ys, pos = sp.context_parallel.shard_batch(plan, rank, x, torch.roll(x, -1, 1))
            l, gr = vg(local, xs, ys, pos); local, st = opt.update(gr, st, local)
            t = l.detach().clone(); torch.distributed.all_reduce(t); losses.append(t.item() / world)
        full = sp.unshard_tree(local, plan)
    worst = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()) if full else 0.0
    return dict(lossdiff=max(abs(a - b) for a, b in zip(losses, rl)), worst=worst)

if __name__ == "__main__":
    for mesh, world in ((sys.argv[1], int(sys.argv[2])),) if sys.argv[1:] else (("cp=2", 2),):
        for face in ("module", "functional"):
            try: print(mesh, face, run(worker, world, mesh, face, "optim_grads_params", timeout=300)[0], flush=True)
            except Exception as exc: print(mesh, face, "EXC", str(exc)[-600:])
