"""Probe: functional face misuse / edge patterns. PYTHONPATH=src:tests python benchmarks/runs/faces_probes/p_func_edges.py WORLD"""
import sys, traceback
import optree, torch
import shardplan as sp
from distributed import run
from models import Toy, batches, toy_rules

def mk(world, strategy="optim_grads_params", rules=None):
    model = Toy()
    plan = sp.plan(model, rules or toy_rules(), sp.Mesh(dp=world), strategy=strategy, units=[r"blocks\.\d+"], min_unit_bytes=0)
    return model, plan, sp.shard_tree(dict(model.named_parameters()), plan)

def ref_grads(x, y):
    m = Toy(); l = m(x, y); l.backward()
    return l.item(), {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in m.named_parameters()}

def cmp(plan, rank, got, want):
    mine = sp.shard_tree(want, plan, rank=rank)
    return max(((got[n] - mine[n]).abs().max().item() if mine[n].numel() else 0.0) for n in got)

def worker(rank, world, which):
    out = {}
    data = batches(4)
    per = 8 // world
    sl = lambda t: t[rank * per:(rank + 1) * per]
    def case(name):
        def deco(f):
            if which and name not in which: return f
            try: out[name] = f()
            except Exception as exc: out[name] = "EXC " + type(exc).__name__ + ": " + str(exc)[:500]
            return f
        return deco

    @case("twice_in_fn")
    def _():  # fn calls functional_call twice (two micro-batches in one loss)
        model, plan, local = mk(world)
        x, y = data[0]
        def fn(p):
            a = sp.functional_call(model, plan, p, (sl(x)[:per // 2], sl(y)[:per // 2]))
            b = sp.functional_call(model, plan, p, (sl(x)[per // 2:], sl(y)[per // 2:]))
            return (a + b) / 2
        l, g = sp.value_and_grad(fn, plan)(local)
        _, want = ref_grads(x, y)
        return dict(loss=l.item(), graddiff=cmp(plan, rank, g, want))

    @case("twice_in_fn_dynamic")
    def _():
        res = {}
        for strat, order in (("no_shard", "dynamic"), ("optim_grads", "dynamic"), ("optim_grads_params", "dynamic"), ("optim", "dynamic")):
            model = Toy()
            kw = {"order": order} if order else {}
            plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), strategy=strat, units=[r"blocks\.\d+"], min_unit_bytes=0, **kw)
            local = sp.shard_tree(dict(model.named_parameters()), plan)
            x, y = data[0]
            def fn(p):
                a = sp.functional_call(model, plan, p, (sl(x)[:per // 2], sl(y)[:per // 2]))
                b = sp.functional_call(model, plan, p, (sl(x)[per // 2:], sl(y)[per // 2:]))
                return (a + b) / 2
            try:
                l, g = sp.value_and_grad(fn, plan)(local)
                _, want = ref_grads(x, y)
                res[strat] = cmp(plan, rank, g, want)
            except Exception as exc:
                res[strat] = "EXC " + type(exc).__name__ + ": " + str(exc)[:300]
        return res

    @case("forward_without_backward_then_vg")
    def _():  # an eval forward with grad enabled whose graph is dropped, then a training step
        res = {}
        for strat in ("optim_grads_params", "optim_grads"):
            model, plan, local = mk(world, strat)
            x, y = data[0]
            ev = sp.functional_call(model, plan, local, (sl(x), sl(y)))  # local leaves do not require grad
            leaves = {n: v.detach().requires_grad_(plan.param(n).requires_grad) for n, v in local.items()}
            ev2 = sp.functional_call(model, plan, leaves, (sl(x), sl(y)))  # a graph, never differentiated
            del ev2
            l, g = sp.value_and_grad(lambda p, a, b: sp.functional_call(model, plan, p, (a, b)), plan)(local, sl(x), sl(y))
            _, want = ref_grads(x, y)
            res[strat] = cmp(plan, rank, g, want)
        return res

    @case("no_grad_eval_then_vg")
    def _():
        model, plan, local = mk(world)
        x, y = data[0]
        with torch.no_grad():
            e = sp.functional_call(model, plan, local, (sl(x), sl(y)))
        l, g = sp.value_and_grad(lambda p, a, b: sp.functional_call(model, plan, p, (a, b)), plan)(local, sl(x), sl(y))
        _, want = ref_grads(x, y)
        return dict(eval=e.item(), loss=l.item(), graddiff=cmp(plan, rank, g, want))

    @case("vg_without_call")
    def _():
        model, plan, local = mk(world)
        return sp.value_and_grad(lambda p: sum(t.sum() for t in p.values()), plan)(local)

    @case("other_plan_tree")
    def _():  # a tree sharded for plan A given with plan B
        model, plan_a, local_a = mk(world)
        plan_b = sp.plan(model, toy_rules(odd=False), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0)
        x, y = data[0]
        l, g = sp.value_and_grad(lambda p, a, b: sp.functional_call(model, plan_b, p, (a, b)), plan_b)(local_a, sl(x), sl(y))
        return "no error", l.item()

    @case("other_plan_same_shapes")
    def _():  # same local shapes, other strategy and units: fine, a tree is plain tensors
        model, plan_a, local_a = mk(world)
        plan_b = sp.plan(model, toy_rules(), sp.Mesh(dp=world), strategy="optim", units=[], min_unit_bytes=0)
        x, y = data[0]
        l, g = sp.value_and_grad(lambda p, a, b: sp.functional_call(model, plan_b, p, (a, b)), plan_b)(local_a, sl(x), sl(y))
        _, want = ref_grads(x, y)
        return dict(graddiff=cmp(plan_b, rank, g, want))

    @case("state_dict_tree_tied")
    def _():  # shard_tree of a tied model's state_dict (both names), then train
        model = Toy()
        plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0)
        sd = {k: v for k, v in model.state_dict().items() if k != "scale"}
        local = sp.shard_tree(sd, plan)
        x, y = data[0]
        l, g = sp.value_and_grad(lambda p, a, b: sp.functional_call(model, plan, p, (a, b)), plan)(local, sl(x), sl(y))
        return dict(loss=l.item(), keys=sorted(k for k in g if "emb" in k or "head" in k),
                    head_zero=bool((g["head.weight"] == 0).all()), emb_zero=bool((g["emb.weight"] == 0).all()))

    @case("clip_tied_both_names")
    def _():
        model = Toy()
        plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0)
        g = {n: torch.ones(plan.local_shape(n, rank)) for n in ("emb.weight",)}
        g2 = {"emb.weight": g["emb.weight"], "head.weight": g["emb.weight"]}
        _, n1 = sp.optim.clip_by_global_norm(g, 1.0, plan)
        _, n2 = sp.optim.clip_by_global_norm(g2, 1.0, plan)
        return n1.item(), n2.item()

    @case("frozen_only_grad")
    def _():  # fn with the frozen leaf only in argnums tree: loss independent of trainable params
        model, plan, local = mk(world)
        x, y = data[0]
        l, g = sp.value_and_grad(lambda p, a, b: sp.functional_call(model, plan, p, (a, b)).detach(), plan)(local, sl(x), sl(y))
        l2, g2 = sp.value_and_grad(lambda p, a, b: sp.functional_call(model, plan, p, (a, b)), plan)(local, sl(x), sl(y))
        _, want = ref_grads(x, y)
        return dict(allzero=all(bool((t == 0).all()) for t in g.values()), graddiff=cmp(plan, rank, g2, want))

    @case("int_leaf_in_tree")
    def _():
        model, plan, local = mk(world)
        x, y = data[0]
        local = dict(local); local["extra"] = torch.tensor(3)
        return sp.value_and_grad(lambda p, a, b: sp.functional_call(model, plan, p, (a, b)), plan)(local, sl(x), sl(y))[0].item()

    @case("grad_of_aux_loss")
    def _():  # has_aux: aux holding a graph-attached tensor; grads only for the loss
        model, plan, local = mk(world)
        x, y = data[0]
        (l, aux), g = sp.value_and_grad(lambda p, a, b: (lambda L: (L, L * 3))(sp.functional_call(model, plan, p, (a, b))),
                                        plan, has_aux=True)(local, sl(x), sl(y))
        _, want = ref_grads(x, y)
        return dict(aux=float(aux), graddiff=cmp(plan, rank, g, want))
    return out

if __name__ == "__main__":
    world = int(sys.argv[1])
    res = run(worker, world, sys.argv[2:], timeout=600, expect_errors=True)
    for r, (s, v) in enumerate(res):
        if s != "ok": print("rank", r, s, v[-3000:]); continue
        if r == 0:
            for k, val in v.items(): print(k, "->", val)
