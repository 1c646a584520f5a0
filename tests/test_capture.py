"""shardplan.capture, the parts that need no GPU: what a plan says about capture, the captured step's rules
(checked with backend="eager", which runs the same bookkeeping without a CUDA graph), the device-tensor
hyper-parameters (schedules on tensors, a tensor lr updated in place, sp.optim's device step) and their parity
with the eager path. The CUDA-graph replays themselves are checked by benchmarks/capture_check.py on a GPU
(docs/capture.md says where the figures are)."""

from __future__ import annotations

import dataclasses
import os
import sys
import pytest
import torch
import torch.nn as nn

import shardplan as sp
from distributed import run
from models import Toy, accumulating_step, batches, toy_rules


def _seq():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16)), nn.Linear(16, 1))


# -- what the plan says ---------------------------------------------------------------------------------------

def test_a_static_plan_is_capturable_and_print_says_so():
    plan = sp.plan(_seq(), [(".*", sp.P("dp"))], sp.Mesh(dp=2), units=[r"2"], min_unit_bytes=0)
    assert plan.capturable and plan.capture_blockers == ()
    assert "capture: yes" in str(plan)


@pytest.mark.parametrize("change, code", [
    (lambda m, p: p.with_order("dynamic"), "dynamic_order"),
])
def test_what_blocks_capture_is_named_with_its_fix(change, code):
    m = _seq()
    plan = change(m, sp.plan(m, [(".*", sp.P("dp"))], sp.Mesh(dp=2), units=[r"0", r"2"], min_unit_bytes=0))
    codes = [b.code for b in plan.capture_blockers]
    assert code in codes and not plan.capturable
    b = next(b for b in plan.capture_blockers if b.code == code)
    assert b.reason and b.fix
    assert f"capture: no ({code}" in str(plan) or f"; {code}:" in str(plan)


def _edited(plan):
    """The planner's schedule with unit ``2`` gathered where it computes instead of prefetched: valid, but edited."""
    ops = list(plan.schedule)
    moved = ops.pop(next(i for i, o in enumerate(ops) if o.kind == "all_gather" and o.unit == "2"
                         and o.event == "pre_forward"))
    w = next(i for i, o in enumerate(ops) if o.kind == "wait" and o.unit == "2" and o.event == "pre_forward")
    return plan.with_schedule(ops[:w] + [dataclasses.replace(moved, at="2", prefetch=False)] + ops[w:])


def test_quantized_gathers_can_be_captured():
    plan = sp.plan(_seq(), [(".*", sp.P("dp"))], sp.Mesh(dp=2), gather_dtype="int8", min_unit_bytes=0)
    assert plan.capturable  # their non-finite check is read after each replay (runtime/buffers.py)


def test_expert_parallel_plans_are_not_capturable():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import moe
    mesh = sp.Mesh(dp=2, ep=2)
    plan = sp.plan(moe.build("tiny"), moe.rules_for(mesh), mesh, units=moe.UNITS, min_unit_bytes=0)
    b = next(b for b in plan.capture_blockers if b.code == "expert_parallel")
    assert "split sizes" in b.reason and "eagerly" in b.fix


# -- the captured step's rules, on the CPU (backend="eager") -----------------------------------------------

def _capture_worker(rank, world, case):
    data = batches(6, seed=rank + 1)
    out = {}
    for mode in ("eager", "captured"):
        model = Toy()
        order = "dynamic" if case == "dynamic" else "static"
        plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0, order=order)
        sp.shard(model, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1)
        sched = sp.optim.as_lr_scheduler(opt, sp.optim.warmup_cosine(1e-2, warmup=2, total=6))

        def step(x, y):
            loss = model(x, y)
            loss.backward()
            sp.clip_grad_norm_(model, 0.5)
            opt.step()
            if case != "grads_left":
                opt.zero_grad()
            return loss.detach()

        f = sp.capture(step, backend="eager") if mode == "captured" else step
        losses = []
        try:
            for i, (x, y) in enumerate(data):
                if case == "grads_left" and i == 2:
                    opt.zero_grad()  # once, before the capture: later steps add to what the step leaves
                losses.append(float(f(x, y)))
                sched.step()
        except sp.errors.CaptureError as exc:
            return {"error": str(exc), "steps": len(losses)}
        out[mode] = (losses, {k: v.clone() for k, v in sp.checkpoint.full_state_dict(model).items()},
                     getattr(f, "replays", 0))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_captured_step_equals_the_eager_step_bit_for_bit(world):
    for r in run(_capture_worker, world, "plain", timeout=200):
        (le, pe, _), (lc, pc, replays) = r["eager"], r["captured"]
        assert le == lc
        assert all(torch.equal(pe[k], pc[k]) for k in pe)
        assert replays == 3  # 2 warm-up steps, the capture (which runs the step too), then 3 replays


@pytest.mark.slow
def test_capture_refuses_a_dynamic_plan_before_the_first_op_and_a_step_that_leaves_gradients():
    got = run(_capture_worker, 2, "dynamic", timeout=200)
    for r in got:
        assert r["steps"] == 0 and "dynamic_order" in r["error"] and "order='static'" in r["error"]
    for r in run(_capture_worker, 2, "grads_left", timeout=200):
        assert r["steps"] == 3 and "zero_grad" in r["error"]  # the capture ran; its first replay refused


