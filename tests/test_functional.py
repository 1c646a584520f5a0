"""The functional face (issue 12): shard_tree / unshard_tree, functional_call, value_and_grad, the pure
optimizer, clipping and tree checkpoints, on real gloo groups, against shard() and single-process
training."""

from __future__ import annotations

import collections
import contextlib

import optree
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardplan as sp
from distributed import run
from models import Toy, batches, toy_rules

LR, ATOL, STEPS, ACCUM = 1e-3, 1e-5, 3, 2
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
UNITS = [r"blocks\.\d+"]


def _plan(model, world, case):
    mesh = sp.Mesh(**case.get("mesh", {"dp": world}))
    return sp.plan(model, toy_rules("shard" if "shard" in mesh.axis_names else "dp"), mesh, strategy=case["strategy"],
                   units=UNITS, min_unit_bytes=0)


def _reference(data, clip):
    model = Toy()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _micro(x, y, rank, world, i):
    per = x.shape[0] // world
    m = per // ACCUM
    lo = rank * per + i * m
    return x[lo:lo + m], y[lo:lo + m]


def _module_path(rank, world, case, data):
    model = Toy()
    plan = _plan(model, world, case)
    sp.shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in data:
        total = 0.0
        for i in range(ACCUM):
            with sp.no_sync(model) if i < ACCUM - 1 else contextlib.nullcontext():
                loss = model(*_micro(x, y, rank, world, i)) / ACCUM
                loss.backward()
                total += loss.item()
        if case.get("clip"):
            sp.clip_grad_norm_(model, case["clip"])
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, sp.checkpoint.full_state_dict(model)


def _functional_path(rank, world, case, data):
    model = Toy()
    plan = _plan(model, world, case)
    local = sp.shard_tree(dict(model.named_parameters()), plan)
    opt = sp.optim.adamw(lr=LR, mask=sp.optim.trainable(plan))
    state = opt.init(local)

    def loss_fn(params, x, y):
        return sp.functional_call(model, plan, params, (x, y)) / ACCUM

    vg = sp.value_and_grad(loss_fn, plan)
    losses, recorded, expected = [], [], []
    for step, (x, y) in enumerate(data):
        total, grads = 0.0, None
        for i in range(ACCUM):
            loss, g = vg(local, *_micro(x, y, rank, world, i))
            if step == 0 and i == 0:
                ctx = sp.record_ops(model, plan)  # the runtime exists after the first call
            grads = g if grads is None else optree.tree_map(torch.add, grads, g)
            total += loss.item()
        if case.get("clip"):
            grads, _ = sp.optim.clip_by_global_norm(grads, case["clip"], plan)
        local, state = opt.update(grads, state, local)
        losses.append(total)
        if step == 0:
            with ctx as ops:  # a whole step: two micro-batches, the second on the same (unchanged) shards
                for i in range(ACCUM):
                    vg(local, *_micro(x, y, rank, world, i))
            recorded, expected = list(ops), list(plan.ops(stale=True)) + list(plan.ops(stale=False))
    full = sp.unshard_tree(local, plan)
    return losses, full, recorded == expected, (len(recorded), len(expected))


def _parity_worker(rank, world, cases):
    data = batches(STEPS, batch=8)
    out = []
    for case in cases:
        ref_losses, ref = _reference(data, case.get("clip"))
        m_losses, m_full = _module_path(rank, world, case, data)
        f_losses, f_full, same_ops, counts = _functional_path(rank, world, case, data)
        worst = max((f_full[n] - ref[n]).abs().max().item() for n in ref)
        worst_m = max((m_full[n] - ref[n]).abs().max().item() for n in ref) if rank == 0 else 0.0
        out.append(dict(ref=ref_losses, module=m_losses, functional=f_losses, worst=worst, worst_module=worst_m,
                        same_ops=same_ops, counts=counts))
    return out


def _mean_losses(results, k):
    return [sum(r[k]["functional"][s] for r in results) / len(results) for s in range(STEPS)], \
        [sum(r[k]["module"][s] for r in results) / len(results) for s in range(STEPS)]


def _check(results, cases):
    for k, case in enumerate(cases):
        f, m = _mean_losses(results, k)
        assert f == pytest.approx(results[0][k]["ref"], abs=ATOL), (case, "functional losses", f)
        assert m == pytest.approx(results[0][k]["ref"], abs=ATOL), (case, "shard() losses", m)
        for r in results:
            assert r[k]["worst"] <= ATOL, (case, "functional parameters differ", r[k]["worst"])
            assert r[k]["worst_module"] <= ATOL, (case, "shard() parameters differ", r[k]["worst_module"])
            assert r[k]["same_ops"], (case, "functional_call ran other ops than plan.schedule", r[k]["counts"])


