"""The runtime's parts keep their jobs: faces implement the Face protocol, the executor reaches the
schedule only through its cursor, and collectives only through the comm engine."""

from __future__ import annotations

import ast
import inspect
import pathlib

from shardplan.plan.schedule import PRE_FORWARD
from shardplan.runtime import executor, faces
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
    found = _calls(pathlib.Path(executor.__file__), {"all_gather", "reduce_scatter", "all_reduce", "broadcast"})
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