def _edited_worker(rank, world, case):
    torch.manual_seed(0)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(6)]
    out = {}
    for mode in ("eager", "captured"):
        m = _seq()
        plan = _edited(sp.plan(m, [(".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"0", r"2"], min_unit_bytes=0))
        sp.shard(m, plan)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        calls = [0]

        def step(x, y):
            calls[0] += 1
            if case == "extra_forward" and calls[0] == 3:  # the capture call evaluates first: other ops
                with torch.no_grad():
                    m(x)
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        f = sp.capture(step, backend="eager") if mode == "captured" else step
        try:
            losses = [float(f(x[rank * 2:rank * 2 + 2], y[rank * 2:rank * 2 + 2])) for x, y in data]
        except sp.errors.CaptureError as exc:
            return {"error": str(exc), "calls": calls[0]}
        out[mode] = (losses, {k: v.clone() for k, v in sp.checkpoint.full_state_dict(m).items()}, plan.capturable)
    return out


def test_an_edited_schedule_is_captured_and_equals_eager_bit_for_bit():
    """A schedule edited by hand (with_schedule, validated as the planner's own) is capturable: the capture is
    checked to run the ops of the warm-up step before it."""
    for r in run(_edited_worker, 2, "plain", timeout=120):
        (le, pe, _), (lc, pc, capturable) = r["eager"], r["captured"]
        assert capturable and le == lc and all(torch.equal(pe[k], pc[k]) for k in pe)


def test_a_capture_that_runs_other_ops_than_the_warm_up_is_refused():
    for r in run(_edited_worker, 2, "extra_forward", timeout=120):
        assert r["calls"] == 3 and "other schedule ops" in r["error"] and "where the warm-up step ran" in r["error"], r


def _replaced_worker(rank, world, kind):
    model, f, data = _captured_toy(rank, world, 4)  # two warm-up steps and the capture
    name, p = next((n, p) for n, p in model.named_parameters() if n.startswith("blocks.1"))
    with torch.no_grad():
        if kind == "data":
            p.data = p.data.clone()  # the shard the graph reads is no longer the parameter's
        elif kind == "buffer":
            name = "Toy.scale"
            model.scale = torch.tensor(0.25)  # a buffer assigned anew: the graph reads the old one
        elif kind == "module":
            name = "Toy.blocks.0.ln"
            model.blocks[0].ln = nn.LayerNorm(13)  # a module replaced: the graph runs the old one
        else:
            model.zero_grad()
            p.grad = torch.zeros_like(p)  # a replay would assign where the eager step adds
    try:
        f(*data[3])
    except sp.errors.CaptureError as exc:
        return name, str(exc)
    return name, None


@pytest.mark.parametrize("kind", ["data", "grad", "buffer", "module"])
def test_a_replay_refuses_a_replaced_parameter_and_a_gradient_left_between_calls(kind):
    """A replay reads parameters and buffers in place and runs the modules it was captured with: one replaced
    (``p.data = ...``, ``model.scale = new``, ``block.ln = nn.LayerNorm(...)``) would be read or run in its old
    form, silently; a gradient left would be assigned where the eager step adds."""
    for name, msg in run(_replaced_worker, 2, kind, timeout=120):
        assert msg is not None, kind
        if kind == "data":
            assert repr(name) in msg and "p.copy_(new)" in msg and "capture again" in msg
        elif kind == "buffer":
            assert f"buffer {name} was replaced" in msg and "scale.copy_(new)" in msg, msg
        elif kind == "module":
            assert f"{name} is another module" in msg and "step.reset()" in msg, msg
        else:
            assert "did not have when the step was captured" in msg



def _no_sync_replay_worker(rank, world):
    model, f, data = _captured_toy(rank, world, 4, strategy=2)  # two warm-up steps and the capture
    try:
        with sp.no_sync(model):  # accumulation around the call: the graph would reduce and step anyway
            f(*data[3])
    except sp.errors.CaptureError as exc:
        return str(exc)
    return None


def test_a_replay_under_no_sync_is_refused():
    """[Note: gradient sync around a replay] a step captured outside sp.no_sync reduces its gradients in every
    replay: a call under no_sync replayed it all the same on a GPU (the CPU's eager backend refused it for another
    cause: used parameters that changed). Refused, naming no_sync and where accumulation belongs."""
    for msg in run(_no_sync_replay_worker, 2, timeout=120):
        assert msg is not None and "under sp.no_sync(Toy)" in msg and "captured outside" in msg, msg

def _mode_worker(rank, world):
    model, f, data = _captured_toy(rank, world, 6, strategy=3)  # two warm-up steps and the capture, in training mode
    model.eval()  # an evaluation between steps ...
    with torch.no_grad():
        model(*data[5])
    out = []
    try:  # ... and no model.train() after it
        f(*data[3])
        out.append(None)
    except sp.errors.CaptureError as exc:
        out.append(str(exc))
    model.train()
    replays = f.replays
    f(*data[4])
    out.append(f.replays == replays + 1)
    name, sub = [(n, m) for n, m in model.named_modules() if n][-1]
    sub.eval()  # one submodule switched (a frozen batch norm's way): the root's flag is unchanged
    try:
        f(*data[5])
        out.append(None)
    except sp.errors.CaptureError as exc:
        out.append((name, str(exc)))
    return out


def test_a_replay_in_the_other_mode_is_refused():
    """[Note: train and eval modes] a graph replays the mode it was captured in: a model left in eval mode after
    an evaluation would have trained with dropout and batch-norm updates as in training mode, unlike the eager
    step. Refused, naming the mode and model.train(); back in training mode, the graph replays. One submodule
    switched alone (the root's flag unchanged) is refused too, naming it."""
    for msg, replayed, sub in run(_mode_worker, 2, timeout=120):
        assert msg is not None and "Toy is in eval mode" in msg and "model.train()" in msg, msg
        assert replayed
        assert sub is not None and f"Toy.{sub[0]} is in eval mode" in sub[1] and "step.reset()" in sub[1], sub


class _Assigning(Toy):
    """Its forward assigns its buffer anew (out of place), as a running statistic kept without in-place ops."""

    def forward(self, idx, y):
        self.scale = self.scale * 1.0
        return super().forward(idx, y)


def _assigning_worker(rank, world):
    model = _Assigning()
    sp.shard(model, sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0))
    f = sp.capture(_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1)), backend="eager")
    data = batches(3, seed=rank + 1)
    f(*data[0])
    f(*data[1])  # two warm-up calls: eager, as the step is
    try:
        f(*data[2])  # the capture
    except sp.errors.CaptureError as exc:
        return str(exc)
    return None


def test_a_step_that_assigns_a_buffer_anew_is_refused_at_the_capture():
    """A buffer the step itself replaces (``self.scale = self.scale * 1.0``) would be read by every replay where the
    capture found it (a tensor the module no longer holds: freed memory under a CUDA graph), not the one the step
    made. Refused at the capture, naming the buffer and the in-place fix."""
    for msg in run(_assigning_worker, 2, timeout=120):
        assert msg is not None and "assigns the buffer _Assigning.scale anew" in msg and "scale.copy_(new)" in msg, msg


def _trained_worker(rank, world):
    model, f, data = _captured_toy(rank, world, 8, strategy=3)  # two warm-up steps and the capture
    name, p = next((n, q) for n, q in model.named_parameters() if q.requires_grad)
    out = []
    for flip in (False, True):  # frozen after the capture; then back as captured (replays)
        p.requires_grad_(flip)
        try:
            f(*data[3 + flip])
            out.append(None)
        except sp.errors.CaptureError as exc:
            out.append(str(exc))
    replays = f.replays
    f(*data[5])
    out.append(f.replays == replays + 1)
    return name, out


def test_a_replay_refuses_a_parameter_frozen_or_unfrozen_since_the_capture():
    """[Note: what a step trains] a graph replays the gradients and updates its capture recorded: a parameter
    frozen afterwards would still be trained by every replay (the eager step leaves it). Refused naming the
    parameter; unfrozen again, the graph replays."""
    for name, (frozen, back, replayed) in run(_trained_worker, 2, timeout=120):
        assert frozen is not None and "requires_grad=False" in frozen and "step.reset()" in frozen, frozen
        assert name.split(".")[-1] in frozen, (name, frozen)
        assert back is None and replayed


def test_a_replay_refuses_a_param_group_added_since_the_capture():
    """[Note: what a step trains] a param group added after the capture (progressive unfreezing) would never be
    stepped by a replay; and a parameter unfrozen after it would get no gradient. Both refused."""
    w, v = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3), requires_grad=False)
    opt = torch.optim.SGD([w], lr=0.1)

    def step(x):
        (w * x).sum().backward() if not v.requires_grad else ((w + v) * x).sum().backward()
        opt.step()
        opt.zero_grad()

    f = sp.capture(step, backend="eager", warmup=1)
    for _ in range(3):
        f(torch.ones(3))
    opt.add_param_group({"params": [v]})
    with pytest.raises(sp.errors.CaptureError, match=r"SGD's param groups changed.*1 groups of \[1\].*2 of \[1, 1\]"):
        f(torch.ones(3))
    opt.param_groups.pop()
    params, swapped = opt.param_groups[0]["params"], nn.Parameter(torch.ones(3))
    params[0] = swapped  # the same count, another parameter: the replay would step the old one
    with pytest.raises(sp.errors.CaptureError, match=r"a parameter of a group replaced by another"):
        f(torch.ones(3))
    params[0] = w
    w.requires_grad_(False)
    with pytest.raises(sp.errors.CaptureError, match=r"SGD.param_groups\[0\]\['params'\]\[0\] has requires_grad=False"):
        f(torch.ones(3))
    w.requires_grad_(True)
    f(torch.ones(3))
    assert f.replays == 2  # (one before the changes, one after)
    f.reset()  # captured again with the group: steps it
    opt.add_param_group({"params": [v]})
    v.requires_grad_(True)
    for _ in range(3):
        f(torch.ones(3))
    assert not torch.equal(v.detach(), torch.ones(3))


