"""The options grouped by feature (``sp.Precision``, ``sp.Offload``, ``sp.Schedule``, ``sp.Layout``): the same
plans as the flat keywords, byte for byte; one field set both ways refused; ``plan.policies``; plans saved
before the grouping load; ``offload_fraction="auto"`` chooses what it chose before (tests/policy_cases.py)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import shardplan as sp
from shardplan.planner.policies import Policies

import policy_cases as pc

FIXTURE = json.loads(pc.FIXTURE.read_text())


# -- plans saved before the grouping --------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(pc.CASES))
def test_plans_saved_before_load_and_are_made_the_same(name):
    saved = FIXTURE["cases"][name]
    old = sp.Plan.from_json(saved["json"])
    assert old.to_json() == saved["json"] and old.fingerprint() == saved["fingerprint"]
    new = pc.make(name)
    assert old.policies == new.policies
    # the planner writes today what it wrote then (if a change of the planner means to change it, regenerate the
    # fixture on purpose: PYTHONPATH=src python3 tests/policy_cases.py)
    assert new.to_json() == saved["json"], f"{name}: the plan's JSON changed"


@pytest.mark.parametrize("model,strategy,what,budget,fraction,fingerprint", FIXTURE["auto"],
                         ids=[f"{m}-{s}-{w}-{b}" for m, s, w, b, _, _ in FIXTURE["auto"]])
def test_auto_fraction_chooses_what_it_chose_before(model, strategy, what, budget, fraction, fingerprint):
    if fraction is None:
        with pytest.raises(sp.PlanError, match="even offloading every buffer"):
            pc.make_auto(model, strategy, what, budget)
        return
    p = pc.make_auto(model, strategy, what, budget)
    assert (p.offload_fraction, p.fingerprint()) == (fraction, fingerprint)
    assert p.policies.offload == sp.Offload(what, fraction=fraction)
    grouped = pc.make_auto(model, strategy, what, budget,
                           offload=sp.Offload(what, fraction="auto", device_memory=budget))
    assert grouped.to_json() == p.to_json()


# -- grouped and flat: the same plans --------------------------------------------------------------------

def _toy_plan(strategy, **options):
    builder, rules, units = pc.MODELS["toy"]
    return sp.plan(builder(), rules, sp.Mesh(dp=4), units=units, strategy=strategy, **options)


OPTIONS = st.fixed_dictionaries({  # (mostly valid: both spellings must also raise the same errors)
    "compute_dtype": st.sampled_from([None, "bfloat16", torch.float32, "float16"]),
    "reduce_dtype": st.sampled_from([None, "float32", torch.bfloat16, "int8"]),
    "gather_dtype": st.sampled_from([None, None, "int8", [(r".*emb.*", None), (r".*", "float8_e4m3fn")]]),
    "fp8": st.sampled_from([None, None, None, "torchao"]),   # (the toy has no Linear FP8 takes: an error)
    "fp8_gather": st.booleans(),
    "offload": st.sampled_from([None, None, "optimizer", "params"]),
    "offload_fraction": st.sampled_from([1.0, 0.5, 0.3, "auto"]),
    "prefetch": st.sampled_from([0, 1, 2]),
    "order": st.sampled_from(["static", "dynamic"]),
    "reshard_after_forward": st.sampled_from([True, False, {"blocks.1": False}]),
    "layout": st.sampled_from(["auto", "chunked"]),
    "min_unit_bytes": st.sampled_from([None, 0, 2000]),
})

GROUP_OF = {"compute_dtype": ("precision", "compute_dtype"), "reduce_dtype": ("precision", "reduce_dtype"),
            "gather_dtype": ("precision", "gather_dtype"), "fp8": ("precision", "fp8"),
            "fp8_gather": ("precision", "fp8_gather"), "offload_fraction": ("offload", "fraction"),
            "device_memory": ("offload", "device_memory"), "prefetch": ("schedule", "prefetch"),
            "order": ("schedule", "order"), "reshard_after_forward": ("schedule", "reshard_after_forward"),
            "min_unit_bytes": ("layout", "min_unit_bytes"), "offload": ("offload", "what"),
            "layout": ("layout", "kind")}
CLASSES = {"precision": sp.Precision, "offload": sp.Offload, "schedule": sp.Schedule, "layout": sp.Layout}


def _outcome(make):
    try:
        p = make()
    except sp.ShardingError as e:
        return type(e).__name__, str(e)
    return p.to_json(), str(p), p.to_source()


def _spelled(flat: dict, grouped: set) -> dict:
    """``flat``'s options with the fields named in ``grouped`` given through their policies."""
    out, policy = {}, {}
    if grouped & {"offload_fraction", "device_memory"}:  # (an Offload(device_memory=B) needs its fraction="auto")
        grouped = grouped | {"offload_fraction", "device_memory"}
    for k, v in flat.items():
        group, name = GROUP_OF[k]
        if k in grouped and not (group == "offload" and flat["offload"] is None):
            policy.setdefault(group, {})[name] = v
        else:
            out[k] = v
    for group, fields in policy.items():
        if group == "offload" and "what" not in fields:  # offload="..." given flat: the rest flat too
            out.update({k: v for k, v in flat.items() if GROUP_OF[k][0] == "offload"})
            continue
        if group == "layout" and "kind" not in fields and "layout" in out:
            fields["kind"] = out.pop("layout")
        out[group] = CLASSES[group](**fields)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategy=st.sampled_from([1, 2, 3, 3]), options=OPTIONS, grouped=st.sets(st.sampled_from(sorted(GROUP_OF))),
       budget=st.sampled_from([36_000, 40_000, 10**9]))
