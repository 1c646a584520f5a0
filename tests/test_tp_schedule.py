"""Tensor parallelism as plan data: every collective a style issues is an op of the schedule, placed
where it runs (between the units' steps), with the inputs siblings share; the runtime's recorded ops
equal ``plan.ops()`` and a plan that guessed an input wrong says so at run time."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import shardplan as sp
from distributed import run

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import gpt  # noqa: E402
import gpt_rules_tp  # noqa: E402

TP = dict(compute_axes=("tp",), units=gpt_rules_tp.UNITS, min_unit_bytes=0)


class CrossBlock(nn.Module):
    """Cross-attention-like: ``q`` reads the decoder state, ``k`` and ``v`` the encoder's (T5's EncDecAttention)."""

    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x, enc):
        return x + self.o(torch.tanh(self.q(x)) * self.k(enc) + self.v(enc))


class Cross(nn.Module):
    def __init__(self, d=16, n=2):
        super().__init__()
        self.blocks = nn.ModuleList(CrossBlock(d) for _ in range(n))
        self.enc = nn.Linear(d, d, bias=False)

    def forward(self, x):
        enc = torch.tanh(self.enc(x))
        for b in self.blocks:
            x = b(x, enc)
        return x.square().mean()


CROSS_RULES = [(r"blocks\.\d+\.(q|k|v)\.weight", sp.P(("tp", "dp"))), (r"blocks\.\d+\.o\.weight", sp.P("dp", "tp")),
               (r".*", sp.P("dp"))]


def _acts(plan, **facts):
    return [o for o in plan.ops(**facts) if o.what == "activations"]


def test_plan_lists_every_tensor_parallel_collective_in_order():
    plan = sp.plan(gpt.build("tiny"), gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2), **TP)
    acts = _acts(plan)
    fwd = [(o.kind, o.at) for o in acts if o.event == "module_forward"]
    bwd = [(o.kind, o.at) for o in acts if o.event == "module_backward"]
    assert fwd == [("all_reduce", "tok_embeddings"),
                   ("all_reduce", "layers.0.attention.wo"), ("all_reduce", "layers.0.feed_forward.w2"),
                   ("all_reduce", "layers.1.attention.wo"), ("all_reduce", "layers.1.feed_forward.w2"),
                   ("all_gather", "output")]
    # siblings reading one input share its gradient's all-reduce; backward meets modules in reverse
    assert bwd == [("all_reduce", "output"), ("all_reduce", "layers.1.feed_forward.w1"),
                   ("all_reduce", "layers.1.attention.wq"), ("all_reduce", "layers.0.feed_forward.w1"),
                   ("all_reduce", "layers.0.attention.wq")]
    assert all(o.axes == ("tp",) for o in acts)
    ops = list(plan.ops())
    at = lambda kind, what, unit, event: next(i for i, o in enumerate(ops)  # noqa: E731
                                              if (o.kind, o.what, o.unit, o.event) == (kind, what, unit, event))
    wo0 = next(i for i, o in enumerate(ops) if o.at == "layers.0.attention.wo")
    assert at("wait", "params", "layers.0", "pre_forward") < wo0 < at("free", "params", "layers.0", "post_forward")
    w1b = next(i for i, o in enumerate(ops) if o.at == "layers.1.feed_forward.w1" and o.event == "module_backward")
    assert at("prepare", "grads", "layers.1", "pre_backward") < w1b < at("reduce_scatter", "grads", "layers.1",
                                                                          "post_backward")
    # no backward in eval; recomputation repeats each block's forward collectives after its pre_backward
    assert all(o.event == "module_forward" for o in _acts(plan, grad=False))
    again = [o for o in _acts(plan, recompute="whole") if o.when]
    assert [o.at for o in again] == ["layers.1.attention.wo", "layers.1.feed_forward.w2",
                                     "layers.0.attention.wo", "layers.0.feed_forward.w2"]
    # visible in print(plan), and kept through JSON and the with_* transformations
    text = str(plan)
    assert "reads wq's input" in text and "activation collectives per step: 6 in forward, 5 in backward" in text
    assert sp.Plan.from_json(plan.to_json()).schedule == plan.schedule
    assert _acts(plan.with_prefetch(2)) == acts and _acts(plan.with_order("dynamic")) == acts
    # a compute axis of one rank moves nothing
    assert not _acts(sp.plan(gpt.build("tiny"), gpt_rules_tp.rules, sp.Mesh(dp=4, tp=1), **TP))


class PostNorm(nn.Module):
    """Post-norm blocks (BERT's): ``norm(x + down(relu(up(x))))``. The norm after the row-parallel ``down``
    saves its input, so a checkpointed block's recompute runs past ``down``'s all-reduce."""

    class Block(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.up, self.down, self.norm = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.LayerNorm(d)

        def forward(self, x):
            return self.norm(x + self.down(torch.relu(self.up(x))))

    def __init__(self, d=16):
        super().__init__()
        self.layers = nn.ModuleList(self.Block(d) for _ in range(2))

    def forward(self, x):
        for blk in self.layers:
            x = blk(x)
        return x.square().mean()


POST_RULES = [(r"layers\.\d+\.up\.(weight|bias)", sp.P(("tp", "dp"))), (r"layers\.\d+\.down\.weight", sp.P("dp", "tp")),
              (r".*", sp.P("dp"))]


def test_checkpoint_early_stop_in_plan_ops():
    """Issue 36 item 9: torch's checkpoint (non-reentrant, early stop by default) ends a pre-norm block's
    recompute before its last row-parallel all-reduce: ``plan.ops(recompute=True)`` leaves it out and
    ``recompute="whole"`` keeps it. A traced plan knows from its checkpointed meta step; untraced, each
    unit's last forward collective is assumed left out."""
    x = torch.randint(0, 96, (2, 16))
    for trace in (None, (x, x)):
        plan = sp.plan(gpt.build("tiny"), gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2), **TP, trace=trace)
        again = [(o.at, o.when) for o in plan.schedule if o.when in ("recompute", "recompute_whole")]
        assert again == [("layers.1.attention.wo", "recompute"), ("layers.1.feed_forward.w2", "recompute_whole"),
                         ("layers.0.attention.wo", "recompute"), ("layers.0.feed_forward.w2", "recompute_whole")]
        assert [o.at for o in _acts(plan, recompute=True) if o.when] == ["layers.1.attention.wo", "layers.0.attention.wo"]
        assert len(plan.ops(recompute="whole")) == len(plan.ops(recompute=True)) + 2 == len(plan.ops()) + 4
        assert sp.Plan.from_json(plan.to_json()).schedule == plan.schedule
    assert "2 more when units are recomputed (activation checkpointing; 4 if recomputed whole" in str(plan)
    # a post-norm block's norm saves the all-reduced output: the recompute runs through it (the trace sees it)
    y = torch.randn(2, 5, 16)
    post = lambda **kw: sp.plan(PostNorm(), POST_RULES, sp.Mesh(dp=2, tp=2), compute_axes="tp",  # noqa: E731
                                units=[r"layers\.\d+"], min_unit_bytes=0, **kw)
    assert {o.when for o in post(trace=(y,)).schedule if o.when.startswith("recompute")} == {"recompute"}
    assert {o.when for o in post().schedule if o.when.startswith("recompute")} == {"recompute_whole"}