class _Skips(nn.Module):
    """The middle layer runs every other call: its parameters get no gradient in the others."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.a(x)
        if self.calls % 2:
            h = h + self.b(h)
        return self.c(h).sum()


def _used_worker(rank, world):
    model = _Skips()
    plan = sp.plan(model, [(".*", sp.P("dp"))], sp.Mesh(dp=world), units=[], min_unit_bytes=0)
    sp.shard(model, plan)
    f = sp.capture(_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1)), backend="eager", warmup=2)
    try:
        for _ in range(3):
            f(torch.randn(2, 4))
    except sp.errors.CaptureError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_capture_refuses_a_step_whose_used_parameters_change():
    for msg in run(_used_worker, 2, timeout=120):
        assert msg is not None and "b.weight" in msg and "changed from one step to the next" in msg


def test_capture_without_a_gpu_refuses_and_names_the_eager_backend():
    f = sp.capture(lambda x: x * 2, warmup=1)
    f(torch.ones(2))  # the warm-up call runs eagerly
    if torch.cuda.is_available():  # pragma: no cover - the CPU suite
        pytest.skip("a GPU is here: the capture would run")
    with pytest.raises(sp.errors.CaptureError, match="backend='eager'"):
        f(torch.ones(2))


def test_capture_arguments_are_checked():
    with pytest.raises(sp.errors.CaptureError, match="warmup"):
        sp.capture(lambda: 0, warmup=0)
    with pytest.raises(sp.errors.CaptureError, match="on_new_shape"):
        sp.capture(lambda: 0, on_new_shape="sometimes")
    with pytest.raises(sp.errors.CaptureError, match="backend"):
        sp.capture(lambda: 0, backend="xla")


def test_an_argument_neither_tensor_nor_hashable_is_refused_naming_it():
    """[Note: non-tensor arguments] a graph keeps what its capture computed from a non-tensor argument; one that
    cannot be compared by value (keyed by its id before) would replay its old values after a change in place."""
    class Cfg:
        __hash__ = None  # (mutable, compared by identity: what a graph cannot follow)
        scale = 0.5

    f = sp.capture(lambda x, cfg: x * cfg.scale, backend="eager", warmup=1)
    for cfg in (Cfg(), bytearray(b"ab"), {1, 2}):
        with pytest.raises(sp.errors.CaptureError, match=r"args\[1\] is a .*neither a tensor nor hashable.*as a tensor"):
            f(torch.ones(2), cfg)
    assert not f.graphs  # refused before anything ran
    g = sp.capture(lambda x, scale: x * scale, backend="eager", warmup=1)
    for s in (0.5, 0.5, 0.5, 0.25):  # a hashable value: a new value is a new signature
        assert torch.equal(g(torch.ones(2), s), torch.full((2,), s))
    assert len(g.graphs) == 2


def test_a_call_in_another_grad_or_autocast_context_is_refused():
    """[Note: the state around a call] a replay runs the step as captured: under torch.no_grad() it would still
    run its backward and optimizer step (eagerly, backward raises), under an autocast entered around the call it
    would compute in the capture's dtypes. Refused, naming the context; the captured one replays."""
    w = nn.Parameter(torch.ones(4, 4))
    opt = torch.optim.SGD([w], lr=0.1)

    def step(x):
        loss = (x @ w).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    f = sp.capture(step, backend="eager", warmup=1)
    for _ in range(3):
        f(torch.ones(2, 4))
    for ctx, says in ((torch.no_grad, r"gradients disabled \(torch.no_grad\(\)\) around this call"),
                      (lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                       r"autocast\('cpu', dtype=torch.bfloat16\) around this call, no cpu autocast around the capture")):
        before = w.detach().clone()
        with pytest.raises(sp.errors.CaptureError, match=says):
            with ctx():
                f(torch.ones(2, 4))
        assert torch.equal(w, before)  # refused before anything ran
    f(torch.ones(2, 4))
    assert f.replays == 2
    was = torch.get_autocast_dtype("cpu")
    torch.set_autocast_dtype("cpu", torch.float16)  # a disabled autocast's default dtype: not another context
    try:
        f(torch.ones(2, 4))
    finally:
        torch.set_autocast_dtype("cpu", was)
    assert f.replays == 3


