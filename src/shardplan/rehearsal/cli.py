"""``shardplan rehearse TARGET --mesh dp=64 --rank 0 --batch 1x4096 [--steps 3] [--checkpoint] [--network NAME|FILE]
[--json]``: rank R of the plan ``shardplan plan`` builds from the same options, trained for a few steps on this
machine (under ``--network``, its collectives timed by that network model: emulated).

The subcommand takes the options of ``shardplan plan`` that build the plan (not its views: ``--summary``,
``--schedule``, ``--explain``) plus its own; without ``--trace-tokens`` the plan is traced on ``--batch`` (so
its peak counts the step's activations). A ``hf:config.json`` target rehearses with the model's own
initialisation (the output says which was used).
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

from ..errors import RehearsalError
from ..planner.facade import Plan

OWN = ("batch", "steps", "checkpoint", "out", "capture", "network", "step_trace", "compile")


def add_parser(sub, plan_parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register ``rehearse`` on the CLI's subparsers, with ``plan_parser``'s options and its own."""
    # [Note: the parent is a parser of the plan options without the plan's views (--summary, --schedule,
    # --explain), which a rehearsal cannot show: --help offers only what runs; --rank and --json are ours]
    r = sub.add_parser("rehearse", parents=[plan_parser], add_help=False,
                       help="run one rank of an N-rank plan on this machine (collectives are local stand-ins)",
                       description="Train rank --rank of the plan for a few steps on this machine's device, every "
                                   "collective a local stand-in of the right shape: measured step time and peak "
                                   "memory beside the plan's, compute time per unit. For one rank only; the loss is "
                                   "not meaningful. The plan options are those of `shardplan plan` that build the plan.")
    r.add_argument("--rank", type=int, default=0, metavar="R", help="the rank of the plan to rehearse")
    r.add_argument("--batch", required=True, metavar="BxT",
                   help="tokens per rank per step, e.g. 1x4096 (T at most the model's positions, where it has a table "
                        "of them)")
    r.add_argument("--steps", type=int, default=3, metavar="N", help="training steps to run (the first warms up)")
    r.add_argument("--checkpoint", action="store_true", help="checkpoint every unit (activation checkpointing)")
    r.add_argument("--capture", action="store_true",
                   help="rehearse the captured step (shardplan.capture): warm up, capture, then time --steps replays")
    r.add_argument("--network", default=None, metavar="NAME|FILE",
                   help="time every collective by this network model on the emulated backend (a preset: "
                        "h100-8x-ib400, h200-8x-ib400, a100-8x-ib200; or a benchmarks/collectives.py JSON file): "
                        "adds exposed communication, overlap, tokens/s and MFU, all EMULATED (docs/emulated.md)")
    r.add_argument("--step-trace", default=None, metavar="FILE.json",
                   help="with --network: write one step as a Chrome trace (compute and each collective's stream)")
    r.add_argument("--compile", action="store_true", help="compile each unit's forward (shardplan.compile_units)")
    r.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    r.add_argument("--out", default=None, metavar="FILE.json",
                   help="also write the results as JSON to FILE (`shardplan forecast --compute FILE` reads it)")
    return r


def parse_batch(text: str) -> tuple[int, int]:
    try:
        b, t = (int(x) for x in text.lower().split("x"))
        assert b > 0 and t > 0
    except (ValueError, AssertionError):
        raise RehearsalError(f"--batch {text!r}: expected BxT per rank with positive integers, e.g. 1x4096") from None
    return b, t


def run(args: argparse.Namespace, plan_text: Callable[[argparse.Namespace], str], build_model: Callable) -> str:
    """The rehearsal for ``args``; ``plan_text`` is ``shardplan plan``'s own runner, asked for JSON (the
    same plan from the same options, as ``shardplan forecast`` builds it), ``build_model(target,
    param_dtype)`` its model builder (passed in: this module cannot import shardplan.cli, which imports it)."""
    from .run import rehearse  # (keeps `shardplan --help` torch-free: run.py imports torch)
    batch = parse_batch(args.batch)
    plan_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in OWN})
    plan_args.command, plan_args.json, plan_args.explain, plan_args.schedule, plan_args.summary = "plan", True, None, False, False
    plan_args.trace = None
    if plan_args.trace_tokens is None:
        plan_args.trace_tokens = f"{batch[0]}x{batch[1]}"
    plan = Plan.from_json(plan_text(plan_args))
    r = rehearse(lambda: build_model(args.target, args.param_dtype), plan, rank=args.rank, batch=batch,
                 steps=args.steps, checkpoint=args.checkpoint, capture=args.capture, network=args.network,
                 trace=args.step_trace, compile=args.compile)
    if args.out:
        try:
            with open(args.out, "w") as f:
                f.write(r.to_json())
        except OSError as exc:
            raise RehearsalError(f"--out {args.out}: cannot write it: {exc.strerror or exc}") from None
    if args.json:
        return r.to_json()
    return str(r) + (f"\n\nresults written to {args.out}" if args.out else "")
