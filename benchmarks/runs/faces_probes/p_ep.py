"""Probe: expert parallelism (uneven loads, empty experts, meshes, strategies, functional face)."""
import os, sys, traceback
import torch
import shardplan as sp
from distributed import run
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import moe

def route_by_token(model, k, pick):
    """Token id t goes to experts pick(t) (a list of k), the router still takes gradients through the weights."""
    def forward(self, x, _ids=None):
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        ids = self._ids.reshape(-1)
        index = torch.tensor([pick(int(t)) for t in ids], dtype=torch.long).view(-1, k)
        w = probs.gather(1, index)
        return probs, w / w.sum(-1, keepdim=True), index
    for layer in model.layers:
        layer.moe.router.forward = forward.__get__(layer.moe.router)
    orig = model.forward
    def fwd(tokens, targets=None, **kw):
        for layer in model.layers: layer.moe.router._ids = tokens
        return orig(tokens, targets, **kw)
    model.forward = fwd

PICKS = {
  "all_to_e0": (1, lambda t: [0]),                    # every token to expert 0; experts 1..E-1 get nothing
  "all_to_last": (2, lambda t: [6, 7]),               # both experts on the last ep rank
  "by_half": (1, lambda t: [0] if t < 128 else [5]),  # two experts only
  "spread3": (3, lambda t: [t % 8, (t * 3 + 1) % 8, (t * 5 + 2) % 8] if len({t % 8, (t * 3 + 1) % 8, (t * 5 + 2) % 8}) == 3 else [0, 1, 2]),
}

def worker(rank, world, cases):
    out = {}
    for name, c in cases.items():
        try: out[name] = one(rank, world, **c)
        except Exception as exc: out[name] = "EXC " + type(exc).__name__ + ": " + str(exc)[:700]
    return out

def one(rank, world, mesh, pick, strategy="optim_grads_params", experts=8, face="module", clip=1.0, skew_data=False):
    k, fn = PICKS[pick]
    mesh = sp.Mesh.parse(mesh)
    mk = lambda: moe.build("tiny", experts=experts, top_k=k).init_weights(0)
    model, ref = mk(), mk()
    route_by_token(model, k, fn); route_by_token(ref, k, fn)
    plan = sp.plan(model, moe.rules_for(mesh), mesh, strategy=strategy, units=moe.UNITS, min_unit_bytes=0)
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(3):
        x = torch.randint(0, 256, (8, 16), generator=g)
        if skew_data:  # data slice 0 only low tokens, others only high
            x[: 8 // plan.data_size] %= 128
        data.append(x)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    rl = []
    for x in data:
        r = ref(x, x); r.backward()
        if face == "functional":  # JAX convention: unused parameters get zero gradients (AdamW still decays them)
            for p_ in ref.parameters():
                if p_.grad is None: p_.grad = torch.zeros_like(p_)
        if clip: torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step(); ref_opt.zero_grad(); rl.append(r.item())
    D, di = plan.data_size, plan.data_index(rank)
    losses = []
    if face == "module":
        sp.shard(model, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for x in data:
            xs = x.chunk(D)[di]
            loss = model(xs, xs); loss.backward()
            if clip: sp.clip_grad_norm_(model, clip)
            opt.step(); opt.zero_grad()
            t = loss.detach().clone(); torch.distributed.all_reduce(t); losses.append(t.item() / world)
        full = sp.checkpoint.full_state_dict(model)
    else:
        local = sp.shard_tree(dict(model.named_parameters()), plan)
        opt = sp.optim.adamw(lr=3e-3); st = opt.init(local)
        vg = sp.value_and_grad(lambda p, a: sp.functional_call(model, plan, p, (a, a)), plan)
        for x in data:
            l, gr = vg(local, x.chunk(D)[di])
            if clip: gr, _ = sp.optim.clip_by_global_norm(gr, clip, plan)
            local, st = opt.update(gr, st, local)
            t = l.detach().clone(); torch.distributed.all_reduce(t); losses.append(t.item() / world)
        full = sp.unshard_tree(local, plan)
    lw = max(abs(a - b) for a, b in zip(losses, rl))
    worst = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()) if full else 0.0
    return dict(lossdiff=lw, worst=worst, ok=lw <= 1e-5 and worst <= 1e-5)

if __name__ == "__main__":
    world = int(sys.argv[1])
    if world == 2:
        cases = {"ep2_e0": dict(mesh="ep=2", pick="all_to_e0"), "ep2_last_optim": dict(mesh="ep=2", pick="all_to_last", strategy="optim"),
                 "ep2_half_noshard": dict(mesh="ep=2", pick="by_half", strategy="no_shard", skew_data=True),
                 "ep2_spread3_zero2": dict(mesh="ep=2", pick="spread3", strategy="optim_grads"),
                 "ep2_functional": dict(mesh="ep=2", pick="by_half", face="functional"), "ep2_functional_e0": dict(mesh="ep=2", pick="all_to_e0", face="functional", strategy="optim")}
    else:
        cases = {"dp2ep2_e0": dict(mesh="dp=2,ep=2", pick="all_to_e0"), "ep2dp2_last": dict(mesh="ep=2,dp=2", pick="all_to_last"),
                 "ep4_half_skew": dict(mesh="ep=4", pick="by_half", skew_data=True), "ep4_spread3_optim": dict(mesh="ep=4", pick="spread3", strategy="optim"),
                 "dp2ep2_spread3_noshard": dict(mesh="dp=2,ep=2", pick="spread3", strategy="no_shard", skew_data=True),
                 "ep2dp2_half_zero2": dict(mesh="ep=2,dp=2", pick="by_half", strategy="optim_grads", skew_data=True),
                 "dp2ep2_functional": dict(mesh="dp=2,ep=2", pick="spread3", face="functional"), "ep4_functional_skew": dict(mesh="ep=4", pick="by_half", face="functional", skew_data=True)}
    if sys.argv[2:]: cases = {k: v for k, v in cases.items() if k in sys.argv[2:]}
    res = run(worker, world, cases, timeout=1200)
    for k in cases: print(k, res[0][k], flush=True)
