"""``shardplan plan TARGET --mesh dp=8 [--rules RULES.py]``: print a plan without launching anything;
``shardplan rules TARGET --mesh dp=8``: propose a rules file (with the ``UNITS`` it proposes).

Exit status 0 on success, 2 with one line on stderr for bad input (a missing file, a bad mesh, a rule
that does not fit, a parameter name that does not exist).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import sys
import warnings
from typing import Optional, Sequence

from .errors import ShardingError


class CliError(Exception):
    pass


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000 ** 2, "mb": 1000 ** 2, "mib": 1024 ** 2,
          "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1024 ** 3}


def parse_size(text: str) -> int:
    """``4096``, ``16MiB``, ``1.5GB`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 4096, 16MiB or 1GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


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
    """``path/to/file.py:fn`` or ``package.module:fn`` -> the callable (module paths resolve from the
    working directory too, as ``python -m`` would)."""
    where, sep, fn = target.rpartition(":")
    if not sep or not where or not fn:
        raise CliError(f"TARGET {target!r} must be 'path/to/file.py:function' or 'package.module:function'")
    if where.endswith(".py"):
        mod = _load_file(where, "_shardplan_target")
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            mod = importlib.import_module(where)
        except ImportError as exc:
            raise CliError(f"cannot import {where!r}: {exc}") from None
    if not hasattr(mod, fn):
        raise CliError(f"{where} has no function {fn!r}")
    return getattr(mod, fn)


def load_rules(spec: str):
    """``RULES.py`` (its ``rules``) or ``RULES.py:NAME`` (its ``NAME``) -> (rules, the file's UNITS or None).
    The file's ``compute_axes`` and ``styles``, if any, are read by :func:`rules_file_options`."""
    path, _, name = spec.partition(":") if spec.count(":") == 1 and not re.match(r"^[A-Za-z]:\\", spec) else (spec, "", "")
    mod = _load_file(path, "_shardplan_rules")
    name = name or "rules"
    if not hasattr(mod, name):
        found = [k for k, v in vars(mod).items() if isinstance(v, list) and not k.startswith("_")]
        raise CliError(f"{path} defines no {name!r} (a shardplan.Rules or a list of (regex, spec) pairs); "
                       f"it has {found}; pick one with --rules {path}:NAME")
    return getattr(mod, name), getattr(mod, "UNITS", None)


def rules_file_options(spec: Optional[str]) -> dict:
    """A rules file's tensor-parallel options: ``compute_axes`` and ``styles`` (absent: none)."""
    if not spec:
        return {}
    path = spec.partition(":")[0] if spec.count(":") == 1 and not re.match(r"^[A-Za-z]:\\", spec) else spec
    mod = _load_file(path, "_shardplan_rules")
    return {k: getattr(mod, k) for k in ("compute_axes", "styles") if getattr(mod, k, None) is not None}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    ap = argparse.ArgumentParser(prog="shardplan", description="Plan sharding of a model without launching anything.")
    ap.add_argument("--version", action="version", version=f"shardplan {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the plan for a model, mesh and rules")
    p.add_argument("target", help="path/to/file.py:fn or package.module:fn returning an nn.Module, or "
                                  "hf:path/to/config.json (a Hugging Face model, built on the meta device)")
    p.add_argument("--mesh", required=True, help="axes, e.g. dp=8 or replica=2,shard=4")
    p.add_argument("--rules", default=None, help="a .py file defining `rules`, or FILE.py:NAME for another variable "
                                                 "(default: shardplan.auto_rules of the model)")
    p.add_argument("--strategy", default="optim_grads_params",
                   help="no_shard | optim | optim_grads | optim_grads_params (or 0..3)")
    p.add_argument("--units", nargs="*", default=None, help="regexes over module paths; default: the rules file's UNITS, "
                                                            "else the model's repeated blocks; --units alone: one root unit")
    p.add_argument("--dtype", default=None, help="compute dtype, e.g. bf16")
    p.add_argument("--reduce-dtype", default=None, help="gradient reduction dtype, e.g. fp32")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--min-unit-bytes", type=parse_size, default=None,
                   help="merge neighbouring units up to this size, e.g. 16MiB; 0: no merging (default: chosen)")
    p.add_argument("--order", default="static", choices=("static", "dynamic"))
    p.add_argument("--no-reshard-after-forward", action="store_true")
    p.add_argument("--rank", type=int, default=0, help="rank whose local shapes and memory are shown")
    p.add_argument("--schedule", action="store_true", help="also print the op schedule")
    p.add_argument("--summary", action="store_true", help="sizes, memory and bytes only: no per-parameter table")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (with memory and bytes per step)")
    p.add_argument("--explain", metavar="NAME", default=None, help="say which rule matches parameter NAME and why")
    p.add_argument("--param-dtype", default=None, help="store parameters in this dtype (default: the model's), e.g. fp32")
    p.add_argument("--trace-tokens", default=None, metavar="BxT",
                   help="trace the forward once with a (B, T) token tensor on the meta device, e.g. 1x4096: the "
                        "unit order it takes and the tensor-parallel activation bytes per step")
    p.add_argument("--compute-axes", default=None, help="mesh axes that shard compute (tensor parallelism), e.g. tp "
                                                        "(default: the rules file's compute_axes)")
    from .forecast.cli import add_parser as add_forecast
    add_forecast(sub, p)  # `shardplan forecast`: the plan options above, and its own (src/shardplan/forecast/cli.py)
    r = sub.add_parser("rules", help="propose partition rules for a model (shardplan.auto_rules) as a rules file")
    r.add_argument("target", help="path/to/file.py:fn, package.module:fn or hf:path/to/config.json")
    r.add_argument("--mesh", required=True, help="axes, e.g. dp=8 or replica=2,shard=4")
    r.add_argument("--min-shard-bytes", type=parse_size, default=2 ** 20, help="replicate parameters below this size")
    return ap


def build_model(target: str, param_dtype=None):
    """The module a TARGET names, on the meta device."""
    import torch
    if target.startswith("hf:"):
        from .hf import model_from_config
        model = model_from_config(target[3:])
    else:
        builder = load_target(target)
        try:
            with torch.device("meta"):
                model = builder()
        except ShardingError:
            raise
        except Exception as exc:
            raise CliError(f"{target}() failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(model, torch.nn.Module):
            raise CliError(f"{target} returned {type(model).__name__}, not an nn.Module")
    if param_dtype:
        from .dtypes import dtype_name, to_torch
        model.to(to_torch(dtype_name(param_dtype)))
    return model


def trace_tokens(text: str):
    """``"BxT"`` -> a (B, T) int64 token tensor on the meta device (no memory, no compute)."""
    try:
        b, t = (int(x) for x in text.lower().split("x"))
        assert b > 0 and t > 0
    except (ValueError, AssertionError):
        raise CliError(f"--trace-tokens {text!r}: expected BxT with positive integers, e.g. 1x4096") from None
    import torch
    return torch.zeros(b, t, dtype=torch.long, device="meta")


def run_rules(args) -> str:
    from .auto import auto_rules
    from .mesh import Mesh
    mesh = Mesh.parse(args.mesh)
    model = build_model(args.target)
    return auto_rules(model, mesh, min_shard_bytes=args.min_shard_bytes).to_source()


def run(args) -> str:
    if args.command == "rules":
        return run_rules(args)
    if args.command == "forecast":
        from .forecast.cli import run as run_forecast
        return run_forecast(args, run)
    from .auto import auto_rules
    from .mesh import Mesh
    from .plan import plan, strategy_level
    from .plan.render import render, render_schedule
    from .rules import explain

    mesh = Mesh.parse(args.mesh)
    rules_obj, file_units = load_rules(args.rules) if args.rules else (None, None)
    model = build_model(args.target, args.param_dtype)
    if rules_obj is None:
        rules_obj = auto_rules(model, mesh)
    if args.explain:
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        if args.explain not in names:
            close = [n for n in names if args.explain.split(".")[-1] in n][:5] or names[:5]
            raise CliError(f"{args.target} has no parameter {args.explain!r}; it has e.g. {close}")
        return explain(rules_obj, args.explain)
    units = args.units if args.units is not None else file_units  # None: the plan finds the repeated blocks
    strategy = int(args.strategy) if args.strategy.isdigit() else args.strategy
    strategy_level(strategy)
    if not 0 <= args.rank < mesh.size:
        raise CliError(f"--rank {args.rank} is outside the mesh's {mesh.size} ranks")
    tp_opts = rules_file_options(args.rules)
    if args.compute_axes is not None:
        tp_opts["compute_axes"] = tuple(a.strip() for a in args.compute_axes.split(",") if a.strip())
    if args.trace_tokens is not None:
        tp_opts["trace"] = trace_tokens(args.trace_tokens)
    p = plan(model, rules_obj, mesh, strategy=strategy, units=units, compute_dtype=args.dtype,
             reduce_dtype=args.reduce_dtype, prefetch=args.prefetch, order=args.order,
             reshard_after_forward=not args.no_reshard_after_forward, min_unit_bytes=args.min_unit_bytes, **tp_opts)
    if args.json:
        d = p.to_dict()
        d["memory"] = vars(p.memory(args.rank)) | {"rank": args.rank}
        d["comm_bytes_per_step"] = p.comm_bytes(args.rank)
        return json.dumps(d, indent=1, sort_keys=True)
    out = render(p, rank=args.rank, max_rows=0 if args.summary else 100_000)
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