def test_traced_plan_knows_shared_inputs_and_bytes():
    x = torch.randn(3, 5, 16)
    static = sp.plan(Cross(), CROSS_RULES, sp.Mesh(dp=2, tp=2), compute_axes="tp", units=[r"blocks\.\d+"],
                     min_unit_bytes=0)
    traced = sp.plan(Cross(), CROSS_RULES, sp.Mesh(dp=2, tp=2), compute_axes="tp", units=[r"blocks\.\d+"],
                     min_unit_bytes=0, trace=(x,))
    shares = lambda p: {m.path: m.shares_with for m in p.axis("tp").modules}  # noqa: E731
    assert shares(static)["blocks.0.k"] == "blocks.0.q"       # siblings assumed to read one input
    assert shares(traced)["blocks.0.k"] == "" and shares(traced)["blocks.0.v"] == "blocks.0.k"
    # every block's k and v read the one encoder output: one all-reduce of its gradient, in the backward of
    # the first block, where the last of the four partial gradients arrives
    assert shares(traced)["blocks.1.k"] == shares(traced)["blocks.1.v"] == "blocks.0.k"
    # and the first block's q reads the model's input, which takes no gradient: nothing to reduce
    assert [o.at for o in _acts(traced) if o.event == "module_backward"] == ["blocks.1.q", "blocks.0.k"]
    # the traced ops carry the payloads the byte count is made of (ring: 2(n-1)/n of an all-reduce)
    n = 2
    sent = sum(o.bytes * (2 if o.kind == "all_reduce" else 1) * (n - 1) // n for o in _acts(traced))
    assert sent == traced.comm_bytes()["tensor_parallel"] > 0
    assert all(o.bytes == 0 for o in _acts(static)) and static.comm_bytes()["tensor_parallel"] is None


def _record_worker(rank, world):
    out = {}
    x = torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(0))
    for traced in (False, True):
        torch.manual_seed(0)
        model = Cross()
        plan = sp.plan(model, CROSS_RULES, sp.Mesh(dp=2, tp=2), compute_axes="tp", units=[r"blocks\.\d+"],
                       min_unit_bytes=0, trace=(x[:2],) if traced else None)
        sp.shard(model, plan)
        xs = x.chunk(plan.data_size)[plan.data_index(rank)]
        with warnings.catch_warnings(record=True) as caught, sp.record_ops(model) as ops:
            warnings.simplefilter("always")
            model(xs).backward()
        out[traced] = (ops == list(plan.ops()), [str(w.message) for w in caught if "reads another input" in str(w.message)],
                       sum(o.what == "activations" for o in ops))
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_runtime_records_the_plans_activation_ops_and_says_when_a_guess_was_wrong():
    for out in run(_record_worker, 4):
        equal, warned, n = out[True]
        assert equal and not warned and n == 2 + 2, out[True]   # traced: exactly the plan
        equal, warned, n = out[False]
        assert not equal and warned and "blocks.0.k" in warned[0] and "trace=" in warned[0], out[False]


