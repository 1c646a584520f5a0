"""Mesh, P, Rules, match and explain: semantics and error messages."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
import torch.nn as nn

import shardplan as sp
from shardplan import Mesh, P, Rules


def test_mesh_row_major_and_groups():
    m = Mesh(replica=2, shard=4)
    assert (m.size, m.axis_names, m.shape) == (8, ("replica", "shard"), {"replica": 2, "shard": 4})
    assert [m.coords(r) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert all(m.rank_of(m.coords(r)) == r for r in range(8))
    assert m.rank_of(replica=1, shard=2) == 6
    assert m.groups(["shard"]) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert m.groups(["replica"]) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert m.group_of(5, ["replica"]) == (1, 5)
    assert m.axis_index(6, ("shard", "replica")) == 2 * 2 + 1
    assert Mesh.parse("replica=2,shard=4") == m
    with pytest.raises(sp.errors.MeshError, match="positive"):
        Mesh(dp=0)
    with pytest.raises(sp.errors.MeshError, match="name=size"):
        Mesh.parse("dp8")


def test_mesh_from_device_mesh():
    class FakeDM:  # the two attributes Mesh reads; building a real DeviceMesh needs a process group
        mesh_dim_names = ("replica", "shard")
        mesh = torch.arange(8).view(2, 4)
    assert Mesh.from_device_mesh(FakeDM()) == Mesh(replica=2, shard=4)


def test_spec_semantics():
    assert P("dp", None) == P("dp") and hash(P("dp", None)) == hash(P("dp"))
    assert P(("a", "b"), None, "c").axes == ("a", "b", "c")
    assert P().axes == () and P(None, None) == P()
    assert P.parse("(replica shard) _") == P(("replica", "shard"))
    assert P.parse("_ dp") == P(None, "dp")
    assert P.parse(P(("a", "b"), "c").to_einops()) == P(("a", "b"), "c")
    assert repr(P("dp", None)) == "P('dp')"
    with pytest.raises(sp.errors.SpecError, match="twice"):
        P("dp", "dp")
    with pytest.raises(sp.errors.SpecError, match="twice"):
        P(("a", "b"), "a")
    with pytest.raises(sp.errors.SpecError, match="cannot parse"):
        P.parse("(a b")


def _tree():
    Point = collections.namedtuple("Point", "x y")
    return {"embed": {"weight": torch.zeros(8, 4)}, "layers": [{"w": torch.zeros(4, 4), "b": torch.zeros(4)},
                                                               {"w": torch.zeros(4, 4), "b": torch.zeros(4)}],
            "pt": Point(torch.zeros(2), torch.zeros(3, 3))}


def test_match_pytree_first_match_wins_and_is_pure():
    tree = _tree()
    before = {k: id(v) for k, v in tree["embed"].items()}
    rules = Rules([(r"embed\.weight", P("dp", None)), (r"layers\.\d+\.b", P()), (r"layers\.\d+\..*", P(None, "dp")),
                   (r".*", "dp")])
    specs = sp.match(rules, tree)
    assert specs["embed"]["weight"] == P("dp")
    assert specs["layers"][0]["b"] == P() and specs["layers"][1]["w"] == P(None, "dp")
    assert specs["pt"].x == P("dp") and type(specs["pt"]).__name__ == "Point"
    assert sp.match(rules, tree) == specs
    assert {k: id(v) for k, v in tree["embed"].items()} == before


def test_match_module_callable_and_logical_axes():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    rules = Rules([(r"0\.weight", lambda path, leaf: P("dp") if leaf.shape[0] % 2 == 0 else P()),
                   (r".*", P("embed"))], axis_rules=[("embed", None)])
    specs = sp.match(rules, model)
    assert specs == {"0.weight": P("dp"), "0.bias": P(), "1.weight": P(), "1.bias": P()}
    logical = Rules([(r".*weight", P("mlp")), (r".*", P())], axis_rules=[("mlp", ("replica", "shard"))])
    assert sp.match(logical, model)["0.weight"] == P(("replica", "shard"))


def test_unmatched_lists_every_leaf_and_unused_rules_warn():
    with pytest.raises(sp.errors.UnmatchedParametersError) as info:
        sp.match([(r"embed\..*", P())], _tree())
    assert set(info.value.names) == {"layers.0.w", "layers.0.b", "layers.1.w", "layers.1.b", "pt.x", "pt.y"}
    assert "layers.1.b" in str(info.value) and "(r'.*', P())" in str(info.value)
    with pytest.warns(sp.errors.UnusedRuleWarning, match="nothing_here"):
        sp.match([(r"nothing_here", P()), (r".*", P())], _tree())


def test_rule_errors_name_parameter_shape_and_rule():
    with pytest.raises(sp.errors.RuleError, match=r"rule #1.*invalid regex"):
        Rules([(r".*", P()), (r"layers\.(\d+", P())])
    with pytest.raises(sp.errors.SpecError) as info:
        sp.match([(r".*", P(None, None, "dp"))], {"w": torch.zeros(4, 4)})
    assert "'w'" in str(info.value) and "(4, 4)" in str(info.value) and "#0" in str(info.value)
    with pytest.raises(sp.errors.SpecError) as info:
        sp.match([(r".*", P("tp"))], {"w": torch.zeros(4, 4)}, mesh=Mesh(dp=2))
    assert "'tp'" in str(info.value) and "'w'" in str(info.value) and "('dp',)" in str(info.value)
    with pytest.raises(sp.errors.RuleError, match="not a"):
        Rules([("x",)])


def test_explain_says_why():
    rules = [(r"embed\.weight", P()), (r"layers", P()), (r".*", P("dp"))]
    text = sp.explain(rules, "layers.0.w")
    assert "no part of the path matches" in text
    assert "re.search finds 'layers'" in text and "fullmatch" in text
    assert "#2" in text and "MATCHES" in text
    assert "no rule matches" in sp.explain([(r"x", P())], "y")


def test_match_speed_path_is_correct_with_groups():
    # user groups inside patterns must not confuse the combined matcher
    rules = Rules([(r"(?P<name>a)\.(\d+)", P()), (r"(a|b)\.x", P("dp")), (r".*", P(None, "dp"))])
    assert rules.find("a.3").index == 0 and rules.find("b.x").index == 1 and rules.find("c").index == 2
    back = Rules([(r"(a)\1", P()), (r".*", P("dp"))])  # backreference: falls back to one regex per rule
    assert back.find("aa").index == 0 and back.find("ab").index == 1


def test_specs_survive_pickle_and_copy():
    import copy
    import pickle
    for spec in (sp.P(), sp.P("dp"), sp.P(("dp", "ep")), sp.P(None, ("tp", "dp"), "cp")):
        assert pickle.loads(pickle.dumps(spec)) == spec
        assert copy.deepcopy(spec) == spec