def test_grouped_and_flat_spellings_give_the_same_plan(strategy, options, grouped, budget):
    """Any mix of the two spellings plans byte for byte what the flat keywords plan (or raises the same error),
    and the plan's policies rebuild it."""
    flat = dict(options, device_memory=budget if options["offload_fraction"] == "auto" else None)
    if flat["offload"] is None:
        flat.update(offload_fraction=1.0, device_memory=None)
    want = _outcome(lambda: _toy_plan(strategy, **flat))
    got = _outcome(lambda: _toy_plan(strategy, **_spelled(flat, grouped)))
    assert got == want
    if len(want) == 3:
        p = _toy_plan(strategy, **flat)
        again = _toy_plan(strategy, **p.policies.keywords())
        assert again.equivalent(p) and again.policies == p.policies


# -- plan.policies and the flat attributes ---------------------------------------------------------------

def test_plan_policies_read_the_plan():
    p = pc.make("mixed_precision")
    assert p.policies == Policies(precision=sp.Precision(compute_dtype="bfloat16", reduce_dtype="float32"),
                                  schedule=sp.Schedule(prefetch=2), layout=sp.Layout(min_unit_bytes=p.min_unit_bytes))
    assert (p.compute_dtype, p.reduce_dtype, p.prefetch, p.offload, p.offload_fraction) == \
        ("bfloat16", "float32", 2, None, 1.0)
    off = pc.make("offload_params")
    assert off.policies.offload == sp.Offload("params", fraction=0.5) and (off.offload, off.offload_fraction) == \
        ("params", 0.5)
    raf = pc.make("per_unit_reshard")
    assert raf.policies.schedule.reshard_after_forward == {"blocks.2": False}
    q = pc.make("gather_int8")
    assert dict(q.policies.precision.gather_dtype) == {n: "int8" for n, f in
                                                       (dict(q.declarative()["gather_dtype"])).items()}
    assert sp.Plan.from_json(q.to_json()).policies == q.policies


# -- one field, two spellings; each policy checks its fields ---------------------------------------------

@pytest.mark.parametrize("flat,grouped,names", [
    (dict(prefetch=2), dict(schedule=sp.Schedule(prefetch=3)), ("prefetch=2", "schedule=sp.Schedule(prefetch=3)")),
    (dict(compute_dtype="float16"), dict(precision=sp.Precision(compute_dtype="bfloat16")),
     ("compute_dtype='float16'", "precision=sp.Precision(compute_dtype='bfloat16')")),
    (dict(offload_fraction=0.5), dict(offload=sp.Offload("optimizer", fraction=0.25)),
     ("offload_fraction=0.5", "offload=sp.Offload(fraction=0.25)")),
    (dict(min_unit_bytes=0), dict(layout=sp.Layout(min_unit_bytes=100)),
     ("min_unit_bytes=0", "layout=sp.Layout(min_unit_bytes=100)")),
])
def test_one_field_given_both_ways_is_refused_naming_both(flat, grouped, names):
    with pytest.raises(sp.PlanError) as e:
        pc.make("default", **flat, **grouped)
    assert all(n in str(e.value) for n in names), str(e.value)


def test_a_flat_keyword_fills_a_field_its_policy_leaves_at_the_default():
    mixed = pc.make("default", schedule=sp.Schedule(order="dynamic"), prefetch=2, reduce_dtype="float32",
                    precision=sp.Precision(compute_dtype="bfloat16"), layout=sp.Layout("chunked"), min_unit_bytes=0)
    flat = pc.make("default", order="dynamic", prefetch=2, reduce_dtype="float32", compute_dtype="bfloat16",
                   layout="chunked", min_unit_bytes=0)
    assert mixed.to_json() == flat.to_json()


def test_each_policy_checks_its_fields_when_made():
    with pytest.raises(sp.PlanError, match="prefetch must be a non-negative integer"):
        sp.Schedule(prefetch=-1)
    with pytest.raises(sp.PlanError, match="order must be one of"):
        sp.Schedule(order="sideways")
    with pytest.raises(sp.PlanError, match="layout must be one of"):
        sp.Layout("diagonal")
    with pytest.raises(sp.PlanError, match="min_unit_bytes must be"):
        sp.Layout(min_unit_bytes=-1)
    with pytest.raises(sp.PlanError, match="offload=None"):
        sp.Offload(None)
    with pytest.raises(sp.PlanError, match="offload must be one of"):
        sp.Offload("gpu")
    with pytest.raises(sp.PlanError, match="pass offload_fraction='auto' too"):
        sp.Offload(fraction=0.5, device_memory=2**30)
    with pytest.raises(sp.PlanError, match="pass device_memory"):
        sp.Offload(fraction="auto")
    with pytest.raises(sp.PlanError, match="not a floating dtype"):
        sp.Precision(compute_dtype="int8")
    with pytest.raises(sp.PlanError, match="gather_dtype rule #0"):
        sp.Precision(gather_dtype=[("(", "int8")])
    with pytest.raises(sp.PlanError, match="needs strategy='optim_grads_params'"):
        pc.make("default", strategy="optim", offload=sp.Offload("params"))
    with pytest.raises(sp.PlanError, match=r"precision must be a shardplan.Precision"):
        pc.make("default", precision="bfloat16")
    p = sp.Precision(compute_dtype=torch.bfloat16, gather_dtype=[(r".*", "int8")])
    assert p == sp.Precision(compute_dtype="bf16", gather_dtype=((r".*", "int8"),)) and hash(p)  # frozen, by name
