"""A compute axis is one module implementing the protocol (issue 37): a fake axis, written in this file and
registered, plans (its ops placed in the schedule, its bytes, its note, its JSON, its ops validated) and runs (its
collective through the executor's handler table, recorded where the plan placed it) with no change to shardplan's
source. The planner's own axes (tensor, expert, context parallelism) are registered the same way."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn as nn

import shardplan as sp
from distributed import run
from shardplan.planner import axes as AX
from shardplan.planner.transforms import schedule_edited
from shardplan.planner.axis import Anchor, ComputeAxis, ModuleOps, Resolved, anchors
from shardplan.planner.kinds import ACTIVATIONS, ALL_REDUCE, MODULE_FORWARD
from shardplan.planner.ops import Op
from shardplan.runtime import axes as RUNTIME_AXES
from shardplan.runtime import collectives as C
from shardplan.runtime.axis_ops import AxisOps
from shardplan.runtime.builder import engine_of


class Probe(nn.Module):
    """The identity; under the fake axis its output is averaged over ``dp`` at run time (one all-reduce per call)."""

    def forward(self, x):
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), Probe()) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x).sum()


@dataclasses.dataclass(frozen=True)
class ProbePlan:
    paths: tuple
    anchors: tuple = ()   # one Anchor per path, once placed
    kind = "probe"


class ProbeAxis(ComputeAxis):
    """Every ``Probe`` all-reduces its output over ``dp`` in forward: one in-module op per call."""

    kind = "probe"

    def resolve(self, ctx):
        paths = tuple(p for p, m in ctx.module.named_modules() if isinstance(m, Probe))
        return Resolved(ProbePlan(paths)) if paths and "dp" in ctx.mesh.axis_names else None

    def place(self, ctx, value):
        if value is None:
            return None
        where = anchors(ctx.module, value.paths, ctx.units)
        return dataclasses.replace(value, anchors=tuple(where[p] for p in value.paths))

    def module_ops(self, value, mesh):
        if value is None:
            return ()
        return tuple(ModuleOps(a, forward=(Op(kind=ALL_REDUCE, unit=a.unit, what=ACTIVATIONS, event=MODULE_FORWARD,
                                              at=p, axes=("dp",), bytes=32),))
                     for p, a in zip(value.paths, value.anchors))

    def comm_bytes(self, plan, value):
        return {} if value is None else {"probe": 32 * len(value.paths)}

    def note(self, value, mesh):
        return f"probe axis: {len(value.paths)} probes averaged over dp"

    def claims(self, op):
        return op.kind == ALL_REDUCE and tuple(op.axes) == ("dp",) and op.event == MODULE_FORWARD

    def check_op(self, plan, value, op):
        return None if value is not None and op.at in value.paths else f"{op.at!r} is no probe of the plan"

    def to_dict(self, value):
        return {} if value is None else {"probe_paths": list(value.paths),
                                         "probe_anchors": [dataclasses.asdict(a) for a in value.anchors]}

    def from_dict(self, d):
        if "probe_paths" not in d:
            return None
        return ProbePlan(tuple(d["probe_paths"]), tuple(Anchor(**a) for a in d["probe_anchors"]))


def install_probes(module, plan, groups, exe) -> list:
    """The fake axis at run time: each probe's forward hook asks the executor to run the op the plan placed."""
    value = plan.axis("probe")
    if value is None:
        return []
    ops = AxisOps.of(plan, exe, lambda o: o.at in value.paths, per_key=1)
    group = groups.axis("dp")

    def hook(path):
        def average(_m, _args, out):
            def work():
                t = out.detach().clone()
                C.all_reduce(t, group, async_op=False)
                return out + (t - out).detach()
            return ops.run(path, AxisOps.phase(), 0, work)
        return average
    return [module.get_submodule(p).register_forward_hook(hook(p)) for p in value.paths]


@contextlib.contextmanager
def probe_axis():
    AX.register(ProbeAxis())
    RUNTIME_AXES.register("probe", install_probes)
    try:
        yield
    finally:
        AX.unregister("probe")
        RUNTIME_AXES.unregister("probe")


