"""Plans made with the keywords of ``sp.plan``: tests/test_policies.py checks that their JSON (written by the
planner of commit 35feb7b, format 2, ``tests/fixtures/plans_before_policies.json``) still loads and is made the
same, and that the automatic offload fraction still chooses the numbers it chose then.

Regenerate the fixture (only on purpose: it pins the old planner's output) with
``PYTHONPATH=src python3 tests/policy_cases.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.nn as nn

import shardplan as sp
from shardplan.models.gpt import build

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "plans_before_policies.json"


def sequential():
    return nn.Sequential(nn.Embedding(64, 16), nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8)),
                         nn.Linear(8, 64))


def toy():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from models import Toy
    return Toy()


MODELS = {"sequential": (sequential, [(r".*", sp.P("dp"))], [r"1\.\d"]),
          "toy": (toy, [(r"blocks\.\d+\.ln\..*", sp.P()), (r"blocks\.1\.fc2\.weight", sp.P(None, "dp")),
                        (r".*", sp.P("dp"))], [r"blocks\.\d+"]),
          "gpt": (build, [(r".*norm.*", sp.P()), (r".*", sp.P("dp"))], None)}

# name -> (model, mesh axes, keywords)
CASES = {
    "default": ("toy", dict(dp=4), {}),
    "mixed_precision": ("gpt", dict(dp=4), dict(compute_dtype="bfloat16", reduce_dtype="float32", prefetch=2)),
    "dynamic_chunked": ("toy", dict(dp=2), dict(order="dynamic", layout="chunked", min_unit_bytes=0,
                                                reshard_after_forward=False)),
    "per_unit_reshard": ("toy", dict(dp=2), dict(reshard_after_forward={"blocks.2": False}, min_unit_bytes=0)),
    "offload_params": ("sequential", dict(dp=4), dict(offload="params", offload_fraction=0.5, min_unit_bytes=0)),
    "offload_zero1": ("gpt", dict(dp=2), dict(strategy="optim", offload="optimizer")),
    "gather_int8": ("gpt", dict(dp=4), dict(compute_dtype="bfloat16", gather_dtype="int8")),
    "hsdp_quant": ("gpt", dict(dp=4), dict(reduce_dtype="int8", optimizer_states=1)),
}

# (model, strategy, what, device_memory): offload_fraction="auto" on each
AUTO = [(m, s, w, budget) for m, s, w, budgets in (
    ("sequential", 3, "optimizer", (21_000, 21_888, 25_216, 25_500, 26_752, 30_000)),
    ("sequential", 3, "params", (19_584, 24_576, 26_000)),
    ("sequential", 1, "optimizer", (24_192, 28_000, 29_056)),
    ("gpt", 3, "optimizer", (801_280, 801_792, 850_000, 924_672, 1_000_000, 2_000_000)),
    ("gpt", 3, "params", (739_328, 800_000, 884_736, 900_000)),
    ("gpt", 1, "optimizer", (924_160, 1_000_000, 1_048_000)),
    ("toy", 2, "optimizer", (35_056, 37_000, 38_160, 39_920, 41_000, 42_000)),
) for budget in budgets]


def make(name: str, **keywords) -> "sp.Plan":
    """The plan of case ``name`` (its keywords, overridden by ``keywords``)."""
    model, mesh, flat = CASES[name]
    builder, rules, units = MODELS[model]
    return sp.plan(builder(), rules, sp.Mesh(**mesh), units=units, **{**flat, **keywords})


def make_auto(model: str, strategy: int, what: str, budget: int, **keywords) -> "sp.Plan":
    builder, rules, units = MODELS[model]
    options = dict(offload=what, offload_fraction="auto", device_memory=budget) if not keywords else keywords
    return sp.plan(builder(), rules, sp.Mesh(dp=4), units=units, strategy=strategy, min_unit_bytes=0, **options)


def write() -> None:
    out = {"cases": {}, "auto": []}
    for name in CASES:
        p = make(name)
        out["cases"][name] = {"json": p.to_json(), "fingerprint": p.fingerprint()}
    for model, strategy, what, budget in AUTO:
        try:
            p = make_auto(model, strategy, what, budget)
            fraction, fingerprint = p.offload_fraction, p.fingerprint()
        except sp.errors.PlanError:
            fraction = fingerprint = None  # does not fit even fully offloaded
        out["auto"].append([model, strategy, what, budget, fraction, fingerprint])
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    write()
