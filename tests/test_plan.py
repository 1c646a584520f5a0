"""Planner invariants as hypothesis properties, plus plan options, JSON and errors."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardplan as sp
from shardplan import Mesh, P
from shardplan import layout as L
from shardplan.dtypes import itemsize
from shardplan.planner import strategy_level
from shardplan.planner.geometry import replicas
from shardplan.planner.transforms import schedule_edited
from shardplan.runtime.buffers import BufferState

MESHES = [Mesh(dp=1), Mesh(dp=2), Mesh(dp=3), Mesh(dp=4), Mesh(dp=8), Mesh(replica=2, shard=2), Mesh(a=2, b=3),
          Mesh(replica=2, shard=4)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def problems(draw):
    mesh = draw(st.sampled_from(MESHES))
    axes = mesh.axis_names
    n = draw(st.integers(1, 6))
    tree, rules = {}, []
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 23), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        entries = []
        free = list(axes)
        for _ in range(len(shape)):
            pick = draw(st.sampled_from(["none", "one", "two"]))
            if pick == "one" and free:
                entries.append(free.pop(draw(st.integers(0, len(free) - 1))))
            elif pick == "two" and len(free) >= 2:
                entries.append((free.pop(0), free.pop(0)))
            else:
                entries.append(None)
        unit = draw(st.sampled_from(["u0", "u1", "top"]))
        name = f"{unit}.p{i}" if unit != "top" else f"p{i}"
        tree[name] = torch.empty(shape, dtype=dtype)
        rules.append((name.replace(".", r"\."), P(*entries)))
    strategy = draw(st.integers(0, 3))
    compute = draw(st.sampled_from([None, torch.bfloat16]))
    return mesh, tree, rules, strategy, compute


def _nested(flat):
    out = {}
    for k, v in flat.items():
        parts = k.split(".")
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = v
    return out


def _simulate_gather(plan, values):
    """Every rank's shards from its local pieces, then each buffer gathered from its group's shards."""
    mesh = plan.mesh
    cpu = torch.device("cpu")
    for b in plan.buffers:
        ranks = mesh.group_of(0, b.axes) if b.layout != L.REPLICATED else (0,)
        shards = []
        for r in ranks:
            st_ = BufferState(plan, b, r, cpu)
            st_.fill_local([values[n] for n in b.params])
            shards.append(st_.shard.clone())
        probe = BufferState(plan, b, 0, cpu)
        probe.make_params()
        out = probe.gather_output()
        with torch.no_grad():
            out.copy_(torch.cat(shards).to(probe.cdtype) if b.layout != L.REPLICATED else shards[0].to(probe.cdtype))
        probe.finish_gather()
        for name, fp in ((m.name, m.full) for m in probe.members):
            yield name, fp.detach()


@pytest.mark.filterwarnings("ignore::shardplan.errors.PlanWarning")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_every_element_held_once_per_group_and_gather_reassembles(problem):
    mesh, flat, rules, strategy, compute = problem
    plan = sp.plan(_nested(flat), rules, mesh, strategy=strategy, units=[r"u\d"], compute_dtype=compute, min_unit_bytes=0)
    values = {}
    for name, t in flat.items():
        values[name] = (torch.arange(t.numel(), dtype=torch.float64) % 251 - 125).to(t.dtype).view(t.shape)
    for p in plan.params:
        b = plan.buffers[p.buffer]
        for group in mesh.groups(b.axes if b.layout != L.REPLICATED else ()):
            count = torch.zeros(p.shape, dtype=torch.int32)
            for r in group:
                box = plan.local_slices(p.name, r)
                if box is not None:
                    count[box] += 1
            assert bool((count == 1).all()), f"{p.name} {p.shape} {p.spec} on {mesh}: not owned exactly once"
        # replicas hold the same piece
        for r in range(mesh.size):
            twin = mesh.rank_of([0 if a not in b.axes else c for a, c in zip(mesh.axis_names, mesh.coords(r))])
            assert plan.local_slices(p.name, r) == plan.local_slices(p.name, twin)
    for name, gathered in _simulate_gather(plan, values):
        b = plan.buffers[plan.param(name).buffer]
        assert torch.equal(gathered, values[name].to(gathered.dtype)), f"{name}: gather(shard(x)) != x"


@pytest.mark.filterwarnings("ignore::shardplan.errors.PlanWarning")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_layout_aligned_disjoint_and_memory_is_sum_of_buffers(problem):
    mesh, flat, rules, strategy, compute = problem
    plan = sp.plan(_nested(flat), rules, mesh, strategy=strategy, units=[r"u\d"], compute_dtype=compute, min_unit_bytes=0)
    for b in plan.buffers:
        A = L.align_elems(itemsize(b.dtype), itemsize(b.compute_dtype))
        if b.layout != L.REPLICATED:
            assert b.shard_numel % A == 0, "segments must stay aligned"
        for rank in range(mesh.size):
            pieces = []
            for name in b.params:
                box = plan.local_slices(name, rank)
                if box is None:
                    continue
                n = math.prod(s.stop - s.start for s in box)
                off = plan.piece(name, rank).shard_offset
                assert 0 <= off and off + n <= b.shard_numel
                pieces.append((off, off + n))
            pieces.sort()
            assert all(a[1] <= b_[0] for a, b_ in zip(pieces, pieces[1:])), "pieces overlap"
    mem = plan.memory(0)
    if strategy_level(plan.strategy) == 3:
        assert mem.params == sum(b.shard_numel * itemsize(b.dtype) + (b.gathered_numel * itemsize(b.compute_dtype)
                                 if b.layout == L.REPLICATED and b.compute_dtype == b.dtype else 0)
                                 - (b.shard_numel * itemsize(b.dtype) if b.layout == L.REPLICATED and b.compute_dtype == b.dtype else 0)
                                 for b in plan.buffers)
        assert mem.grads == sum(b.shard_numel * itemsize(b.dtype) for b in plan.buffers if b.requires_grad
                                and not (b.layout == L.REPLICATED and b.compute_dtype == b.dtype == b.reduce_dtype)) + \
            sum(b.gathered_numel * itemsize(b.compute_dtype) for b in plan.buffers if b.requires_grad
                and b.layout == L.REPLICATED and b.compute_dtype == b.dtype == b.reduce_dtype)
    # AdamW's 2 states per element, in the parameter's own dtype (what a torch optimizer keeps): 8 bytes for fp32
    assert mem.optimizer == sum(math.prod(plan.local_shape(p.name, 0)) * 2 * itemsize(p.dtype)
                                for p in plan.params if p.requires_grad)
    assert mem.peak >= mem.params + mem.grads + mem.optimizer
    assert Plan_from(plan) == plan


def Plan_from(plan):
    return sp.Plan.from_json(plan.to_json())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(3))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x)
        for layer in reversed(self.layers):  # runs in the reverse of registration order
            h = layer(h)
        return self.head(h)


RULES = [(r".*bias", P()), (r".*", P("dp"))]
HSDP = [(r".*bias", P()), (r".*", P("shard"))]


def test_units_order_schedule_and_trace():
    net = Net()
    plan = sp.plan(net, RULES, Mesh(dp=4), units=[r"layers\.\d+"], prefetch=1, min_unit_bytes=0)
    assert [u.name for u in plan.units] == ["<root>", "layers.0", "layers.1", "layers.2"]
    assert plan.param("head.weight").name == "embed.weight" and plan.param("embed.weight").aliases == ("head.weight",)
    kinds = [(o.kind, o.unit, o.trigger, o.prefetch) for o in plan.schedule]
    # root first, then each unit with the next one prefetched; each gather is waited for where its unit computes
    assert kinds[:5] == [("all_gather", "<root>", "pre_forward(<root>)", False), ("wait", "<root>", "pre_forward(<root>)", False),
                         ("all_gather", "layers.0", "pre_forward(<root>)", True),
                         ("wait", "layers.0", "pre_forward(layers.0)", False),
                         ("all_gather", "layers.1", "pre_forward(layers.0)", True)]
    # every unit is freed after its forward, the last one too (FSDP2's default); torchtitan's choice keeps it
    assert ("free", "layers.2", "post_forward(layers.2)", False) in kinds
    assert plan.unit("layers.2").reshard_after_forward is True
    kept = plan.with_reshard_after_forward({"layers.2": False})
    # the same as an option of plan(), and what declarative() writes for mixed flags
    direct = sp.plan(net, RULES, Mesh(dp=4), units=[r"layers\.\d+"], prefetch=1, min_unit_bytes=0,
                     reshard_after_forward={"layers.2": False})
    assert direct.equivalent(kept) and sp.plan(net, **kept.declarative()).equivalent(kept)
    with pytest.raises(sp.errors.PlanError, match=r"names unit\(s\) \['layers.9'\]"):
        sp.plan(net, RULES, Mesh(dp=4), units=[r"layers\.\d+"], reshard_after_forward={"layers.9": False})
    assert ("free", "layers.2", "post_forward(layers.2)", False) not in [
        (o.kind, o.unit, o.trigger, o.prefetch) for o in kept.schedule]
    assert kept.memory().peak >= plan.memory().peak and kept.comm_bytes()["total"] < plan.comm_bytes()["total"]
    # the backward begins by preparing the root's gradient, then each unit's at its pre_backward
    assert kinds[[o.phase for o in plan.schedule].index("backward")][:3] == ("prepare", "<root>", "begin_backward")
    assert [k[1] for k in kinds if k[0] == "prepare"] == ["<root>", "layers.2", "layers.1", "layers.0"]
    bw = [k for k in kinds if plan.schedule[kinds.index(k)].phase == "backward" and k[0] not in ("free", "prepare")]
    # the last unit is gathered again at its pre_backward (after the root's backward, where the peak usually is)
    assert bw[0] == ("all_gather", "layers.2", "pre_backward(layers.2)", False)
    assert bw[1][:3] == ("wait", "layers.2", "pre_backward(layers.2)") and bw[2][:2] == ("all_gather", "layers.1") and bw[2][3]
    assert [k[1] for k in kinds if k[0] == "reduce_scatter"] == ["layers.2", "layers.1", "layers.0", "<root>"]
    # a unit's reduction waits for its gradients (post_backward), the previous one completes first
    assert [o.trigger for o in plan.schedule if o.kind == "reduce_scatter"][:2] == ["post_backward(layers.2)",
                                                                                    "post_backward(layers.1)"]
    assert [o.unit for o in plan.schedule if o.kind == "wait" and o.what == "grads"][0] == "layers.2"
    used = [(o.kind, o.trigger) for o in plan.schedule if o.what == "used"]
    assert used == [("all_reduce", "end_backward"), ("wait", "end_backward")] and plan.schedule[-1].kind == "free"
    with torch.device("meta"):
        meta_net = Net()
    traced = sp.plan(meta_net, RULES, Mesh(dp=4), units=[r"layers\.\d+"],
                     trace=((torch.zeros(2, 3, dtype=torch.long, device="meta"),), {}), min_unit_bytes=0)
    assert [u.name for u in traced.units] == ["<root>", "layers.2", "layers.1", "layers.0"]
    deep = sp.plan(net, RULES, Mesh(dp=4), units=[r"layers\.\d+"], prefetch=2, reshard_after_forward=False, min_unit_bytes=0)
    assert not any(o.kind == "free" and o.phase == "forward" for o in deep.ops())
    assert sum(o.prefetch for o in deep.schedule if o.phase == "forward") == 3


def test_strategies_change_what_is_sharded():
    net = Net()
    mems = {s: sp.plan(net, RULES, Mesh(dp=4), strategy=s, units=[r"layers\.\d+"], min_unit_bytes=0).memory() for s in range(4)}
    assert mems[1].params > 3 * mems[3].params and mems[0].params > 3 * mems[3].params  # only ZeRO-3 shards params
    assert mems[1].grads > mems[2].grads == mems[3].grads
    assert mems[0].optimizer > mems[1].optimizer == mems[3].optimizer
    z0 = sp.plan(net, RULES, Mesh(dp=4), strategy="no_shard", units=[r"layers\.\d+"], min_unit_bytes=0)
    assert {o.kind for o in z0.schedule if o.is_collective} == {"all_reduce"}
    assert z0.local_slices("embed.weight", 3) == (slice(0, 50), slice(0, 16))
    z1 = sp.plan(net, RULES, Mesh(dp=4), strategy="optim", units=[r"layers\.\d+"], min_unit_bytes=0)
    assert {(o.kind, o.phase, o.when) for o in z1.schedule if o.is_collective} == {
        ("all_gather", "step", "stale"), ("reduce_scatter", "backward", "sync"), ("all_reduce", "backward", "sync")}
    hsdp = sp.plan(net, [(r".*bias", P()), (r".*", P("shard"))], Mesh(replica=2, shard=2), units=[r"layers\.\d+"], min_unit_bytes=0)
    rs = [o for o in hsdp.schedule if o.kind == "reduce_scatter"]
    ar = [o for o in hsdp.schedule if o.kind == "all_reduce"]
    assert all(o.axes == ("shard",) for o in rs) and any(o.axes == ("replica",) for o in ar)
    with pytest.raises(sp.errors.PlanError, match="unknown strategy"):
        sp.plan(net, RULES, Mesh(dp=4), strategy="zero9")


def test_mixed_precision_bytes_and_copy_out():
    net = Net()
    p32 = sp.plan(net, RULES, Mesh(dp=4), units=[r"layers\.\d+"], min_unit_bytes=0)
    p16 = sp.plan(net, RULES, Mesh(dp=4), units=[r"layers\.\d+"], compute_dtype=torch.bfloat16, reduce_dtype=torch.float32, min_unit_bytes=0)
    ag = lambda p: sum(o.bytes for o in p.ops() if o.kind == "all_gather")
    assert ag(p16) * 2 == ag(p32) or ag(p16) < ag(p32)
    assert p16.buffers[0].reduce_dtype == "float32" and p16.buffers[0].compute_dtype == "bfloat16"
    col = sp.plan(net, [(r".*bias", P()), (r"layers\.0\.0\.weight", P(None, "dp")), (r".*", P("dp"))], Mesh(dp=4),
                  units=[r"layers\.\d+"], min_unit_bytes=0)
    assert any(b.copy_out for b in col.buffers) and any("copy-out" in w for w in col.warnings)
    assert col.local_slices("layers.0.0.weight", 2) == (slice(0, 32), slice(8, 12))


@pytest.mark.slow
def test_json_fingerprint_stable_across_processes():
    plan = sp.plan(Net(), HSDP, Mesh(replica=2, shard=2), units=[r"layers\.\d+"], min_unit_bytes=0)
    assert sp.Plan.from_json(plan.to_json()) == plan
    code = ("import sys; sys.path.insert(0, 'tests'); import test_plan as t, shardplan as sp; "
            "print(sp.plan(t.Net(), t.HSDP, sp.Mesh(replica=2, shard=2), units=[r'layers\\.\\d+'], min_unit_bytes=0).fingerprint())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=".")
    assert out.stdout.strip() == plan.fingerprint()
    text = str(plan)
    for needle in ("parameter", "local shape", "bytes/rank", "memory on rank 0", "sent per step", "<root>"):
        assert needle in text


def test_plan_errors_name_the_fix():
    with pytest.raises(sp.errors.MeshError, match="world size is 8"):
        sp.plan(Net(), RULES, Mesh(dp=4), world_size=8)
    with pytest.raises(sp.errors.SpecError, match="embed.weight"):
        sp.plan(Net(), [(r".*", P("tp"))], Mesh(dp=4))
    with pytest.raises(sp.errors.RuleError, match="unit rule"):
        sp.plan(Net(), RULES, Mesh(dp=4), units=[r"layers\.(\d"])
    with pytest.warns(sp.errors.PlanWarning, match="matches no module"):
        sp.plan(Net(), RULES, Mesh(dp=4), units=[r"blocks\.\d+"])
    with pytest.raises(sp.errors.UnmatchedParametersError, match="layers.0.0.weight"):
        sp.plan(Net(), [(r".*bias", P())], Mesh(dp=4))
    with pytest.raises(sp.errors.PlanError, match="prefetch"):
        sp.plan(Net(), RULES, Mesh(dp=4), prefetch=-1)
    uneven = sp.plan({"w": torch.empty(3, 5)}, [(r".*", P(None, "dp"))], Mesh(dp=8))
    assert any("held by only some ranks" in w for w in uneven.warnings)
    assert uneven.local_slices("w", 7) is None


def test_70b_plans_in_a_fraction_of_a_second():
    import time
    sys.path.insert(0, "examples")
    import gpt
    from gpt_rules import UNITS, rules
    with torch.device("meta"):
        model = gpt.llama_70b()
    t = time.perf_counter()
    plan = sp.plan(model, rules, Mesh(dp=1024), units=UNITS, compute_dtype=torch.bfloat16)
    assert time.perf_counter() - t < 5  # the benchmark holds the real target (< 1 s); CI machines vary
    assert len(plan.units) == 81 and plan.memory().params < 2 ** 30


def test_chrome_trace_lists_every_op(tmp_path):
    import json
    plan = sp.plan(Net(), RULES, Mesh(dp=4), units=[r"layers\.\d+"], min_unit_bytes=0)
    path = tmp_path / "plan.json"
    plan.to_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [e["args"]["index"] for e in events] == list(range(len(plan.schedule)))
    assert all(e["dur"] > 0 for e in events) and events[0]["name"] == "all_gather <root>"
    assert events[1]["args"]["trigger"] == "pre_forward(<root>)"


def test_min_unit_bytes_merges_neighbours():
    net = Net()
    each = sum(p.numel() * 4 for p in net.layers[0].parameters())
    plan = sp.plan(net, RULES, Mesh(dp=4), units=[r"layers\.\d+"], min_unit_bytes=2 * each)
    assert [u.name for u in plan.units] == ["<root>", "layers.0..layers.1", "layers.2"]
    assert plan.unit("layers.0..layers.1").module_paths == ("layers.0", "layers.1")
    assert plan.param("layers.1.0.weight").unit == "layers.0..layers.1"
    assert sp.Plan.from_json(plan.to_json()) == plan
    plain = sp.plan(net, RULES, Mesh(dp=4), units=[r"layers\.\d+"], min_unit_bytes=0)
    count = lambda p: sum(o.kind == "all_gather" for o in p.ops())
    assert count(plan) < count(plain)
    # three tiny blocks: merging would leave fewer than auto.MIN_MERGED_UNITS units to overlap, so kept, and said so
    few = sp.plan(net, RULES, Mesh(dp=4), units=[r"layers\.\d+"])
    assert count(few) == count(plain) and few.min_unit_bytes == 0 and "automatic" in few.notes[0]
    assert "fewer than 8 units" in few.notes[0] and "planner's choices" in str(few)
    deep = nn.Sequential(*[nn.Linear(16, 16) for _ in range(40)])  # forty tiny blocks: merged, at least 8 units left
    auto = sp.plan(deep, RULES, Mesh(dp=4), units=[r"\d+"])
    assert auto.min_unit_bytes > 0 and "automatic" in auto.notes[0] and "merged 40 blocks into 8 units" in auto.notes[0]
    assert len(auto.units) - 1 == 8, auto.notes


def test_transformations_rebuild_the_schedule():
    plan = sp.plan(Net(), RULES, Mesh(dp=4), units=[r"layers\.\d+"], prefetch=1, min_unit_bytes=0)
    assert plan.with_prefetch(2).prefetch == 2 and sum(o.prefetch for o in plan.with_prefetch(0).schedule) == 0
    kept = plan.with_reshard_after_forward({"layers.0": False})
    assert not any(o.kind == "free" and o.unit == "layers.0" and o.event == "post_forward" for o in kept.ops())
    assert kept.unit("layers.0").reshard_after_forward is False and kept.unit("layers.1").reshard_after_forward
    dyn = plan.with_order("dynamic")
    assert all(o.event in ("begin_backward", "end_backward", "pre_backward") for o in dyn.ops() if o.phase == "backward")
    assert sp.Plan.from_json(dyn.to_json()) == dyn
    with pytest.raises(sp.errors.PlanError, match="no unit 'layers.9'"):
        plan.with_reshard_after_forward({"layers.9": False})


def test_invalid_edited_schedules_name_the_op():
    plan = sp.plan(Net(), RULES, Mesh(dp=4), units=[r"layers\.\d+"], prefetch=1, min_unit_bytes=0)
    ops = list(plan.schedule)
    first = lambda pred: next(i for i, o in enumerate(ops) if pred(o))
    ag1 = first(lambda o: o.kind == "all_gather" and o.unit == "layers.1" and o.event == "pre_forward")
    free0 = first(lambda o: o.kind == "free" and o.unit == "layers.0" and o.event == "post_forward")
    rs2 = first(lambda o: o.kind == "reduce_scatter" and o.unit == "layers.2")
    wait2 = first(lambda o: o.kind == "wait" and o.what == "grads" and o.unit == "layers.2")
    wait0 = first(lambda o: o.kind == "wait" and o.unit == "layers.0" and o.event == "pre_forward")
    root_bufs = plan.unit("<root>").buffers  # the root computes from the first forward to the end of backward
    early_free = ops[:free0 + 1] + [sp.planner.Op(kind="free", unit="<root>", what="params", event="post_forward", at="layers.0", buffers=root_bufs)] + ops[free0 + 1:]
    bad = {
        "before their gather": [o for i, o in enumerate(ops) if i != ag1],
        "still computes": early_free,
        "never issued": [o for i, o in enumerate(ops) if i != rs2],
        "unreduced": [o for i, o in enumerate(ops) if i not in (rs2, wait2, wait2 + 1)],
        "never happens": ops[:3] + [sp.planner.Op(kind="wait", unit="layers.0", what="params", event="pre_forward", at="nope")] + ops[3:],
        "trigger order": [ops[wait0]] + [o for i, o in enumerate(ops) if i != wait0],
        "runs over axes": [sp.planner.Op(kind=o.kind, unit=o.unit, what=o.what, event=o.event, at=o.at, buffers=o.buffers, axes=("x",),
                                 bytes=o.bytes) if i == rs2 else o
                           for i, o in enumerate(ops)],
    }
    for needle, edited in bad.items():
        with pytest.raises(sp.errors.PlanError, match=needle) as err:
            plan.with_schedule(edited)
        assert "schedule op #" in str(err.value) or "unit" in str(err.value), str(err.value)
    assert plan.with_schedule(ops) == plan  # the builder's own schedule is valid


# -- pieces: one geometry, the same answers as the formulas they replaced ------------------------------------

def _old_storage_slices(plan, name, rank):
    """The formula of a piece's storage box before pieces (kept here as the reference)."""
    p = plan.param(name)
    b = plan.buffers[p.buffer]
    full = tuple(slice(0, d) for d in p.shape)
    if not b.sharded or p.numel == 0:
        return full
    seg = plan.mesh.axis_index(rank, b.axes)
    if b.layout == L.CONTIGUOUS:
        r0, r1 = L.contiguous_rows(p.offset, p.numel, p.row, b.shard_numel, seg)
        return None if r1 <= r0 else (slice(r0, r1),) + full[1:]
    box = []
    for d, size in enumerate(p.shape):
        axes = p.storage_spec.dim_axes(d)
        parts = plan.mesh.axis_size(axes) if axes else 1
        s, e = L.chunk_range(size, parts, plan.mesh.axis_index(rank, axes)) if axes else (0, size)
        if e <= s:
            return None
        box.append(slice(s, e))
    return tuple(box)


