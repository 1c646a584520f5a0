"""Planner speed: the 70B config (80 blocks, meta device) at dp=8..1024, and matching 100k leaves
against 50 rules. Single core.

    python benchmarks/plan_speed.py --out plan_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
import gpt  # noqa: E402
from gpt_rules import UNITS, rules  # noqa: E402

import shardplan as sp  # noqa: E402


def timed(fn, repeat=3):
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with torch.device("meta"):
        model = gpt.llama_70b()
    res = {"plan_70b_s": {}}
    for dp in (8, 64, 1024, 4096):
        def once():
            sp.layout.place_contiguous.cache_clear()  # time a cold planner, not the layout cache
            sp.plan(model, rules, sp.Mesh(dp=dp), units=UNITS, compute_dtype=torch.bfloat16)
        res["plan_70b_s"][dp] = timed(once)
    res["growth_8_to_1024"] = res["plan_70b_s"][1024] / res["plan_70b_s"][8]
    leaves = {f"blocks.{i}.{kind}.weight": torch.empty(4, 4, device="meta")
              for i in range(10_000) for kind in ("q", "k", "v", "o", "w1", "w2", "w3", "n1", "n2", "emb")}
    many = [(rf"blocks\.\d+\.never{i}\.weight", sp.P()) for i in range(49)] + [(r".*", sp.P("dp"))]
    res["match_100k_leaves_50_rules_s"] = timed(lambda: sp.match(many, leaves, warn_unused=False), repeat=1)
    res["leaves"] = len(leaves)
    print(json.dumps(res, indent=1))
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
