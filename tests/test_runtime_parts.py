"""The runtime's parts keep their jobs: faces implement the Face protocol, the executor reaches the
schedule only through its cursor, and collectives only through the comm engine."""

from __future__ import annotations

import ast
import inspect
import pathlib

from shardplan.planner.schedule import PRE_FORWARD
from shardplan.runtime import executor, faces, handlers, local_shards
from shardplan.runtime.cursor import Cursor, Facts

import shardplan as sp
from models import Toy, toy_rules

SRC = pathlib.Path(sp.__file__).parent


def _methods(cls) -> set[str]:
    return {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}


def test_faces_implement_the_protocol():
    wanted = _methods(faces.Face)
    assert wanted >= {"bind", "unbind", "deliver", "gather_input", "reduce_output"}
    for face in (faces.ModuleFace, faces.TreeFace):
        missing = {m for m in wanted if not callable(getattr(face, m, None))}
        assert not missing, (face.__name__, missing)
        assert isinstance(getattr(face, "stale_after_sync"), bool)
        for m in wanted:  # same parameters as the protocol's
            assert list(inspect.signature(getattr(face, m)).parameters) == \
                list(inspect.signature(getattr(faces.Face, m)).parameters), (face.__name__, m)


def test_cursor_walks_the_program_once_per_step():
    plan = sp.plan(Toy(), toy_rules(), sp.Mesh(dp=4), units=[r"blocks\.\d+"], min_unit_bytes=0)
    cur = Cursor(plan)
    k = cur.forward_index[(PRE_FORWARD, "blocks.1")]
    first = [s.name for s in cur.forward_to(k)]
    assert first[-1] == "pre_forward(blocks.1)" and cur.mid_forward
    assert list(cur.forward_to(k)) == []  # already run: nothing is handed out twice
    facts = Facts(stale=False, grad=True, sync=True)
    ops = [cur.ops_of(s, facts) for s in plan.program.canonical()]
    assert sum(map(len, ops)) == len(plan.ops(stale=False, grad=True, sync=True))
    cur.reset()
    assert cur.fwd == cur.bwd == 0 and not cur.mid_forward


def _calls(path: pathlib.Path, names: set[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names:
            base = node.func.value
            if isinstance(base, ast.Name) and base.id in ("C", "dist"):
                out.append(f"{path.name}:{node.lineno} {base.id}.{node.func.attr}")
    return out


def test_the_executor_issues_collectives_only_through_the_comm_engine():
    """executor.py and its mixins' modules (the op handlers, the local shards)."""
    found = [c for mod in (executor, handlers, local_shards)
             for c in _calls(pathlib.Path(mod.__file__), {"all_gather", "reduce_scatter", "all_reduce", "broadcast"})]
    assert not found, found


COLLECTIVE_CALLS = {"all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "reduce_scatter",
                    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "broadcast_object_list",
                    "all_gather_object", "all_to_all", "all_to_all_single", "barrier", "send", "recv", "isend",
                    "irecv", "gather", "scatter", "reduce"}


def test_every_torch_distributed_collective_lives_in_collectives_py():
    """``dist.<collective>(...)`` (or ``torch.distributed.<collective>``) appears in runtime/collectives.py only."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "collectives.py" and path.parent.name == "runtime":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in COLLECTIVE_CALLS:
                continue
            base = node.func.value
            name = ast.unparse(base)
            if name in ("dist", "torch.distributed", "_dist", "c10d"):
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {name}.{node.func.attr}")
    assert not found, "collectives outside runtime/collectives.py:\n" + "\n".join(found)


def test_landing_in_one_call_equals_landing_through_views():
    """[Note: landing in one call] a unit whose parameters tile its flat gradient lands every gradient with
    one _chunk_cat; the result must equal the per-parameter path (some gradients missing, zeros for them),
    and accumulating into it afterwards must go through views over the new flat tensor."""
    import torch
    from shardplan.runtime.buffers import BufferState

    plan = sp.plan(Toy(), toy_rules(), sp.Mesh(dp=4), units=[r"blocks\.\d+"], min_unit_bytes=0)
    tiled = [b for b in plan.buffers if b.requires_grad and
             BufferState(plan, b, 0, torch.device("cpu")).tiled and len(plan.buffer_pieces(b.index, 0)) > 1]
    assert tiled, "the toy plan should have a buffer of several parameters without padding"
    b = BufferState(plan, tiled[0], 0, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(m.info.shape, generator=g) for m in b.members]
    expect = torch.zeros(b.bp.grad_numel)
    for m, t in zip(b.members, grads):
        expect[m.whole] = t.reshape(-1)
    b.land_grads(0, list(enumerate(grads)))  # every member: one call
    assert torch.equal(b.flat, expect)
    b.land_grads(0, [(0, grads[0])])  # the same window again: added through the views of this flat tensor
    expect[b.members[0].whole] += grads[0].reshape(-1)
    assert torch.equal(b.flat, expect)
    b.lent = True  # the local gradients kept that flat tensor: the next window lands in a new one
    old = b.flat
    b.land_grads(1, [(1, grads[1])])  # one member only: the others' pieces are zeros
    part = torch.zeros(b.bp.grad_numel)
    part[b.members[1].whole] = grads[1].reshape(-1)
    assert torch.equal(b.flat, part)
    assert b.flat is not old and torch.equal(old, expect)  # the lent tensor was left alone


def test_a_gradient_of_another_size_is_refused_not_landed():
    """The one-call landing must not write a gradient whose size differs from its parameter's (an ``out=``
    of the wrong size is resized, not refused): the per-view path's copy refuses it."""
    import pytest
    import torch
    from shardplan.runtime.buffers import BufferState

    plan = sp.plan(Toy(), toy_rules(), sp.Mesh(dp=4), units=[r"blocks\.\d+"], min_unit_bytes=0)
    b = next(s for s in (BufferState(plan, bp, 0, torch.device("cpu")) for bp in plan.buffers if bp.requires_grad)
             if s.tiled and len(s.members) > 1)
    grads = [torch.ones(m.info.shape) for m in b.members]
    grads[-1] = torch.ones(grads[-1].numel() + 1)
    with pytest.raises(RuntimeError):
        b.land_grads(0, list(enumerate(grads)))


def test_a_scalar_parameter_lands_through_its_view():
    """_chunk_cat refuses a 0-d tensor (in a backward hook the error took the process down): a buffer holding
    a scalar parameter (a learnt temperature) is not landed in one call, and its gradients are right."""
    import torch
    import torch.nn as nn
    from shardplan.runtime.buffers import BufferState

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.temp = nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return self.fc(x) * self.temp

    plan = sp.plan(Scaled(), [(r"temp", sp.P()), (r".*", sp.P("dp"))], sp.Mesh(dp=2), min_unit_bytes=0)
    states = [BufferState(plan, bp, 0, torch.device("cpu")) for bp in plan.buffers if bp.requires_grad]
    b = next(s for s in states if any(m.info.shape == () for m in s.members))
    assert not b.tiled
    grads = [torch.full(m.info.shape, float(i + 1)) for i, m in enumerate(b.members)]
    b.land_grads(0, list(enumerate(grads)))
    for m, g in zip(b.members, grads):
        assert torch.equal(b.flat[m.whole], g.reshape(-1))