def _old_local_slices(plan, name, rank):
    box, p = _old_storage_slices(plan, name, rank), plan.param(name)
    if box is None or p.tp_dim < 0:
        return box
    start = plan.mesh.axis_index(rank, (p.tp_axis,)) * p.shape[p.tp_dim]
    s = box[p.tp_dim]
    return box[:p.tp_dim] + (slice(start + s.start, start + s.stop),) + box[p.tp_dim + 1:]


def _old_local_offset(plan, name, rank):
    p = plan.param(name)
    b = plan.buffers[p.buffer]
    if b.layout == L.CONTIGUOUS:
        seg = plan.mesh.axis_index(rank, b.axes)
        return max(p.offset, seg * b.shard_numel) - seg * b.shard_numel
    return p.offset


def _check_pieces(plan):
    for r in range(plan.mesh.size):
        pieces = plan.pieces(r)
        assert [q.param for q in pieces] == [p.name for p in plan.params]
        for i, (p, q) in enumerate(zip(plan.params, pieces)):
            storage = _old_storage_slices(plan, p.name, r)
            shape = tuple(s.stop - s.start for s in storage) if storage is not None else \
                ((0,) + tuple(p.shape[1:]) if p.shape else (0,))
            assert (q.index, q.buffer, q.rank) == (i, p.buffer, r)
            assert q.storage_box == storage and q.box == _old_local_slices(plan, p.name, r)
            assert q.shape == shape and q.numel == math.prod(shape)
            assert q.shard_offset == _old_local_offset(plan, p.name, r)
            assert plan.piece(p.name, r) == q and plan.local_slices(p.name, r) == q.box
            assert plan.local_shape(p.name, r) == q.shape
    for b in plan.buffers:  # full_offset: the offsets the runtime lays the full parameters out at
        state = BufferState(plan, b, 0, torch.device("cpu"))
        assert [q.full_offset for q in plan.buffer_pieces(b.index, 0)] == [m.piece.full_offset for m in state.members]
    for p in plan.params:  # every element of the whole tensor is held by exactly replicas(name) ranks
        count = torch.zeros(p.global_shape, dtype=torch.int32)
        for r in range(plan.mesh.size):
            box = plan.piece(p.name, r).box
            if box is not None:
                count[box] += 1
        assert bool((count == replicas(plan, p.name)).all()), f"{p.name} {p.global_shape} {p.spec} on {plan.mesh}"