CASES_2 = [dict(strategy=s) for s in STRATEGIES] + [dict(strategy="optim_grads_params", clip=0.05)]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_functional_equals_shard_and_single_process_two_ranks():
    _check(run(_parity_worker, 2, CASES_2, timeout=380), CASES_2)


CASES_4 = [dict(strategy="optim_grads_params", mesh={"replica": 2, "shard": 2}),
           dict(strategy="optim", mesh={"replica": 2, "shard": 2}, clip=0.05)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_functional_hsdp_four_ranks():
    _check(run(_parity_worker, 4, CASES_4, timeout=280), CASES_4)


# -- trees: shard / assemble property, errors --------------------------------------------------------------

Point = collections.namedtuple("Point", ["w", "b"])
MESHES = [sp.Mesh(dp=1), sp.Mesh(dp=2), sp.Mesh(dp=3), sp.Mesh(replica=2, shard=2), sp.Mesh(a=2, b=3)]


@st.composite
def trees(draw):
    mesh = draw(st.sampled_from(MESHES))
    kind = draw(st.sampled_from(["dict", "list", "namedtuple", "nested"]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))

    def leaf():
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        return (torch.arange(max(1, torch.Size(shape).numel())) % 97).to(dtype)[:torch.Size(shape).numel()].view(shape)

    if kind == "dict":
        tree = {"a": leaf(), "b": leaf()}
    elif kind == "list":
        tree = [leaf(), leaf(), leaf()]
    elif kind == "namedtuple":
        tree = Point(leaf(), leaf())
    else:
        tree = {"layer": [{"w": leaf()}, {"w": leaf()}], "head": Point(leaf(), leaf())}
    axes = mesh.axis_names

    def spec(path, t):
        if not t.shape:
            return sp.P()
        choice = draw(st.sampled_from(["none", "first", "second", "both"]))
        if choice == "first":
            return sp.P(axes[0])
        if choice == "second" and t.dim() > 1:
            return sp.P(None, axes[-1])
        if choice == "both" and len(axes) > 1:
            return sp.P((axes[0], axes[1]))
        return sp.P()
    return mesh, tree, spec, draw(st.integers(0, 3))


@pytest.mark.filterwarnings("ignore::shardplan.errors.PlanWarning")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees())
def test_assemble_of_every_ranks_shard_tree_is_the_tree_bit_for_bit(problem):
    mesh, tree, spec, strategy = problem
    plan = sp.plan(tree, [(r".*", spec)], mesh, strategy=strategy)
    locals_ = {r: sp.shard_tree(tree, plan, rank=r) for r in range(mesh.size)}
    for r, local in locals_.items():
        assert optree.tree_structure(local) == optree.tree_structure(tree)
    back = sp.tree.assemble(plan, locals_)
    for a, b in zip(optree.tree_leaves(back), optree.tree_leaves(tree)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_tree_errors_name_the_path():
    tree = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    plan = sp.plan(tree, [(r".*", sp.P("dp"))], sp.Mesh(dp=2))
    with pytest.raises(sp.ShardingError, match="'w' has shape"):
        sp.shard_tree({"w": torch.zeros(5, 3), "b": torch.zeros(3)}, plan, rank=0)
    with pytest.raises(sp.ShardingError, match="'c' is not a parameter"):
        sp.shard_tree({"w": torch.zeros(4, 3), "c": torch.zeros(3)}, plan, rank=0)
    with pytest.raises(sp.ShardingError, match="'b' has dtype"):
        sp.shard_tree({"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.float64)}, plan, rank=0)
    with pytest.raises(sp.ShardingError, match="meta device"):
        sp.shard_tree({"w": torch.empty(4, 3, device="meta"), "b": torch.zeros(3)}, plan, rank=0)
    local = sp.shard_tree({"w": torch.empty(4, 3, device="meta"), "b": torch.zeros(3)}, plan, rank=1,
                          init_fn=lambda path, leaf: torch.ones(leaf.shape))
    assert local["w"].shape == plan.local_shape("w", 1) and bool((local["w"] == 1).all())
    assert plan.param("w").requires_grad  # a pytree is JAX-style: floating-point leaves are trained
    opt = sp.optim.adamw()
    with pytest.raises(sp.ShardingError, match="tree structure"):
        opt.update({"w": torch.zeros(2, 3)}, opt.init(local), local)


def test_a_tree_with_two_leaves_for_one_tied_parameter_is_refused():
    # the plan ties emb.weight and head.weight; a tree holding both would have one of them dropped silently
    tied = torch.nn.ModuleDict({"emb": torch.nn.Embedding(8, 4), "head": torch.nn.Linear(4, 8, bias=False)})
    tied.head.weight = tied.emb.weight
    plan = sp.plan(tied, [(r".*", sp.P("dp"))], sp.Mesh(dp=2))
    assert len(plan.params) == 1
    sp.shard_tree(dict(tied.named_parameters()), plan, rank=0)  # one leaf per tied group: fine
    local = sp.shard_tree(tied.state_dict(), plan, rank=0)  # both names, one tensor: one parameter, accepted
    assert torch.equal(local["emb.weight"], local["head.weight"])
    two = {"emb.weight": torch.zeros(8, 4), "head.weight": torch.ones(8, 4)}
    with pytest.raises(sp.ShardingError, match="'emb.weight' and 'head.weight' are one tied parameter"):
        sp.shard_tree(two, plan, rank=0)


def _bad_tree_worker(rank, world):
    import time
    model = Toy()
    plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=UNITS, min_unit_bytes=0)
    local = sp.shard_tree(dict(model.named_parameters()), plan)
    if rank == 1:  # a rank-dependent mistake
        local["blocks.0.fc1.weight"] = torch.zeros(3, 3)
    t = time.monotonic()
    try:
        sp.functional_call(model, plan, local, batches(1)[0], timeout_s=60)
        return "no error", time.monotonic() - t
    except sp.ShardingError as exc:
        return str(exc), time.monotonic() - t


@pytest.mark.timeout(120)
def test_a_bad_tree_on_one_rank_ends_every_rank():
    for msg, seconds in run(_bad_tree_worker, 2):
        assert "blocks.0.fc1.weight" in msg and "rank(s) [1]" in msg, msg
        assert seconds < 20


# -- checkpoints of (params, optimizer state) ----------------------------------------------------------------

def _ckpt_worker(rank, world, path, phase):
    data = batches(6)
    model = Toy(seed=0 if phase == "save" else 3)
    plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), strategy="optim_grads_params" if world == 4 else "optim_grads",
                   units=UNITS, min_unit_bytes=0)
    local = sp.shard_tree(dict(model.named_parameters()), plan)
    opt = sp.optim.adamw(lr=LR, mask=sp.optim.trainable(plan))
    state = opt.init(local)
    vg = sp.value_and_grad(lambda p, x, y: sp.functional_call(model, plan, p, (x, y)), plan)
    per = 8 // world

    def train(local, state, batches_):
        losses = []
        for x, y in batches_:
            loss, g = vg(local, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
            local, state = opt.update(g, state, local)
            t = loss.clone()
            torch.distributed.all_reduce(t)
            losses.append(t.item() / world)
        return local, state, losses
    if phase == "save":
        local, state, first = train(local, state, data[:3])
        sp.checkpoint.save_tree(path, plan, {"params": local, "opt": state}, step=3)
        _, _, rest = train(local, state, data[3:])
        return first + rest
    tree, step = sp.checkpoint.load_tree(path, plan, {"params": local, "opt": state})
    _, _, rest = train(tree["params"], tree["opt"], data[step:])
    return step, rest


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_functional_checkpoint_saved_at_4_resumes_at_2(tmp_path):
    path = str(tmp_path / "tree")
    full = run(_ckpt_worker, 4, path, "save")[0]
    step, rest = run(_ckpt_worker, 2, path, "load")[0]
    assert step == 3
    assert rest == pytest.approx(full[3:], abs=1e-5)


def test_pure_optimizers_donate_in_place_bit_for_bit():
    """``donate=True`` updates params and state in place (no second copy: JAX donation) with the same bits as
    the out-of-place update and as torch.optim.AdamW/SGD on the same tensors."""
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(5, 3, generator=g), "b": {"c": torch.randn(7, generator=g)}}
    grads = [{"a": torch.randn(5, 3, generator=g), "b": {"c": torch.randn(7, generator=g)}} for _ in range(3)]
    for make, ref in ((lambda: sp.optim.adamw(lr=1e-2, weight_decay=0.1),
                       lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)),
                      (lambda: sp.optim.sgd(lr=1e-2, momentum=0.9, weight_decay=0.01),
                       lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01, foreach=True))):
        opt = make()
        out = optree.tree_map(torch.clone, params)
        state = opt.init(out)
        don = optree.tree_map(torch.clone, params)
        dstate = opt.init(don)
        tp = [torch.nn.Parameter(t.clone()) for t in optree.tree_leaves(params)]
        topt = ref(tp)
        for gr in grads:
            out, state = opt.update(gr, state, out)
            before = [t.data_ptr() for t in optree.tree_leaves(don)]
            don2, dstate = opt.update(gr, dstate, don, donate=True)
            assert [t.data_ptr() for t in optree.tree_leaves(don2)] == before  # in place
            don = don2
            for p, t in zip(tp, optree.tree_leaves(gr)):
                p.grad = t.clone()
            topt.step()
        for a, b, c in zip(optree.tree_leaves(out), optree.tree_leaves(don), tp):
            assert torch.equal(a, b) and torch.equal(a, c.detach())