def test_static_inputs_new_shapes_and_donation():
    seen = []

    def fn(x, scale=1.0):
        seen.append(x)
        return x * scale

    f = sp.capture(fn, backend="eager", warmup=1)
    a = torch.ones(3)
    f(a)  # warm-up: the caller's tensor itself
    assert seen[-1] is a
    out = f(torch.full((3,), 2.0))  # the capture: a static copy
    static = seen[-1]
    assert static is not a and torch.equal(out, torch.full((3,), 2.0))
    out = f(torch.full((3,), 5.0))  # a replay: copied into the same static buffer
    assert seen[-1] is static and torch.equal(static, torch.full((3,), 5.0))
    f(torch.ones(4))  # a new shape: warmed up and captured apart (on_new_shape="recapture")
    assert len(f.graphs) == 2
    g = sp.capture(fn, backend="eager", warmup=1, on_new_shape="error")
    g(torch.ones(3))
    with pytest.raises(sp.errors.CaptureError, match="new signature"):
        g(torch.ones(3), scale=2.0)  # another non-tensor argument is a new signature too
    d = sp.capture(fn, backend="eager", warmup=1, donate_argnums=(0,))
    d(torch.ones(3))
    mine = torch.ones(3)
    d(mine)
    assert seen[-1] is mine  # donated: the graph's input is the caller's tensor itself
    d(mine)  # passed back: the same graph (the leaf is the graph's own, not keyed again)
    assert seen[-1] is mine and d.replays == 1
    d(torch.ones(5))  # another shape, never the last graph's call
    assert len(d.graphs) == 2


def test_a_replay_refuses_a_donated_tensor_whose_storage_was_replaced():
    """A donated input is read in place by the graph: after ``.data = new`` the replay would read its old,
    freed memory. Refused, naming the input; values changed in place replay."""
    def fn(tree, x):
        tree["w"].add_(x)
        return tree["w"].sum()

    step = sp.capture(fn, backend="eager", warmup=1, donate_argnums=(0,))
    tree = {"w": torch.zeros(3)}
    for _ in range(3):
        step(tree, torch.ones(3))
    with torch.no_grad():
        tree["w"].copy_(torch.zeros(3))  # in place: fine
    assert float(step(tree, torch.ones(3))) == 3.0
    tree["w"].data = torch.zeros(3)  # new storage
    with pytest.raises(sp.errors.CaptureError, match=r"args\[0\]\['w'\].*storage"):
        step(tree, torch.ones(3))
    step.reset()
    step(tree, torch.ones(3))  # captured again


def _functional_worker(rank, world):
    data = batches(5, seed=rank + 1)
    out = []
    for captured in (False, True):
        model = Toy()
        plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0)
        params = sp.shard_tree(dict(model.named_parameters()), plan)
        opt = sp.optim.adamw(lr=sp.optim.warmup_cosine(1e-2, 2, 5), weight_decay=0.1, mask=sp.optim.trainable(plan),
                             capturable=True)
        state = opt.init(params)
        vg = sp.value_and_grad(lambda p, x, y: sp.functional_call(model, plan, p, (x, y)), plan)

        def step(params, state, x, y):
            loss, grads = vg(params, x, y)
            grads, _ = sp.optim.clip_by_global_norm(grads, 0.5, plan)
            params, state = opt.update(grads, state, params, donate=True)
            return params, state, loss.detach()

        f = sp.capture(step, backend="eager", donate_argnums=(0, 1)) if captured else step
        losses = []
        for x, y in data:
            params, state, loss = f(params, state, x, y)
            losses.append(float(loss))
        out.append((losses, {k: v.clone() for k, v in params.items()}, float(state["step"])))
    return out


@pytest.mark.slow
def test_the_functional_face_captured_equals_eager():
    for (le, pe, se), (lc, pc, sc) in run(_functional_worker, 2, timeout=200):
        assert le == lc and se == sc == 5.0
        assert all(torch.equal(pe[k], pc[k]) for k in pe)


# -- the hyper-parameters that change between steps live on the device ------------------------------------

SCHEDULES = [
    sp.optim.warmup_cosine(3e-4, warmup=10, total=100, end=3e-5),
    sp.optim.linear(1.0, 0.0, steps=7, begin=2),
    sp.optim.linear(1.0, 0.5, steps=0, begin=3),
    sp.optim.constant(2e-3),
    sp.optim.cosine_decay(1.0, steps=0),
    sp.optim.cosine_decay(1.0, steps=30, end=0.1),
    sp.optim.join([sp.optim.constant(1.0), sp.optim.linear_warmup(2.0, 5), sp.optim.constant(0.5)], [3, 20]),
]


@pytest.mark.parametrize("k", range(len(SCHEDULES)))
def test_schedules_on_a_step_tensor_equal_the_python_values_bit_for_bit(k):
    sched = SCHEDULES[k]
    for t in range(-2, 130):
        on_device = sched(torch.tensor(t))
        assert isinstance(on_device, torch.Tensor) and on_device.dtype == torch.float64
        assert float(on_device) == sched(t), (k, t)


def test_as_lr_scheduler_updates_a_tensor_lr_in_place():
    w = nn.Parameter(torch.ones(2))
    lr = torch.tensor(0.0)
    opt = torch.optim.SGD([w], lr=lr)
    sched = sp.optim.warmup_cosine(1.0, warmup=4, total=10)
    s = sp.optim.as_lr_scheduler(opt, sched)
    for t in range(12):
        assert opt.param_groups[0]["lr"] is lr  # the tensor a captured step reads
        assert float(lr) == pytest.approx(sched(t), abs=1e-7)
        opt.step()
        s.step()