@pytest.mark.filterwarnings("ignore::shardplan.errors.PlanWarning")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(["auto", "chunked"]))
def test_pieces_agree_with_the_old_formulas_and_cover_every_element(problem, layout):
    mesh, flat, rules, strategy, compute = problem
    plan = sp.plan(_nested(flat), rules, mesh, strategy=strategy, units=[r"u\d"], compute_dtype=compute,
                   min_unit_bytes=0, layout=layout)
    _check_pieces(plan)


def test_pieces_under_tensor_parallelism_and_their_cache():
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent.parent / "examples"))
    import gpt
    import gpt_rules_tp
    model = gpt.build("tiny", tie_embeddings=False)
    for strategy in ("optim", "optim_grads_params"):
        plan = sp.plan(model, gpt_rules_tp.rules, Mesh(dp=2, tp=2), compute_axes=("tp",), units=gpt_rules_tp.UNITS,
                       min_unit_bytes=0, strategy=strategy)
        _check_pieces(plan)
    assert plan.pieces(1) is plan.pieces(1)                       # computed once per rank
    with pytest.raises(sp.errors.PlanError, match="not a rank"):
        plan.pieces(4)
    with pytest.raises(sp.errors.PlanError, match="no parameter"):
        plan.piece("nope", 0)
    name = plan.params[3].name
    assert name in plan and "nope" not in plan and plan.param(name).name == name