def _collected_worker(rank, world):
    import gc
    import weakref
    out = []
    for face in ("functional", "shard"):
        model = Toy()
        plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world))
        if face == "functional":
            local = sp.shard_tree(dict(model.named_parameters()), plan)
            x, y = torch.randint(0, 37, (2, 6)), torch.randint(0, 37, (2, 6))
            sp.value_and_grad(lambda p, a, b: sp.functional_call(model, plan, p, (a, b)), plan)(local, x, y)
        else:
            sp.shard(model, plan)
            model(torch.randint(0, 37, (2, 6)), torch.randint(0, 37, (2, 6))).backward()
        ref = weakref.ref(model)
        del model
        gc.collect()
        out.append((face, ref() is None))
    return out


def test_runtimes_do_not_keep_their_model_alive():
    """A model dropped after a functional call or a sharded step is collected with its runtime (the hooks'
    cache held the root module strongly once: every model trained through the functional face leaked)."""
    for face, collected in run(_collected_worker, 1)[0]:
        assert collected, f"{face}: the model outlived the caller's last reference"


def _seams_worker(rank, world):
    """In-place writes to a parameter inside a unit (nn.Embedding(max_norm=...)) and copies of the module
    after a functional call."""
    import copy
    import io
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 6, max_norm=1.0), torch.nn.Linear(6, 5))
    ref = copy.deepcopy(model)
    plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[], min_unit_bytes=0)
    local = sp.shard_tree(dict(model.named_parameters()), plan)
    idx = torch.tensor([[1, 2, 3, 2]])
    loss, grads = sp.value_and_grad(lambda p, x: sp.functional_call(model, plan, p, (x,)).square().mean(), plan)(local, idx)
    want = ref(idx).square().mean()
    want.backward()
    ok = abs(float(loss) - float(want)) < 1e-6 and torch.allclose(grads["1.weight"], ref[1].weight.grad, atol=1e-6)
    twin = copy.deepcopy(model)  # a copy of the module after a functional call, and a pickle of it
    buf = io.BytesIO()
    torch.save(model, buf)
    return ok, type(twin).__name__, buf.tell() > 0


