"""``shardplan forecast TARGET --mesh dp=64 --network h100-8x-ib400 --batch 1x4096 [--json] [--trace out.json]``:
the plan ``shardplan plan`` builds from the same options, forecast. ``--batch BxT`` is per rank.

The subcommand takes every option of ``shardplan plan`` (it is built from that parser) plus its own.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Callable

from ..errors import ForecastError
from ..planner.facade import Plan
from .compute import PRESETS, ComputeModel, compute_model
from .network import network
from .sources import preset_or_file

OWN = ("network", "batch", "compute", "tflops", "trace", "scalar_all_reduces")
PLAN_ONLY = ("schedule", "summary", "explain")  # views of `shardplan plan` that a forecast does not print


def add_parser(sub, plan_parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register ``forecast`` on the CLI's subparsers, with ``plan_parser``'s options and its own."""
    # [Note: argparse shares the parent's action objects; the subcommand must not redefine any of them (a
    # "resolve" conflict handler would edit `shardplan plan`'s own options), so --json and -h are the plan's]
    f = sub.add_parser("forecast", parents=[plan_parser], add_help=False,
                       help="predict the step time of a plan at N GPUs (α–β network model, achievable compute rate)",
                       description="Predict one rank's training step: compute, each collective over the link its "
                                   "group crosses, the overlap the schedule allows. Prints a table; --json prints the "
                                   "forecast as JSON. The plan options are those of `shardplan plan`.")
    f.add_argument("--network", required=True,
                   help="a preset (h100-8x-ib400, h200-8x-ib400, a100-8x-ib200) or a JSON file "
                        "(benchmarks/collectives.py --out FILE writes one)")
    f.add_argument("--batch", required=True, metavar="BxT", help="tokens per rank per step, e.g. 1x4096")
    f.add_argument("--compute", default=None, metavar="PRESET|FILE|TFLOPS",
                   help="compute model: a preset (h100-sxm-bf16, ...), a JSON file (shardplan rehearse --json "
                        "writes one) or a number, the achievable TFLOP/s per GPU and nothing else (--tflops "
                        "instead keeps the rest of the compute model); default: the network's device")
    f.add_argument("--tflops", type=float, default=None, help="achievable TFLOP/s per GPU (overrides the compute model's)")
    f.add_argument("--trace", default=None, metavar="OUT.json", help="write the predicted timeline as a Chrome trace")
    f.add_argument("--scalar-all-reduces", type=int, default=0, metavar="N",
                   help="blocking scalar all-reduces over every rank per step (1 for sp.clip_grad_norm_)")
    return f


def parse_batch(text: str) -> tuple[int, int]:
    try:
        b, t = (int(x) for x in text.lower().split("x"))
        assert b > 0 and t > 0
    except (ValueError, AssertionError):
        raise ForecastError(f"--batch {text!r}: expected BxT per rank with positive integers, e.g. 1x4096") from None
    return b, t


def parse_compute(text: str) -> ComputeModel:
    """``--compute``: a preset, a JSON file, or a number (the achievable TFLOP/s per GPU alone, as
    ``plan.forecast(compute=400.0)`` takes it).

    >>> parse_compute("0.5").tflops
    0.5
    """
    found = preset_or_file(text, PRESETS, "compute", "compute")   # a file named like a number wins
    if found is not None:
        return compute_model(text)
    try:
        rate = float(text)
    except ValueError:
        raise ForecastError(f"--compute {text!r}: not a preset, a file or a number; use a preset "
                            f"({', '.join(PRESETS)}), a JSON file (shardplan rehearse --json writes one) or the "
                            f"achievable TFLOP/s per GPU, e.g. --compute 400") from None
    if not (math.isfinite(rate) and rate > 0):
        raise ForecastError(f"--compute {text}: an achievable rate is a positive number of TFLOP/s per GPU")
    return compute_model(rate)


def run(args: argparse.Namespace, plan_text: Callable[[argparse.Namespace], str]) -> str:
    """The forecast for ``args``; ``plan_text`` is ``shardplan plan``'s own runner, asked for JSON.

    [Note: the plan is built by the very code ``shardplan plan`` runs (its JSON read back with
    ``Plan.from_json``, which round-trips exactly), so both commands build the same plan from the same
    options; the runner is passed in because this module cannot import shardplan.cli (it imports us)]
    """
    for name in PLAN_ONLY:
        if getattr(args, name, None):
            raise ForecastError(f"--{name} is an option of `shardplan plan`; run that for it")
    batch = parse_batch(args.batch)
    net = network(args.network)
    cm = parse_compute(args.compute) if args.compute is not None else None   # None: the network's device
    if args.tflops is not None:
        cm = (cm or (compute_model(net.device) if net.device else ComputeModel())).with_rate(args.tflops)
    plan_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in OWN})
    plan_args.command, plan_args.json, plan_args.explain, plan_args.schedule, plan_args.summary = "plan", True, None, False, False
    plan = Plan.from_json(plan_text(plan_args))
    f = plan.forecast(net, cm, batch=batch, rank=args.rank, scalar_all_reduces=args.scalar_all_reduces)
    if args.trace:
        f.to_chrome_trace(args.trace)
    if args.json:
        return json.dumps(f.to_dict(), indent=1)
    return str(f) + (f"\n\ntrace written to {args.trace}" if args.trace else "")
