"""Learning-rate schedules: properties (monotone warm-up, bounds, endpoints), the torch LRScheduler adapter
and the pure optimizers, which must see the same learning rate at every step."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardplan as sp

LR = st.floats(1e-6, 10.0, allow_nan=False)
STEPS = st.integers(0, 500)


@settings(max_examples=60, deadline=None)
@given(peak=LR, frac=st.floats(0.0, 1.0), warmup=STEPS, extra=STEPS)
def test_warmup_cosine_endpoints_bounds_and_shape(peak, frac, warmup, extra):
    end = peak * frac
    total = warmup + extra
    sched = sp.optim.warmup_cosine(peak, warmup, total, end=end)
    values = [sched(t) for t in range(total + 3)]
    assert sched(0) == (0.0 if warmup else peak)
    assert sched(warmup) == peak  # the ends exactly
    if extra:
        assert sched(total) == end and sched(total + 100) == end
    assert all(0.0 <= v <= peak * (1 + 1e-12) for v in values)
    up, down = values[:warmup + 1], values[warmup:total + 1]
    assert all(a <= b for a, b in zip(up, up[1:])), "warm-up must not decrease"
    assert all(a >= b - 1e-15 * peak for a, b in zip(down, down[1:])), "the cosine must not increase"
    assert all(v >= end * (1 - 1e-12) for v in down)


@settings(max_examples=60, deadline=None)
@given(peak=LR, init=st.floats(0.0, 1.0), warmup=st.integers(1, 500), t=STEPS)
def test_linear_warmup_is_monotone_and_reaches_the_peak(peak, init, warmup, t):
    sched = sp.optim.linear_warmup(peak, warmup, init=init * peak)
    assert sched(0) == init * peak and sched(warmup) == peak and sched(warmup + t) == peak
    assert sched(min(t, warmup)) <= sched(min(t + 1, warmup)) + 1e-15
    assert sched(-5) == sched(0)  # before the start: the first value


@settings(max_examples=60, deadline=None)
@given(init=LR, frac=st.floats(0.0, 1.0), steps=st.integers(1, 500), t=STEPS)
def test_cosine_decay_and_constant(init, frac, steps, t):
    sched = sp.optim.cosine_decay(init, steps, end=init * frac)
    assert sched(0) == init and sched(steps) == init * frac  # the ends exactly
    assert min(init, init * frac) - 1e-12 <= sched(t) <= init
    if steps % 2 == 0:
        assert math.isclose(sched(steps // 2), (init + init * frac) / 2, rel_tol=1e-9)
    assert sp.optim.constant(init)(t) == init


def test_by_name_and_bad_arguments_raise_shardplan_errors():
    assert sp.optim.by_name("warmup_cosine", 1.0, warmup=2, total=4)(2) == 1.0
    assert sp.optim.by_name("constant", 0.5)(99) == 0.5
    with pytest.raises(sp.ShardingError, match="warmup_cosine"):
        sp.optim.by_name("cosine", 1.0)
    with pytest.raises(sp.ShardingError, match="longer than total"):
        sp.optim.warmup_cosine(1.0, warmup=10, total=5)
    with pytest.raises(sp.ShardingError, match="whole number"):
        sp.optim.linear_warmup(1.0, warmup=-1)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g)}


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {"a": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g)}


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_torch_adapter_and_pure_optimizer_see_the_same_lr_sequence(kind):
    sched = sp.optim.warmup_cosine(0.1, warmup=3, total=10, end=0.01)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in _params().items()}
    if kind == "adamw":
        opt = torch.optim.AdamW(params.values(), lr=123.0, weight_decay=0.1)
        pure = sp.optim.adamw(lr=sched, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(params.values(), lr=123.0, momentum=0.9, weight_decay=0.1)
        pure = sp.optim.sgd(lr=sched, momentum=0.9, weight_decay=0.1)
    lr_sched = sp.optim.as_lr_scheduler(opt, sched)
    tree, state = _params(), None
    state = pure.init(tree)
    seen = []
    for step in range(14):
        seen.append(opt.param_groups[0]["lr"])
        for k, p in params.items():
            p.grad = _grads(step)[k]
        opt.step()
        lr_sched.step()
        tree, state = pure.update(_grads(step), state, tree)
        for k in params:  # the same arithmetic: bit for bit
            assert torch.equal(tree[k], params[k].detach()), (kind, step, k)
    assert seen == [sched(t) for t in range(14)]
    assert lr_sched.get_last_lr() == [sched(14)]
    # resuming: a scheduler built at step 7 continues the same sequence; its state dict leaves the function out
    again = sp.optim.as_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), sched, step=7)
    assert again.get_last_lr() == [sched(7)]
    again.optimizer.step()
    again.step()
    assert again.get_last_lr() == [sched(8)] and "schedules" not in again.state_dict()
    with pytest.raises(sp.ShardingError, match="param groups"):
        sp.optim.as_lr_scheduler(opt, [sched, sched])


@pytest.mark.parametrize("capturable,donate", [(False, False), (False, True), (True, False), (True, True)])
def test_adamw_in_groups_is_bit_identical(monkeypatch, capturable, donate):
    """[Note: the update's temporaries] the update runs over groups of at most GROUP_BYTES of parameters (its
    temporaries bounded by the group, not the model); the results are bit for bit those of one group."""
    import shardplan.optim as O
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (33,), (4, 4, 3), (1,), (50, 2), (0,), (9, 9)]

    def run(limit):
        monkeypatch.setattr(O, "GROUP_BYTES", limit)
        g.manual_seed(0)
        params = {f"p{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
        opt = sp.optim.adamw(lr=sp.optim.warmup_cosine(1e-2, warmup=2, total=10), weight_decay=0.1,
                             capturable=capturable)
        state = opt.init(params)
        for _ in range(4):
            grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
            params, state = opt.update(grads, state, params, donate=donate)
        return params, state

    whole, whole_state = run(1 << 40)
    grouped, grouped_state = run(200)  # a few leaves per group, a large leaf alone
    for k in whole:
        assert torch.equal(whole[k], grouped[k]), k
        assert torch.equal(whole_state["exp_avg_sq"][k], grouped_state["exp_avg_sq"][k]), k
    assert O._groups([torch.zeros(30), torch.zeros(30), torch.zeros(100)], [0, 1, 2], 200) == [[0], [1], [2]]
    assert O._groups([torch.zeros(10)] * 4, [0, 1, 2, 3], 80) == [[0, 1], [2, 3]]


def test_clip_by_global_norm_donated_scales_in_place():
    """``donate=True``: the same numbers, written into the caller's gradient tensors (no second copy)."""
    plan = sp.plan({"a": torch.zeros(6, 4), "b": torch.zeros(5)}, [(r".*", sp.P())], sp.Mesh(dp=1))
    grads = {"a": torch.full((6, 4), 2.0), "b": torch.full((5,), -3.0)}
    import torch.distributed as dist
    if not dist.is_initialized():
        import os
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29655")
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        pure, n1 = sp.optim.clip_by_global_norm({k: v.clone() for k, v in grads.items()}, 1.0, plan)
        same, n2 = sp.optim.clip_by_global_norm(grads, 1.0, plan, donate=True)
    finally:
        dist.destroy_process_group()
    assert same is grads and torch.equal(n1, n2)
    assert all(torch.equal(pure[k], grads[k]) for k in grads) and float(n1) > 1.0
    assert abs(float(torch.cat([grads["a"].flatten(), grads["b"]]).norm()) - 1.0) < 1e-5
