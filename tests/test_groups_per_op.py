"""One collective op names one process group: a unit whose buffers shard over different mesh axes gets
one all-gather / reduce-scatter / all-reduce per group, and trains like one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import shardplan as sp
from distributed import run

RULES = [(r".*\.weight", sp.P("a")), (r".*\.bias", sp.P("b"))]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))


def _plan(model, strategy="optim_grads_params"):
    return sp.plan(model, RULES, sp.Mesh(a=2, b=2), units=[r"\d+"], min_unit_bytes=0, strategy=strategy)


def test_one_op_per_group():
    plan = _plan(_model())
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        ops = [o for o in plan.ops() if o.kind == kind and o.unit == "0" and o.what != "used"
               and not (kind == "all_gather" and o.phase == "backward")]  # ZeRO-3 gathers again in backward
        assert sorted(o.axes for o in ops) == [("a",), ("b",)], (kind, ops)
        for o in ops:
            b = [plan.buffers[i] for i in o.buffers]
            assert all((x.replica_axes if kind == "all_reduce" else x.axes) == o.axes for x in b)
    merged = [dataclasses_replace_axes(o) for o in plan.schedule]
    with pytest.raises(sp.errors.PlanError, match="one op per group|runs over axes"):
        plan.with_schedule(merged)


def test_a_schedule_missing_one_groups_reduction_is_refused():
    """Dropping the reduce-scatter (or all-reduce) of one group while another group's stays would leave
    that buffer's gradient unreduced: a wrong number, so validation refuses it, naming the buffer."""
    plan = _plan(_model())
    for kind in ("reduce_scatter", "all_reduce"):
        drop = next(o for o in plan.schedule if o.kind == kind and o.unit == "0" and o.axes == ("b",))
        with pytest.raises(sp.errors.PlanError, match=f"{kind} of buffer #{drop.buffers[0]} was never issued"):
            plan.with_schedule([o for o in plan.schedule if o is not drop])


def dataclasses_replace_axes(o):
    """The unit's two gathers merged into one op over both groups: refused."""
    import dataclasses
    if o.kind == "all_gather" and o.unit == "0" and o.axes == ("a",):
        return dataclasses.replace(o, buffers=tuple(sorted(o.buffers + (o.buffers[0] + 1,))), axes=("a", "b"))
    return o


def _worker(rank, world):
    out = {}
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    for strategy in ("optim_grads_params", "optim"):
        ref = _model()
        model = _model()
        plan = _plan(model, strategy)
        sp.shard(model, plan)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        xs = x.chunk(plan.data_size)[plan.data_index(rank)]
        for _ in range(3):
            with sp.record_ops(model) as ops:
                model(xs).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ref(x).square().mean().backward()   # the mean over all ranks' batches: one process's loss
            ropt.step()
            ropt.zero_grad()
        got = sp.checkpoint.full_state_dict(model)
        out[strategy] = (ops == list(plan.ops(stale=strategy == "optim")),
                         max((got[k] - v).abs().max().item() for k, v in ref.state_dict().items()) if rank == 0 else 0.0)
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_units_over_two_groups_train_like_one_process():
    for out in run(_worker, 4):
        for strategy, (recorded_equal, err) in out.items():
            assert recorded_equal, strategy
            assert err < 1e-6, (strategy, err)
