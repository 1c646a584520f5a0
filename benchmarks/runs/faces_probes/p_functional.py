"""Probe: functional face vs single-process reference. Run: PYTHONPATH=src:tests python benchmarks/runs/faces_probes/p_functional.py"""
import sys, copy, traceback
import optree, torch, torch.nn.functional as F
import shardplan as sp
from distributed import run
from models import Toy, batches, toy_rules, Dynamic, rank_batches

TOL = 1e-5

def ref_train(make_model, data, make_opt, accum_split=None, aux=False):
    model = make_model()
    opt = make_opt(model)
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step(); opt.zero_grad(set_to_none=True)
        if hasattr(model, "step"): model.step += 1
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}

def worker(rank, world, cases):
    out = {}
    for name, case in cases.items():
        try:
            out[name] = one(rank, world, **case)
        except Exception as exc:
            out[name] = "EXC " + type(exc).__name__ + ": " + str(exc)[:600] + traceback.format_exc()[-800:]
    return out

def one(rank, world, model="toy", opt="adamw", lr=1e-2, wd=0.1, sched=False, mesh=None, rules=None, strategy="optim_grads_params",
        accum=1, aux=False, argnums=0, steps=3, mom=0.9, lr_tensor=False, ref_zero=False, units=(r"blocks\.\d+",)):
    mk = {"toy": lambda: Toy(), "skip": lambda: Dynamic("skip"), "moe": lambda: Dynamic("moe"), "branch": lambda: Dynamic("branch")}[model]
    vocab = 37 if model == "toy" else 32
    data = batches(steps, batch=8, vocab=vocab) if model == "toy" else rank_batches(steps, world)
    schedule = sp.optim.warmup_cosine(lr, 1, steps + 2) if sched else (torch.tensor(lr) if lr_tensor else lr)
    if opt == "adamw":
        ref_opt = lambda m: torch.optim.AdamW(m.parameters(), lr=lr if not sched else 0.0, weight_decay=wd, eps=1e-6)
        pure = lambda plan: sp.optim.adamw(lr=schedule, weight_decay=wd, eps=1e-6, mask=sp.optim.trainable(plan))
    else:
        ref_opt = lambda m: torch.optim.SGD(m.parameters(), lr=lr if not sched else 0.0, momentum=mom, weight_decay=wd)
        pure = lambda plan: sp.optim.sgd(lr=schedule, momentum=mom, weight_decay=wd, mask=sp.optim.trainable(plan))
    # reference
    m_ref = mk(); o_ref = ref_opt(m_ref)
    sch_ref = sp.optim.as_lr_scheduler(o_ref, schedule) if sched else None
    ref_losses = []
    for x, y in data:
        loss = m_ref(x, y); loss.backward(); ref_losses.append(loss.item())
        if ref_zero:  # JAX convention: an unused parameter gets a zero gradient (AdamW still decays it)
            for p_ in m_ref.parameters():
                if p_.grad is None and p_.requires_grad: p_.grad = torch.zeros_like(p_)
        o_ref.step(); o_ref.zero_grad(set_to_none=True)
        if sch_ref: sch_ref.step()
        if hasattr(m_ref, "step"): m_ref.step += 1
    ref = {n: p.detach().clone() for n, p in m_ref.named_parameters()}
    # functional
    model_ = mk()
    m = sp.Mesh(**(mesh or {"dp": world}))
    plan = sp.plan(model_, rules or toy_rules("dp"), m, strategy=strategy, units=list(units), min_unit_bytes=0)
    local = sp.shard_tree(dict(model_.named_parameters()), plan)
    o = pure(plan); state = o.init(local)
    if argnums == 0:
        def fn(p, x, y):
            l = sp.functional_call(model_, plan, p, (x, y))
            return (l, {"l": l.detach() * 2}) if aux else l
    else:
        def fn(x, p, y):
            l = sp.functional_call(model_, plan, p, (x, y))
            return (l, {"l": l.detach() * 2}) if aux else l
    vg = sp.value_and_grad(fn, plan, has_aux=aux, argnums=argnums)
    losses = []
    D = plan.data_size; di = plan.data_index(rank)
    for x, y in data:
        xs, ys = x.chunk(D)[di], y.chunk(D)[di]
        tot, grads = 0.0, None
        for xm, ym in zip(xs.chunk(accum), ys.chunk(accum)):
            args = (local, xm, ym) if argnums == 0 else (xm, local, ym)
            val, g = vg(*args)
            if aux:
                val, a = val
                assert torch.allclose(a["l"], val * 2)
            g = optree.tree_map(lambda t: t / accum, g)
            grads = g if grads is None else optree.tree_map(torch.add, grads, g)
            tot += val.item() / accum
        local, state = o.update(grads, state, local)
        t = torch.tensor(tot); torch.distributed.all_reduce(t); losses.append(t.item() / world)
        if hasattr(model_, "step"): model_.step += 1
    full = sp.unshard_tree(local, plan)
    worst = max((full[n] - ref[n]).abs().max().item() for n in full)
    lw = max(abs(a - b) for a, b in zip(losses, ref_losses))
    return dict(worst=worst, lossdiff=lw, ok=worst <= TOL and lw <= TOL)

CASES = {
  "adamw_wd": dict(),
  "adamw_sched": dict(sched=True),
  "adamw_lr_tensor": dict(lr_tensor=True),
  "sgd_mom_wd": dict(opt="sgd", lr=0.05),
  "sgd_sched": dict(opt="sgd", lr=0.05, sched=True),
  "accum2": dict(accum=2),
  "aux": dict(aux=True),
  "argnums1": dict(argnums=1, aux=True),
  "optim": dict(strategy="optim"),
  "optim_grads": dict(strategy="optim_grads", accum=2),
  "no_shard": dict(strategy="no_shard"),
  "skip_sgd_nomom": dict(model="skip", opt="sgd", lr=0.05, mom=0.0, wd=0.0, rules=[(r"gain", sp.P()), (r".*", sp.P("dp"))]),
  "moe_sgd_nomom": dict(model="moe", opt="sgd", lr=0.05, mom=0.0, wd=0.0, rules=[(r"gain", sp.P()), (r".*", sp.P("dp"))]),
  "branch_sgd_nomom": dict(model="branch", opt="sgd", lr=0.05, mom=0.0, wd=0.0, rules=[(r"gain", sp.P()), (r".*", sp.P("dp"))]),
  "moe_adamw_dimone": dict(model="moe", ref_zero=True, rules=[(r"gain", sp.P()), (r".*fc1\.weight", sp.P(None, "dp")), (r".*", sp.P("dp"))]),
}

if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    cases = dict(CASES)
    if world == 4:
        cases["hsdp"] = dict(mesh={"replica": 2, "dp": 2}, accum=2)
        cases["hsdp_optim"] = dict(mesh={"replica": 2, "dp": 2}, strategy="optim", opt="sgd", lr=0.05)
    sel = sys.argv[2:] 
    if sel: cases = {k: v for k, v in cases.items() if k in sel}
    res = run(worker, world, cases, timeout=900)
    for name in cases:
        r0 = res[0][name]
        print(name, r0 if isinstance(r0, str) else ("OK " if r0["ok"] else "MISMATCH ") + str({k: v for k, v in r0.items()}))