@pytest.mark.parametrize("lr", [1e-2, sp.optim.warmup_cosine(1e-2, 3, 10, 1e-3)])
@pytest.mark.parametrize("donate", [False, True])
def test_adamw_on_a_step_tensor_equals_the_host_path_bit_for_bit(lr, donate):
    torch.manual_seed(0)
    start = {"a": torch.randn(10, 3), "b": torch.randn(7)}
    res = []
    for capturable in (False, True):
        opt = sp.optim.adamw(lr=lr, weight_decay=0.1, capturable=capturable)
        p = {k: v.clone() for k, v in start.items()}
        st = opt.init(p)
        assert isinstance(st["step"], torch.Tensor)
        g = torch.Generator().manual_seed(1)
        for _ in range(12):
            p, st = opt.update({k: torch.randn(v.shape, generator=g) for k, v in p.items()}, st, p, donate=donate)
        res.append((p, float(st["step"])))
    (p0, s0), (p1, s1) = res
    assert s0 == s1 == 12.0
    assert all(torch.equal(p0[k], p1[k]) for k in p0)


def _hyper_worker(rank, world, tmp):
    model = Toy()
    plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0)
    sp.shard(model, plan)
    lr = torch.tensor(1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    x, y = batches(1, seed=rank)[0]
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    sp.checkpoint.save(f"{tmp}/c", model, opt, step=1)
    lr.fill_(5.0)
    sp.checkpoint.load(f"{tmp}/c", model, opt)
    kept = opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(1e-2)
    # a Python-number lr changed after the capture: refused at the next replay, not silently ignored
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1)
    f = sp.capture(_train_step(model, opt2), backend="eager", warmup=1)
    f(x, y)
    f(x, y)  # the capture
    f(x, y)  # a replay, lr unchanged
    opt2.param_groups[0]["lr"] = 0.05
    try:
        f(x, y)
        msg = None
    except sp.errors.CaptureError as exc:
        msg = str(exc)
    return kept, msg


@pytest.mark.slow
def test_a_tensor_lr_stays_the_tensor_through_a_checkpoint_and_a_python_lr_change_is_refused(tmp_path):
    for kept, msg in run(_hyper_worker, 2, str(tmp_path), timeout=200):
        assert kept  # sp.checkpoint.load fills the tensor the captured graph reads, instead of a float in its place
        assert msg is not None and "param_groups[0]['lr'] changed from 0.1 to 0.05" in msg and "torch.tensor" in msg



def test_a_replay_refuses_a_tensor_hyper_parameter_replaced_since_the_capture():
    """A tensor lr is read by the graph in place: a scheduler's fill_ reaches every replay. Assigning a new value
    in its place (``group["lr"] = 0.05``, a manual decay loop's way) left the graph reading the old tensor: every
    replay trained with the learning rate of the capture, silently. Refused at the next replay, naming it."""
    w = nn.Parameter(torch.ones(3))
    lr = torch.tensor(0.1)
    opt = torch.optim.SGD([w], lr=lr)

    def step(x):
        (w * x).sum().backward()
        opt.step()
        opt.zero_grad()

    f = sp.capture(step, backend="eager", warmup=1)
    for _ in range(3):  # a warm-up call, the capture, a replay
        f(torch.ones(3))
    lr.fill_(0.05)  # in place: what the graph reads
    f(torch.ones(3))
    for new in (0.05, torch.tensor(0.05)):
        opt.param_groups[0]["lr"] = new
        with pytest.raises(sp.errors.CaptureError, match=r"param_groups\[0\]\['lr'\].*replaced.*fill_"):
            f(torch.ones(3))
    opt.param_groups[0]["lr"] = lr
    f(torch.ones(3))  # the captured tensor back: replays
    opt.load_state_dict(opt.state_dict())  # torch's load puts a copy of the lr tensor in its place: captured again
    replays = f.replays
    f(torch.ones(3))
    assert opt.param_groups[0]["lr"] is not lr and f.replays == replays  # a capture, not a replay
    f(torch.ones(3))
    assert f.replays == replays + 1

def test_a_replay_refuses_a_tuple_or_flag_hyper_parameter_changed_since_the_capture():
    """[Note: hyper-parameters a graph bakes in] AdamW's betas reach its kernels as Python floats: a beta2
    schedule that sets a new tuple (or a flag such as ``maximize`` flipped) left every replay with the capture's,
    silently (only numbers and tensors were compared). Refused at the next replay, naming the key."""
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1, betas=(0.9, 0.99), foreach=True)

    def step(x):
        (w * x).sum().backward()
        opt.step()
        opt.zero_grad()

    f = sp.capture(step, backend="eager", warmup=1)
    for _ in range(3):
        f(torch.ones(3))
    opt.param_groups[0]["betas"] = (0.9, 0.99)  # an equal tuple: the same graph
    f(torch.ones(3))
    for key, new, shown in (("betas", (0.9, 0.95), r"\(0\.9, 0\.99\) to \(0\.9, 0\.95\)"),
                            ("maximize", True, "False to True")):
        then = opt.param_groups[0][key]
        opt.param_groups[0][key] = new
        with pytest.raises(sp.errors.CaptureError, match=rf"param_groups\[0\]\['{key}'\] changed from {shown}"):
            f(torch.ones(3))
        opt.param_groups[0][key] = then
    f(torch.ones(3))  # back to the captured values: replays
    assert f.replays == 3


def test_capture_failure_message_names_the_right_cause():
    """A capture-rule violation (torch's "operation not permitted when stream is capturing") gets the host-read
    hint; another error of the step under capture (an attention backend unavailable in a graph) does not."""
    from shardplan.runtime.capture.graph import capture_failed
    rule = capture_failed(RuntimeError("CUDA error: operation not permitted when stream is capturing"))
    assert ".item()" in rule and "capturable=True" in rule
    other = capture_failed(RuntimeError("No available kernel. Aborting execution."))
    assert "No available kernel" in other and ".item()" not in other and "ran eagerly in the warm-up" in other


