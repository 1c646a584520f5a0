"""``shardplan.plan``'s options, one spelling each (the flat keywords: ``compute_dtype=``, ``prefetch=``,
``offload=``, ...): plans saved by this version load and are made the same (tests/policy_cases.py); JSON of an
older format is refused naming it; ``offload_fraction="auto"`` chooses what it chose before; ``plan.declarative()``
rebuilds any plan; each option is checked, naming the fix."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import shardplan as sp

import policy_cases as pc

FIXTURE = json.loads(pc.FIXTURE.read_text())


# -- plans saved by this version --------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(pc.CASES))
def test_plans_saved_before_load_and_are_made_the_same(name):
    saved = FIXTURE["cases"][name]
    old = sp.Plan.from_json(saved["json"])
    assert old.to_json() == saved["json"] and old.fingerprint() == saved["fingerprint"]
    new = pc.make(name)
    assert old.declarative() == new.declarative()
    # the planner writes today what it wrote then (if a change of the planner means to change it, regenerate the
    # fixture on purpose: PYTHONPATH=src python3 tests/policy_cases.py)
    assert new.to_json() == saved["json"], f"{name}: the plan's JSON changed"


@pytest.mark.parametrize("model,strategy,what,budget,fraction,fingerprint", FIXTURE["auto"],
                         ids=[f"{m}-{s}-{w}-{b}" for m, s, w, b, _, _ in FIXTURE["auto"]])
def test_auto_fraction_chooses_what_it_chose_before(model, strategy, what, budget, fraction, fingerprint):
    if fraction is None:
        with pytest.raises(sp.errors.PlanError, match="even offloading every buffer"):
            pc.make_auto(model, strategy, what, budget)
        return
    p = pc.make_auto(model, strategy, what, budget)
    assert (p.offload_fraction, p.fingerprint()) == (fraction, fingerprint)
    assert p.declarative()["offload_fraction" if fraction != 1 else "offload"] == (fraction if fraction != 1 else what)


def test_json_of_an_older_format_is_refused_naming_it():
    d = json.loads(pc.make("default").to_json())
    d["format"] = 1
    with pytest.raises(sp.errors.PlanError, match="plan JSON has format 1: written by an older shardplan"):
        sp.Plan.from_json(json.dumps(d))
    del d["format"]
    with pytest.raises(sp.errors.PlanError, match="format None"):
        sp.Plan.from_json(json.dumps(d))


# -- any options: the plan rebuilds itself ----------------------------------------------------------------

def _toy_plan(strategy, **options):
    builder, rules, units = pc.MODELS["toy"]
    return sp.plan(builder(), rules, sp.Mesh(dp=4), units=units, strategy=strategy, **options)


OPTIONS = st.fixed_dictionaries({
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


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategy=st.sampled_from([1, 2, 3, 3]), options=OPTIONS, budget=st.sampled_from([36_000, 40_000, 10**9]))
def test_any_plan_is_rebuilt_by_its_declarative_keywords(strategy, options, budget):
    """Whatever the options (or the error they raise, naming the option), ``plan.declarative()`` plans the same
    plan again, and so does the plan's JSON."""
    flat = dict(options, device_memory=budget if options["offload_fraction"] == "auto" else None)
    if flat["offload"] is None:
        flat.update(offload_fraction=1.0, device_memory=None)
    try:
        p = _toy_plan(strategy, **flat)
    except sp.errors.PlanError as e:
        assert "=" in str(e) or "must" in str(e), str(e)  # names the option
        return
    d = p.declarative()
    d.pop("strategy")
    again = _toy_plan(strategy, **{k: v for k, v in d.items() if k not in ("rules", "mesh", "units")})
    assert again.equivalent(p) and sp.Plan.from_json(p.to_json()) == p


def test_the_flat_options_read_back_from_the_plan():
    p = pc.make("mixed_precision")
    assert (p.compute_dtype, p.reduce_dtype, p.prefetch, p.offload, p.offload_fraction) == \
        ("bfloat16", "float32", 2, None, 1.0)
    off = pc.make("offload_params")
    assert (off.offload, off.offload_fraction) == ("params", 0.5)
    assert pc.make("per_unit_reshard").declarative()["reshard_after_forward"] == {"blocks.2": False}


# -- one spelling; each option checked ----------------------------------------------------------------------

@pytest.mark.parametrize("keyword", ["precision", "schedule"])
def test_the_grouped_spellings_are_gone(keyword):
    with pytest.raises(TypeError, match=keyword):
        pc.make("default", **{keyword: None})
    assert not hasattr(sp, "Precision") and not hasattr(sp, "Schedule")


def test_each_option_is_checked():
    bad = [(dict(prefetch=-1), "prefetch must be a non-negative integer"), (dict(order="sideways"), "order must be one of"),
           (dict(layout="diagonal"), "layout must be one of"), (dict(min_unit_bytes=-1), "min_unit_bytes must be"),
           (dict(offload="gpu"), "offload must be one of"),
           (dict(offload="optimizer", offload_fraction=0.5, device_memory=2**30), "pass offload_fraction='auto' too"),
           (dict(offload="optimizer", offload_fraction="auto"), "pass device_memory"),
           (dict(offload_fraction=0.5), "needs offload='optimizer'"),
           (dict(compute_dtype="int8"), "not a floating dtype"), (dict(gather_dtype=[("(", "int8")]), "gather_dtype rule #0"),
           (dict(strategy="optim", offload="params"), "needs strategy='optim_grads_params'")]
    for options, message in bad:
        with pytest.raises(sp.errors.PlanError, match=message):
            pc.make("default", **options)
    flat = pc.make("default", compute_dtype=torch.bfloat16, gather_dtype=[(r".*", "int8")])
    assert flat.to_json() == pc.make("default", compute_dtype="bf16", gather_dtype=((r".*", "int8"),)).to_json()