def _plan(model):
    return sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=2), units=[r"blocks\.\d+"], min_unit_bytes=0)


def test_a_fake_axis_plans_through_the_registry():
    without = _plan(Net())
    with probe_axis():
        assert [a.kind for a in AX.registered()] == ["tp", "ep", "cp", "probe"]
        with pytest.raises(sp.errors.PlanError, match="taken"):
            AX.register(ProbeAxis())
        plan = _plan(Net())
        value = plan.axis("probe")
        assert value.paths == ("blocks.0.1", "blocks.1.1")
        assert [a.unit for a in value.anchors] == ["blocks.0", "blocks.1"]
        mine = [o for o in plan.ops() if o.in_module]
        assert [(o.kind, o.at, o.unit, o.trigger) for o in mine] == [
            ("all_reduce", "blocks.0.1", "blocks.0", "module_forward(blocks.0.1)"),
            ("all_reduce", "blocks.1.1", "blocks.1", "module_forward(blocks.1.1)")]
        # the rest of the schedule is the plan's without the axis; a recompute repeats the probes' ops
        assert [o for o in plan.ops() if not o.in_module] == list(without.ops())
        assert sum(o.in_module for o in plan.ops(recompute=True)) == 4
        assert plan.comm_bytes()["probe"] == 64 and plan.comm_bytes()["total"] == without.comm_bytes()["total"] + 64
        assert "probe axis: 2 probes averaged over dp" in plan.notes
        assert plan.fingerprint() != without.fingerprint() and not schedule_edited(plan)
        again = sp.Plan.from_json(plan.to_json())   # its JSON keys are its own, read back through the registry
        assert again == plan and again.fingerprint() == plan.fingerprint()
        edited = [dataclasses.replace(o, at="head") if o.in_module else o for o in plan.schedule]
        with pytest.raises(sp.errors.PlanError, match="'head' is no probe of the plan"):
            plan.with_schedule(edited)
    assert [a.kind for a in AX.registered()] == ["tp", "ep", "cp"]
    assert _plan(Net()).fingerprint() == without.fingerprint()


def _run_probes(rank, world):
    torch.manual_seed(0)
    model = Net()
    plan = _plan(model)
    sp.shard(model, plan)
    exe = engine_of(model)
    handled = []
    inner = exe._run_op[(ALL_REDUCE, ACTIVATIONS)]
    exe._run_op[(ALL_REDUCE, ACTIVATIONS)] = lambda op, work=None: handled.append(op.at) or inner(op, work)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))  # each rank its own input
    with sp.record_ops(model) as ops:
        loss = model(x)
        loss.backward()
    return ops == list(plan.ops()), handled, loss.item()


@pytest.mark.timeout(240)
def test_a_fake_axis_runs_its_ops_through_the_executor():
    with probe_axis():
        results = run(_run_probes, 2)
    for same, handled, _ in results:
        assert same                                          # recorded == plan.ops(), the probes' ops included
        assert handled == ["blocks.0.1", "blocks.1.1"]       # each through the executor's handler table
    # the first probe averaged the two ranks' activations: from there on they compute the same loss
    assert results[0][2] == pytest.approx(results[1][2], abs=1e-6)


def test_a_traced_plan_pickles_with_its_axes():
    """A plan is a plain frozen dataclass: pickled and back, its axes and fingerprint are the ones it had."""
    import pickle
    from shardplan.models import gpt, gpt_rules_tp
    x = torch.randint(0, 256, (2, 16))
    plan = sp.plan(gpt.build("tiny"), gpt_rules_tp.tp_rules(), sp.Mesh(dp=2, tp=2), units=gpt_rules_tp.UNITS,
                   compute_axes=("tp",), trace=(x, x))
    back = pickle.loads(pickle.dumps(plan))
    assert back == plan and back.axis("tp").activations == plan.axis("tp").activations
    assert back.fingerprint() == plan.fingerprint()