def _mesh_capture_worker(rank, world, case):
    """A GPT on an HSDP mesh or a dp x tp mesh: eager steps against the same steps through capture's rules."""
    from shardplan.models import gpt, gpt_rules, gpt_rules_tp
    out = {}
    for mode in ("eager", "captured"):
        torch.manual_seed(0)
        model = gpt.build("tiny")
        if case == "hsdp":
            plan = sp.plan(model, gpt_rules.HSDP_RULES, sp.Mesh(replica=2, shard=2), units=gpt_rules.UNITS,
                           min_unit_bytes=0)
        else:
            plan = sp.plan(model, gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2), compute_axes=gpt_rules_tp.compute_axes,
                           units=gpt_rules_tp.UNITS, min_unit_bytes=0)
        sp.shard(model, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1)
        sched = sp.optim.as_lr_scheduler(opt, sp.optim.warmup_cosine(1e-2, warmup=2, total=5))

        def step(t):
            loss = model(t[:, :-1], t[:, 1:])
            loss.backward()
            sp.clip_grad_norm_(model, 0.5)
            opt.step()
            opt.zero_grad()
            return loss.detach()

        f = sp.capture(step, backend="eager") if mode == "captured" else step
        g = torch.Generator().manual_seed(plan.data_index(rank) + 7)  # the ranks of a tp group: one batch
        losses = []
        for _ in range(5):
            losses.append(float(f(torch.randint(0, 64, (4, 17), generator=g))))
            sched.step()
        out[mode] = (losses, {k: v.clone() for k, v in sp.checkpoint.full_state_dict(model).items()}, getattr(f, "replays", 0))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", ["hsdp", "tp"])
def test_a_captured_step_on_hsdp_and_tensor_parallel_meshes_equals_eager(case):
    """capture's contracts on the meshes the issue names: an HSDP mesh (replica x shard) and dp x tp, 4 ranks."""
    for r in run(_mesh_capture_worker, 4, case, timeout=300):
        (le, pe, _), (lc, pc, replays) = r["eager"], r["captured"]
        assert replays == 2  # 2 warm-up steps, the capture, 2 replays
        assert le == lc
        assert all(torch.equal(pe[k], pc[k]) for k in pe)


class _HostFrozenGraph:
    """A CUDA graph's replay, mimicked on the CPU: the captured step's device work (run eagerly here, under the
    facts it was captured with: the shards stale after the step before) and none of its host bookkeeping: the
    executor's flags and the parameters' version counters are left as they were. Given the captured ``graph``
    (``f.graphs``' entry), it is stricter: the ops it runs must be the ops the capture recorded (a graph replays
    those, whatever the host believes), and the step's output tensor is written into the graph's in place."""

    def __init__(self, step, static_args, exe, params, graph=None):
        self.step, self.args, self.exe, self.params, self.g = step, static_args, exe, params, graph

    def replay(self):
        exe = self.exe
        stale, versions, counters = exe.stale, exe.versions, tuple(p._version for p in self.params)
        exe.stale = True
        record = exe.record = [] if self.g is not None else None
        out = self.step(*self.args[0], **self.args[1])
        exe.record = None
        exe.stale, exe.versions = stale, versions
        torch._C._autograd._unsafe_set_version_counter(tuple(self.params), counters)
        if self.g is not None:
            captured = self.g.ops[id(exe)]
            assert tuple(record) == captured, (f"the capture recorded {len(captured)} ops, the step under the "
                                               f"capture's facts runs {len(record)}: a graph would replay others")
            with torch.no_grad():
                self.g.out.copy_(out)


def _train_step(model, opt):
    """``model``'s training step under ``opt`` (forward, backward, step, zero_grad) returning the loss."""
    def step(*inputs):
        loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def _captured_toy(rank, world, n, **plan_kw):
    """A sharded Toy's SGD step captured with the eager backend (two warm-up calls and the capture made, on the
    first three of ``n`` batches): the model, the captured step and the batches."""
    model, step = _toy_sgd_step(world, **plan_kw)
    f = sp.capture(step, backend="eager")
    data = batches(n, seed=rank + 1)
    for x, y in data[:3]:
        f(x, y)
    return model, f, data


def _toy_sgd_step(world, **plan_kw):
    """A sharded Toy and its training step (forward, backward, SGD, zero_grad) returning the loss."""
    model = Toy()
    sp.shard(model, sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0, **plan_kw))
    return model, _train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _eval_between_replays_worker(rank, world):
    from shardplan.runtime.builder import engine_of
    data = batches(6, seed=rank + 1)
    evals = {}
    for mode in ("eager", "captured"):
        model, step = _toy_sgd_step(world, strategy=2)
        f = sp.capture(step, backend="eager") if mode == "captured" else step
        out = []
        for i, (x, y) in enumerate(data):
            f(x, y)
            if mode == "captured" and i == 2:  # captured: the later calls replay, as a CUDA graph's would
                g = next(iter(f.graphs.values()))
                g.graph = _HostFrozenGraph(step, g.static_args, engine_of(model), list(model.parameters()))
            if i >= 2:
                with torch.no_grad():  # an evaluation between calls
                    out.append(float(model(*data[0])))
        evals[mode] = out
    return evals


def test_an_evaluation_between_replays_reads_the_stepped_parameters():
    """A replay runs no Python: the host's bookkeeping stays as the capture left it. ZeRO-2 keeps the gathered
    parameters between steps and gathers again only when the shards went stale; an evaluation forward between
    replays made them fresh, and the next replay (whose graph gathers, then steps the optimizer) left the host
    believing so: the evaluation after it read the parameters of the step before, silently. Each replay now
    leaves the executors as the capture did (the shards stale)."""
    for r in run(_eval_between_replays_worker, 2, timeout=120):
        assert r["captured"] == r["eager"], r


def _eval_every_step_worker(rank, world):
    data = batches(6, seed=rank + 1)
    out = {}
    for mode in ("eager", "captured"):
        model, step = _toy_sgd_step(world, strategy=2)
        f = sp.capture(step, backend="eager") if mode == "captured" else step
        losses, evals, gathers = [], [], None
        try:
            for i, (x, y) in enumerate(data):
                losses.append(float(f(x, y)))
                if mode == "captured" and i == 2:  # the capture: the ops every replay repeats
                    ops = next(iter(next(iter(f.graphs.values())).ops.values()))
                    gathers = [o for o in ops if o.kind == "all_gather" and o.trigger.startswith("before_forward")]
                if i < 3:  # an evaluation after each warm-up call and the capture (then none)
                    with torch.no_grad():
                        evals.append(float(model(*data[0])))
        except sp.errors.CaptureError as exc:
            return {"error": str(exc)}
        out[mode] = (losses, evals, {k: v.clone() for k, v in sp.checkpoint.full_state_dict(model).items()}, gathers)
    return out