def test_functional_call_in_place_parameter_writes_and_module_copies():
    for ok, twin, saved in run(_seams_worker, 1):
        assert ok and twin == "Sequential" and saved


def _calls_worker(rank, world):
    """Calls of functional_call differentiated by plain autograd (the local leaves' gradients come from autograd)
    and by value_and_grad (from the face), alternating on one runtime: each call's full parameters are handles
    on the same aliases (made once per runtime); every gradient must be the unsharded model's, sliced to this rank."""
    torch.manual_seed(0)
    ref = Toy()
    data = batches(4, seed=7)  # the same data on every rank: the mean over ranks is one rank's gradient
    out = []
    for strategy in ("optim_grads_params", "optim_grads"):
        model = Toy()
        model.load_state_dict(ref.state_dict())
        plan = _plan(model, world, {"strategy": strategy})
        local = sp.shard_tree(dict(model.named_parameters()), plan)
        vg = sp.value_and_grad(lambda p, x, y: sp.functional_call(model, plan, p, (x, y)), plan)
        for k, (x, y) in enumerate(data):
            if k % 2 == 0:
                leaves = {n: v.detach().requires_grad_(plan.param(n).requires_grad) for n, v in local.items()}
                loss = sp.functional_call(model, plan, leaves, (x, y))
                trained = [n for n in leaves if leaves[n].requires_grad]
                got = dict(zip(trained, torch.autograd.grad(loss, [leaves[n] for n in trained])))
            else:
                _, got = vg(local, x, y)
            ref.zero_grad()
            ref(x, y).backward()
            want = sp.shard_tree({n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()}, plan)
            out.append(max((got[n] - want[n]).abs().max().item() for n in got if got[n].numel()))
    return out


@pytest.mark.timeout(120)
def test_autograd_and_value_and_grad_calls_alternate_on_one_runtime():
    for diffs in run(_calls_worker, 2, timeout=100):
        assert len(diffs) == 8 and all(d <= 1e-6 for d in diffs), diffs


def _grad_accumulation_worker(rank, world):
    model = Toy()
    plan = _plan(model, world, {"strategy": "optim_grads_params"})
    local = sp.shard_tree(dict(model.named_parameters()), plan)
    leaves = {n: v.detach().requires_grad_(plan.param(n).requires_grad) for n, v in local.items()}
    for x, y in batches(2, seed=3):  # the second backward would add a not-yet-reduced view into .grad
        sp.functional_call(model, plan, leaves, (x, y)).backward()
    return "no error"


@pytest.mark.timeout(120)
def test_accumulating_functional_gradients_into_grad_raises():
    for status, message in run(_grad_accumulation_worker, 2, timeout=100, expect_errors=True):
        assert status == "error" and "already holds a .grad" in message and "value_and_grad" in message, message
