"""``shardplan plan TARGET --mesh dp=8 --rules RULES.py``: print a plan without launching anything."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import warnings
from typing import Optional, Sequence

from .errors import ShardingError


class CliError(Exception):
    pass


def _load_file(path: str, name: str):
    if not os.path.exists(path):
        raise CliError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses and pickling look the module up by name
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        spec.loader.exec_module(mod)
    except Exception as exc:
        raise CliError(f"loading {path} failed: {type(exc).__name__}: {exc}") from None
    finally:
        sys.path.pop(0)
    return mod


def load_target(target: str):
    """``path/to/file.py:fn`` or ``package.module:fn`` -> the callable."""
    where, sep, fn = target.rpartition(":")
    if not sep or not where or not fn:
        raise CliError(f"TARGET {target!r} must be 'path/to/file.py:function' or 'package.module:function'")
    try:
        mod = _load_file(where, "_shardplan_target") if where.endswith(".py") else importlib.import_module(where)
    except ImportError as exc:
        raise CliError(f"cannot import {where!r}: {exc}") from None
    except CliError:
        raise
    if not hasattr(mod, fn):
        raise CliError(f"{where} has no function {fn!r}")
    return getattr(mod, fn)


def load_rules(path: str):
    mod = _load_file(path, "_shardplan_rules")
    if not hasattr(mod, "rules"):
        raise CliError(f"{path} must define `rules` (a shardplan.Rules or a list of (regex, spec) pairs)")
    return mod.rules


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="shardplan", description="Plan sharding of a model without launching anything.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the plan for a model, mesh and rules")
    p.add_argument("target", help="path/to/file.py:fn or package.module:fn returning an nn.Module")
    p.add_argument("--mesh", required=True, help="axes, e.g. dp=8 or replica=2,shard=4")
    p.add_argument("--rules", required=True, help="a .py file defining `rules`")
    p.add_argument("--strategy", default="optim_grads_params",
                   help="no_shard | optim | optim_grads | optim_grads_params (or 0..3)")
    p.add_argument("--units", nargs="*", default=None, help="regexes over module paths; default: the rules file's UNITS")
    p.add_argument("--dtype", default=None, help="compute dtype, e.g. bf16")
    p.add_argument("--reduce-dtype", default=None, help="gradient reduction dtype, e.g. fp32")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--min-unit-bytes", type=int, default=0, help="merge neighbouring units up to this many bytes")
    p.add_argument("--no-reshard-after-forward", action="store_true")
    p.add_argument("--rank", type=int, default=0, help="rank whose local shapes and memory are shown")
    p.add_argument("--schedule", action="store_true", help="also print the op schedule")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead")
    p.add_argument("--explain", metavar="NAME", default=None, help="say which rule matches parameter NAME and why")
    return ap


def run(args) -> str:
    import torch

    from .mesh import Mesh
    from .plan import plan, strategy_level
    from .plan.render import render, render_schedule
    from .rules import explain

    mesh = Mesh.parse(args.mesh)
    rules_obj = load_rules(args.rules)
    if args.explain:
        return explain(rules_obj, args.explain)
    builder = load_target(args.target)
    try:
        with torch.device("meta"):
            model = builder()
    except ShardingError:
        raise
    except Exception as exc:
        raise CliError(f"{args.target}() failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, torch.nn.Module):
        raise CliError(f"{args.target} returned {type(model).__name__}, not an nn.Module")
    units = args.units
    if units is None:
        units = getattr(sys.modules.get("_shardplan_rules"), "UNITS", ())
    strategy = int(args.strategy) if args.strategy.isdigit() else args.strategy
    strategy_level(strategy)
    if not 0 <= args.rank < mesh.size:
        raise CliError(f"--rank {args.rank} is outside the mesh's {mesh.size} ranks")
    p = plan(model, rules_obj, mesh, strategy=strategy, units=units, compute_dtype=args.dtype,
             reduce_dtype=args.reduce_dtype, prefetch=args.prefetch,
             reshard_after_forward=not args.no_reshard_after_forward, min_unit_bytes=args.min_unit_bytes)
    if args.json:
        return p.to_json(indent=1)
    out = render(p, rank=args.rank)
    if args.schedule:
        out += "\n\nschedule:\n" + render_schedule(p)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the plan's own warnings are printed in its table
            text = run(args)
    except (CliError, ShardingError) as exc:
        msg = str(exc).strip().replace("\n", " | ")
        print(f"shardplan: error: {msg}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