def test_pieces_stay_lazy_on_a_70b_plan():
    """Building a 70B plan at dp=1024 computes no piece; one piece is O(1), one rank's O(params)."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent.parent / "examples"))
    import gpt
    from gpt_rules import UNITS, rules
    with torch.device("meta"):
        model = gpt.llama_70b()
    plan = sp.plan(model, rules, Mesh(dp=1024), units=UNITS, compute_dtype=torch.bfloat16)
    assert "_piece_cache" not in plan.__dict__
    q = plan.piece(plan.params[5].name, 777)
    assert q.box == _old_local_slices(plan, q.param, 777) and not plan.__dict__["_piece_cache"]
    assert len(plan.pieces(777)) == len(plan.params)


# -- values, not strings ------------------------------------------------------------------------------------

def test_vocabularies_are_enums_whose_members_are_the_old_strings():
    from shardplan.planner import schedule as S
    plan = sp.plan(Net(), RULES, Mesh(dp=4), units=[r"layers\.\d+"], strategy="optim", order="dynamic", min_unit_bytes=0)
    from shardplan.planner import OpKind, Order, Strategy, Subject
    assert plan.strategy is Strategy.OPTIM and plan.order is Order.DYNAMIC and plan.strategy == "optim"
    assert S.ALL_GATHER is OpKind.ALL_GATHER and S.ALL_GATHER == "all_gather" and S.GRADS is Subject.GRADS
    assert all(isinstance(o.kind, OpKind) and isinstance(o.what, Subject) for o in plan.schedule)
    assert f"{plan.strategy}" == str(plan.strategy) == "optim" and repr(plan.order) == "'dynamic'"
    assert '"strategy": "optim"' in plan.to_json() and "strategy='optim'" in plan.to_source()
    back = sp.Plan.from_json(plan.to_json())
    assert back == plan and back.strategy is Strategy.OPTIM and isinstance(back.schedule[0].kind, OpKind)
    for option, bad, choices in (("strategy", "zero9", "optim_grads_params"), ("order", "sideways", "'static', 'dynamic'"),
                                 ("layout", "diagonal", "'auto', 'chunked'")):
        with pytest.raises(sp.errors.PlanError, match=choices):
            sp.plan(Net(), RULES, Mesh(dp=4), **{option: bad})
    with pytest.raises(sp.errors.PlanError, match="order must be one of"):
        plan.with_order("sideways")
    with pytest.raises(TypeError):
        sp.planner.Op("wait", "layers.0", "params", "pre_forward")        # keyword-only
    ops = list(plan.schedule)
    ops[0] = dataclasses.replace(ops[0], kind="all_scatter")
    with pytest.raises(sp.errors.PlanError, match=r"schedule op #0 .*unknown kind 'all_scatter'; use one of \('all_gather'"):
        plan.with_schedule(ops)
    as_strings = [dataclasses.replace(o, kind=str(o.kind.value), when=str(o.when.value)) for o in plan.schedule]
    edited = plan.with_schedule(as_strings)                       # strings accepted, stored as members
    assert edited == plan and all(isinstance(o.kind, OpKind) for o in edited.schedule)
    assert plan.param("layers.0.0.weight").compute is None and plan.param("layers.0.0.weight").tp_dim == -1


# -- every with_* composes with an edited schedule ----------------------------------------------------------

def test_with_transformations_refuse_to_drop_an_edited_schedule():
    plan = sp.plan(Net(), RULES, Mesh(dp=4), units=[r"layers\.\d+"], prefetch=1, min_unit_bytes=0)
    assert not schedule_edited(plan)

    def gather_late(ops):  # unit layers.1 gathered where it computes instead of being prefetched
        ops = list(ops)
        moved = ops.pop(next(i for i, o in enumerate(ops) if o.kind == "all_gather" and o.unit == "layers.1"
                             and o.event == "pre_forward"))
        w = next(i for i, o in enumerate(ops) if o.kind == "wait" and o.unit == "layers.1" and o.event == "pre_forward")
        return ops[:w] + [dataclasses.replace(moved, at="layers.1", prefetch=False)] + ops[w:]

    keep = gather_late(plan.schedule)
    edited = plan.with_schedule(keep)
    assert schedule_edited(edited) and edited.schedule == tuple(keep)
    for how, call in (("with_prefetch", lambda p: p.with_prefetch(2)),
                      ("with_order", lambda p: p.with_order("dynamic")),
                      ("with_reshard_after_forward", lambda p: p.with_reshard_after_forward({"layers.1": False}))):
        with pytest.raises(sp.errors.PlanError, match=f"{how}: this plan's schedule was edited"):
            call(edited)
        rebuilt = call(plan)                                      # the documented order: transform, then edit
        assert not schedule_edited(rebuilt)
    assert edited.with_prefetch(1) is edited and edited.with_order("static") is edited   # no-ops keep the edit
    two = plan.with_prefetch(2)
    again = two.with_schedule(gather_late(two.schedule))
    assert again.prefetch == 2 and schedule_edited(again)
    assert schedule_edited(sp.Plan.from_json(edited.to_json()))   # the edit survives JSON, and so does the refusal