def test_an_evaluation_before_the_capture_and_between_replays_is_accepted_under_zero2():
    """[Note: stale shards at the capture] an evaluation after each warm-up call leaves ZeRO-2's gathered
    parameters fresh before the next call; every call after the first begins stale (as a training step ends),
    so the capture records the gathers every later step needs (without: refused when only the last warm-up was
    followed by an evaluation, and captured without them, training every replay on the parameters of the step
    before, when every warm-up was), and losses, evaluations and parameters equal the eager run's bit for bit."""
    for r in run(_eval_every_step_worker, 2, timeout=120):
        assert "error" not in r, r
        (le, ee, pe, _), (lc, ec, pc, gathers) = r["eager"], r["captured"]
        assert le == lc and ee == ec and all(torch.equal(pe[k], pc[k]) for k in pe)
        assert gathers  # the capture gathers the stepped shards (a CUDA graph without them trains on stale ones)



def _capture_gathers(f) -> int:
    """How many all-gathers before the forward the (first) captured graph of ``f`` recorded."""
    ops = next(iter(next(iter(f.graphs.values())).ops.values()))
    return sum(o.kind == "all_gather" and o.trigger.startswith("before_forward") for o in ops)


def _functional_eval_worker(rank, world, donate):
    from shardplan.runtime.capture import session as CAP
    from shardplan.runtime.functional import runtime_of
    data = batches(6, seed=rank + 1)
    out = {}
    for mode in ("eager", "captured"):
        model = Toy()
        plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0, strategy=2)
        params = sp.shard_tree(dict(model.named_parameters()), plan)
        opt = sp.optim.adamw(lr=1e-2, capturable=True)
        state = opt.init(params)
        vg = sp.value_and_grad(lambda p, x, y: sp.functional_call(model, plan, p, (x, y)), plan)

        def step(params, state, x, y):
            loss, grads = vg(params, x, y)
            params, state = opt.update(grads, state, params, donate=donate)
            return params, state, loss.detach()

        f = sp.capture(step, backend="eager", donate_argnums=(0, 1) if donate else ()) if mode == "captured" else step
        losses, evals, loads = [], [], []
        try:
            for i, (x, y) in enumerate(data):
                params, state, loss = f(params, state, x, y)
                losses.append(float(loss))
                if mode == "captured" and i == 0:  # whether each captured call loads the leaves into the shards
                    face = runtime_of(model, plan).face
                    load = face.load
                    face.load = lambda *a, **k: loads.append((CAP._ACTIVE is not None, load(*a, **k))) or loads[-1][1]
                if i < 3:  # an evaluation after each warm-up call and the capture
                    with torch.no_grad():
                        evals.append(float(sp.functional_call(model, plan, params, data[0])))
        except sp.errors.CaptureError as exc:
            return {"error": str(exc)}
        out[mode] = (losses, evals, {k: v.clone() for k, v in params.items()},
                     _capture_gathers(f) if mode == "captured" else None, [c for inside, c in loads if inside])
    return out


@pytest.mark.parametrize("donate", [True, False])
def test_the_functional_face_evaluated_before_the_capture_captures_the_gathers(donate):
    """[Note: stale shards at the capture], the functional face: ZeRO-2 gathers again when the leaves changed
    since it loaded them. An evaluation after a warm-up call loads the leaves the donated update changed in
    place: the capture saw nothing changed and recorded neither the leaves' copy into the shards nor the
    gathers (every CUDA-graph replay would train on the parameters the evaluation gathered before it). Without
    donation the warm-up after an evaluation gathered nothing while the capture (static copies) did: refused.
    (On the CPU, with donation, the eager backend's second replay gathered and was refused.) Every call after the
    first now loads every leaf again: the capture records the copy and the gathers."""
    for r in run(_functional_eval_worker, 2, donate, timeout=120):
        assert "error" not in r, r
        (le, ee, pe, _, _), (lc, ec, pc, gathers, loaded) = r["eager"], r["captured"]
        assert le == lc and ee == ec and all(torch.equal(pe[k], pc[k]) for k in pe)
        assert gathers  # the capture gathers the stepped shards
        assert loaded == [True] * 5  # and copies the leaves into them (a graph replays that copy), as every call


def _late_model_worker(rank, world):
    from shardplan.runtime.capture import session as CAP
    from shardplan.runtime.functional import runtime_of
    data = batches(4, seed=rank + 1)
    made = []
    for _ in range(2):
        model = Toy()
        plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0, strategy=2)
        made.append((model, plan, sp.shard_tree(dict(model.named_parameters()), plan)))
    calls = []

    def evaluate(x, y):  # a captured evaluation step; model B joins from its second call on
        with torch.no_grad():
            out = sum(sp.functional_call(m, pl, p, (x, y)) for m, pl, p in made[:1 + bool(calls)])
        calls.append(1)
        return out

    f = sp.capture(evaluate, backend="eager", warmup=1)
    model_b, plan_b, params_b = made[1]
    f(*data[0])  # the warm-up: A only
    with torch.no_grad():
        sp.functional_call(model_b, plan_b, params_b, data[0])  # B used outside: its leaves loaded
        for p in params_b.values():  # B trained in place (a donated update) since: every replay must copy the leaves
            p.mul_(0.5)
    face, loads = runtime_of(model_b, plan_b).face, []
    load = face.load
    face.load = lambda *a, **k: loads.append((CAP._ACTIVE is not None, load(*a, **k))) or loads[-1][1]
    with torch.no_grad():
        sp.functional_call(model_b, plan_b, params_b, data[0])  # and evaluated again: loaded as they are now
    f(*data[1])  # the capture: A and B
    return loads


def test_a_functional_model_first_used_after_the_first_call_is_loaded_at_the_capture():
    """[Note: stale shards at the capture] for a model a captured step runs first in a later call (B, loaded by an
    evaluation just before): the capture must copy B's leaves into the shards, as every replay must (updates
    between replays change them in place). It skipped the copy (the leaves were as the evaluation loaded them),
    so every CUDA-graph replay would have read B's shards as they were at that evaluation."""
    for loads in run(_late_model_worker, 2, timeout=120):
        assert loads == [(False, True), (True, True)], loads