class _Collectives(TorchDispatchMode):
    """Every collective a step issues (shardplan's through collectives.py: namespace ``c10d``; DTensor's own:
    ``_c10d_functional``), with the pass it ran in and the executor op whose handler was running it (``None``: none)."""

    def __init__(self):
        super().__init__()
        self.log, self.inside, self.phase = [], None, "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional") and func.overloadpacket.__name__ != "wait_tensor":
            self.log.append((self.phase, func.namespace, func.overloadpacket.__name__, self.inside))
        return func(*args, **(kwargs or {}))


def _watch_handlers(exe, mode: _Collectives) -> None:
    """Each handler of the executor's table tells ``mode`` which op it is running."""
    for key, fn in list(exe._run_op.items()):
        def wrapped(op, *rest, _fn=fn):
            outer, mode.inside = mode.inside, op
            try:
                return _fn(op, *rest)
            finally:
                mode.inside = outer
        exe._run_op[key] = wrapped


class Split(nn.Module):
    """A row-parallel layer with no column-parallel sibling (``rowwise_split``: its input's gradient all-gathered)."""

    def __init__(self, d=16):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x))).square().mean()


def _executed_worker(rank, world):
    out = {}
    mesh = sp.Mesh(dp=world // 2, tp=2)
    g = torch.Generator().manual_seed(3)
    cases = {"gpt": (gpt.build("tiny"), gpt_rules_tp.rules, TP, lambda: torch.randint(0, 96, (4, 17), generator=g)),
             "split": (Split(), [(r"down\.weight", sp.P("dp", "tp")), (r".*", sp.P("dp"))],
                       dict(compute_axes="tp", units=[], min_unit_bytes=0), lambda: torch.randn(4, 5, 16, generator=g)),
             "cross": (Cross(), CROSS_RULES, dict(compute_axes="tp", units=[r"blocks\.\d+"], min_unit_bytes=0),
                       lambda: torch.randn(4, 5, 16, generator=g))}
    for name, (model, rules, kw, batch) in cases.items():
        torch.manual_seed(0)
        x = batch()
        trace = ((x[:2, :-1], x[:2, 1:]) if name == "gpt" else (x[:2],))
        plan = sp.plan(model, rules, mesh, trace=trace, **kw)
        sp.shard(model, plan)
        mode = _Collectives()
        _watch_handlers(model._shardplan, mode)
        steps = []
        for step in range(2):  # (the first forward also checks the tp ranks' inputs, outside the schedule)
            x = batch()
            xs = x.chunk(plan.data_size)[plan.data_index(rank)]
            mode.log, mode.phase = [], "forward"
            with sp.record_ops(model) as ops, mode:
                loss = model(xs[:, :-1], xs[:, 1:]) if name == "gpt" else model(xs)
                mode.phase = "backward"
                loss.backward()
            backward_acts = [o for o in plan.ops(stale=step == 0) if o.what == "activations" and
                             o.event == "module_backward"]
            steps.append(dict(
                equal=ops == list(plan.ops(stale=step == 0)),
                # every collective of backward ran inside a handler of the executor, none was DTensor's own
                outside=[e[:3] for e in mode.log if e[3] is None and (step or e[0] == "backward")],
                dtensor_backward=[e[:3] for e in mode.log if e[0] == "backward" and e[1] == "_c10d_functional"],
                # each backward activation op of the plan issued its one collective from inside its handler
                issued=[[e[2] for e in mode.log if e[3] is o] for o in backward_acts],
                kinds=[o.kind for o in backward_acts]))
        out[name] = steps
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_backward_activation_collectives_run_inside_the_executors_handlers(world):
    """What backward runs is the plan's ops by construction: each input-gradient collective of a tensor-parallel
    module (a column-parallel all-reduce, a split input's all-gather) is issued by shardplan inside the executor's
    handler of the plan's ``module_backward`` op, not by DTensor's autograd and recorded after the fact."""
    want = {"all_reduce": ["allreduce_"], "all_gather": ["_allgather_base_"]}
    for out in run(_executed_worker, world):
        for name, steps in out.items():
            kinds = steps[0]["kinds"]
            assert kinds and ("all_gather" in kinds) == (name == "split"), (name, kinds)
            for s in steps:
                assert s["equal"], name
                assert not s["outside"] and not s["dtensor_backward"], (name, s["outside"], s["dtensor_backward"])
                assert s["issued"] == [want[k] for k in s["kinds"]], (name, s["issued"], s["kinds"])