def _eval_step_worker(rank, world):
    data = batches(7, seed=rank + 1)
    out = {}
    for mode in ("eager", "captured"):
        model, train = _toy_sgd_step(world, strategy=2)

        def evaluate(x, y):
            with torch.no_grad():
                return model(x, y)

        t, e = (sp.capture(train, backend="eager"), sp.capture(evaluate, backend="eager")) if mode == "captured" \
            else (train, evaluate)
        evals = []
        try:
            for k in range(4):
                t(*data[k])
                for j in range(3):  # an evaluation phase of three batches, the evaluation step captured too
                    evals.append(float(e(*data[4 + j])))
        except sp.errors.CaptureError as exc:
            return {"error": str(exc)}
        out[mode] = (evals, _capture_gathers(e) if mode == "captured" else None)
    return out


def test_a_captured_evaluation_step_gathers_the_parameters_the_training_step_changed():
    """An evaluation step captured beside the training step (ZeRO-2): its second call followed the first without
    an optimizer step, so it gathered nothing, and its capture neither: every CUDA-graph replay would read the
    full parameters its first call gathered, whatever the training steps between changed (on the CPU, the
    eager backend's replay after a training step ran other ops and was refused). Every call after the first
    begins stale: the evaluation graph gathers."""
    for r in run(_eval_step_worker, 2, timeout=120):
        assert "error" not in r, r
        assert r["eager"][0] == r["captured"][0] and r["captured"][1]

# -- Hugging Face models through the captured step, replays mimicking a CUDA graph's -----------------------------

def _hf_capture_model(name):
    """A tiny Hugging Face model (default arguments: GPT-2's and T5's dropout included), its rules and units."""
    import transformers
    torch.manual_seed(0)
    llama = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    if name == "llama":
        model, units = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama)), [r"model\.layers\.\d+"]
    elif name == "mixtral":  # experts sharded over dp as any parameter (not expert parallel: capturable)
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**llama, num_local_experts=4,
                                                                           num_experts_per_tok=2))
        units = [r"model\.layers\.\d+"]
    else:
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0))
        units = [r"encoder\.block\.\d+", r"decoder\.block\.\d+"]
    return model, [(r".*(norm|layer_norm).*", sp.P()), (r".*", sp.P("dp"))], units


def _hf_capture_worker(rank, world, name, strategy):
    from shardplan.runtime.builder import engine_of
    g = torch.Generator().manual_seed(rank + 11)
    data = [(torch.randint(1, 97, (4, 8), generator=g), torch.randint(1, 97, (4, 5), generator=g)) for _ in range(6)]
    out = {}
    for mode in ("eager", "captured"):
        model, rules, units = _hf_capture_model(name)
        sp.shard(model, sp.plan(model, rules, sp.Mesh(dp=world), units=units, min_unit_bytes=0, strategy=strategy))
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1)  # capturable on a GPU
        sched = sp.optim.as_lr_scheduler(opt, sp.optim.warmup_cosine(1e-2, warmup=2, total=6))

        def loss_of(x, y):
            return model(input_ids=x, labels=y if name == "t5" else x).loss

        step = accumulating_step(model, opt, loss_of)  # two micro-batches, clipped: one optimizer step a call

        f = sp.capture(step, backend="eager") if mode == "captured" else step
        torch.manual_seed(100 + rank)  # dropout: the same draws in both runs
        losses, evals = [], []
        for i, (x, y) in enumerate(data):
            losses.append(float(f(x, y)))
            if mode == "captured" and i == 2:  # captured: the later calls replay, as a CUDA graph's would
                cg = next(iter(f.graphs.values()))
                cg.graph = _HostFrozenGraph(step, cg.static_args, engine_of(model), list(model.parameters()), cg)
            sched.step()
            with torch.no_grad():  # an evaluation after every warm-up call, the capture and every replay
                evals.append(float(loss_of(*data[0])))
        out[mode] = (losses, evals, {k: v.clone() for k, v in sp.checkpoint.full_state_dict(model).items()},
                     getattr(f, "replays", 0))
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", [1, 2, 3])
@pytest.mark.parametrize("name", ["llama", "t5", "mixtral"])
def test_hf_models_captured_with_graph_like_replays_equal_eager_bit_for_bit(name, strategy):
    """Llama, T5 and Mixtral (experts over dp) under ZeRO-1/2/3: two micro-batches under no_sync, clipping, AdamW
    with a tensor lr stepped by a schedule between calls, and an evaluation forward after every call. The replays
    run none of the host's bookkeeping, as a CUDA graph's (_HostFrozenGraph), and must run the ops the capture
    recorded: losses, evaluations and parameters equal the eager run's bit for bit. Under ZeRO-1/2 this fails
    without [Note: the host after a replay] (the evaluations after replays read the parameters of the step before)
    and without [Note: stale shards at the capture] (the capture, evaluated before, records no gathers)."""
    pytest.importorskip("transformers")  # imported here: the forked ranks start with it
    for r in run(_hf_capture_worker, 2, name, strategy, timeout=100):
        (le, ee, pe, _), (lc, ec, pc, replays) = r["eager"], r["captured"]
        assert replays == 3 and le == lc and ee == ec
        assert [k for k in pe if not torch.equal(pe[k], pc[k])] == []


def _outputs_worker(rank, world):
    data = batches(5, seed=rank + 1)
    _, step = _toy_sgd_step(world)
    f = sp.capture(step, backend="eager")
    outs, at_call = [], []
    for x, y in data:
        outs.append(f(x, y))
        at_call.append(float(outs[-1]))
    return [o is outs[2] for o in outs], at_call, [float(o) for o in outs]


def test_the_eager_backend_overwrites_the_captured_outputs_as_a_graph_does():
    """A CUDA graph's replay writes its outputs into the capture's tensors: the eager backend's replays do the
    same (a loop keeping outputs without cloning sees on the CPU what it would see on a GPU)."""
    for same, at_call, kept in run(_outputs_worker, 2, timeout=120):
        assert same == [False, False, True, True, True], same
        assert len(set(at_call)) == 5 and kept == at_call[:2] + [at_call[-1]] * 3, (at_call, kept)
