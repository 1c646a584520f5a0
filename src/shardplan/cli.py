"""``shardplan plan TARGET --mesh dp=8 [--rules RULES.py]``: print a plan without launching anything;
``shardplan rules TARGET --mesh dp=8``: propose a rules file (with the ``UNITS`` it proposes).

Exit status 0 on success, 2 with one line on stderr for bad input (a missing file, a bad mesh, a rule
that does not fit, a parameter name that does not exist).

Argument parsing needs neither torch nor the runtime: ``shardplan --help`` answers at once, and
``shardplan plan`` imports torch only to build the model (on the meta device) and the planner.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
import warnings
from typing import Optional, Sequence

from . import __version__
from .step_call import token_inputs
from .auto import auto_rules
from .cli_inputs import CliError, RulesFile, build_model, load_rules_file, parse_size, trace_tokens
from .dtypes import itemsize
from .errors import ShardingError
from .forecast.cli import add_parser as add_forecast
from .forecast.cli import run as run_forecast
from .mesh import Mesh
from .planner import plan, strategy_level
from .planner.render import fmt_bytes, nothing_sharded, render, render_schedule
from .planner.serialize import to_dict
from .rehearsal.cli import add_parser as add_rehearse
from .rehearsal.cli import run as run_rehearse
from .rules import explain

def _fraction(text: str):
    """``--offload-fraction``: a number, or ``auto``."""
    return text if text == "auto" else float(text)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' layout, and shows each option's default where it has one."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or isinstance(action, argparse._VersionAction)):
            return text
        return f"{text} (default: %(default)s)"


MAIN_EXAMPLES = """\
examples:
  # the table, memory per rank and bytes per step of a 70B model on 64 ranks
  shardplan plan shardplan.models.gpt:llama_70b --mesh dp=64 --rules shardplan.models.gpt_rules --dtype bf16 --summary
  # propose rules for a Hugging Face config (no weights), then plan with them
  shardplan rules hf:mixtral_8x7b --mesh dp=8 > mixtral_rules.py
  shardplan plan hf:mixtral_8x7b --mesh dp=8 --rules mixtral_rules.py --summary

Each command has its own help, with its options and more examples: shardplan plan --help.
"""

PLAN_EXAMPLES = """\
examples:
  # a 70B model on 64 ranks with bf16 compute: memory per rank and bytes per step, no per-parameter table
  shardplan plan shardplan.models.gpt:llama_70b --mesh dp=64 --rules shardplan.models.gpt_rules --dtype bf16 --summary
  # HSDP with another rules list of the same file; the schedule as a Chrome trace (open in ui.perfetto.dev)
  shardplan plan shardplan.models.gpt:tiny --mesh replica=2,shard=2 --rules shardplan.models.gpt_rules:HSDP_RULES --trace plan_trace.json
  # FSDP x tensor parallelism (the file's compute_axes); which rule takes one parameter, and why
  shardplan plan shardplan.models.gpt:tiny --mesh dp=2,tp=2 --rules shardplan.models.gpt_rules_tp --explain layers.0.attention.wq.weight

TARGET's function is called under torch.device("meta"): nothing is allocated, nothing runs. A rules file
defines `rules` and may define UNITS, MESH, OPTIONS (keywords of shardplan.plan), compute_axes and styles,
as `shardplan rules` and plan.to_source() write them; flags given here override the file.
"""

FORECAST_EXAMPLES = """\
examples:
  # a 70B model on 64 H100s (8 per node, 400 Gb/s InfiniBand), 4096 tokens per rank per step
  shardplan forecast shardplan.models.gpt:llama_70b --mesh dp=64 --rules shardplan.models.gpt_rules --dtype bf16 --network h100-8x-ib400 --batch 1x4096
  # the same at an achievable 400 TFLOP/s per GPU, as JSON, with the predicted timeline as a Chrome trace
  shardplan forecast shardplan.models.gpt:llama_70b --mesh dp=64 --rules shardplan.models.gpt_rules --dtype bf16 --network h100-8x-ib400 --batch 1x4096 --tflops 400 --json --trace forecast_trace.json
"""

REHEARSE_EXAMPLES = """\
examples:
  # rank 3 of a 64-rank plan, 2 steps of 2x32 tokens, on this machine's device (Llama-3 8B: shardplan.models.gpt:llama_8b,
  # --dtype bf16 --batch 1x4096, on a GPU)
  shardplan rehearse shardplan.models.gpt:tiny --mesh dp=64 --rules shardplan.models.gpt_rules --rank 3 --batch 2x32 --steps 2
  # with activation checkpointing; the results as JSON for `shardplan forecast --compute rehearsal.json`
  shardplan rehearse shardplan.models.gpt:tiny --mesh dp=8 --batch 2x32 --steps 2 --checkpoint --out rehearsal.json
"""

RULES_EXAMPLES = """\
examples:
  # propose rules and units for a model; planning with the file gives the same plan as planning without it
  shardplan rules shardplan.models.gpt:tiny --mesh dp=8 > tiny_rules.py
  shardplan plan shardplan.models.gpt:tiny --mesh dp=8 --rules tiny_rules.py
  # HSDP: parameters sharded over "shard" (axes named like replica axes are left out); replicate below 16 MiB
  shardplan rules hf:mixtral_8x7b --mesh replica=2,shard=8 --min-shard-bytes 16MiB
"""


def plan_options_parser(views: bool = True) -> argparse.ArgumentParser:
    """The options that say which plan to build (TARGET, mesh, rules, strategy, ...) and the plan views
    (--rank, --summary, --schedule, --json, --explain): ``shardplan plan`` and ``shardplan forecast`` share
    them; ``shardplan rehearse`` takes the first without the views (``views=False``), which it cannot show,
    and has its own --rank and --json."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("target", help="path/to/file.py:fn or package.module:fn returning an nn.Module (e.g. "
                                  "shardplan.models.gpt:tiny), or hf:CONFIG: a Hugging Face config.json, a model folder "
                                  "holding one, or a shipped config (hf:llama3_8b, hf:llama3_70b, hf:mixtral_8x7b, "
                                  "hf:qwen2_7b), built on the meta device without weights")
    p.add_argument("--mesh", default=None, metavar="AXES",
                   help="axes, e.g. dp=8 or replica=2,shard=4 (default: the rules file's MESH; one of the two is needed)")
    p.add_argument("--rules", default=None, metavar="FILE",
                   help="a .py file (or an importable module, e.g. shardplan.models.gpt_rules) defining `rules`, or "
                        "FILE.py:NAME for another variable (default: shardplan.auto_rules of the model, which "
                        "replicates parameters under 1 MiB)")
    p.add_argument("--strategy", default=None, metavar="NAME",
                   help="no_shard | optim | optim_grads | optim_grads_params (or 0..3) (default: the rules file's "
                        "OPTIONS, else optim_grads_params)")
    p.add_argument("--units", nargs="*", default=None, metavar="REGEX",
                   help="regexes over module paths; --units alone: one root unit (default: the rules file's UNITS, "
                        "else the model's repeated blocks)")
    p.add_argument("--dtype", default=None, metavar="DTYPE", help="compute dtype, e.g. bf16 (default: the parameters' own)")
    p.add_argument("--reduce-dtype", default=None, metavar="DTYPE",
                   help="gradient reduction dtype, e.g. fp32 (default: the compute dtype)")
    p.add_argument("--gather-dtype", default=None, metavar="FORMAT",
                   help="quantized parameter gathers (ZeRO-3): int8 or float8_e4m3fn (docs/low_precision.md)")
    p.add_argument("--fp8", default=None, choices=("torchao",),
                   help="FP8 compute: the nn.Linears in torchao's Float8Linear (docs/low_precision.md#fp8-compute)")
    p.add_argument("--prefetch", type=int, default=None, metavar="N",
                   help="units gathered ahead (default: the rules file's OPTIONS, else 1)")
    p.add_argument("--min-unit-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="merge neighbouring units up to this size, e.g. 16MiB; 0: no merging (default: chosen from "
                        "the unit sizes and said under \"planner's choices\")")
    p.add_argument("--order", default=None, choices=("static", "dynamic"),
                   help="dynamic: units stay gathered until the forward ends (default: static)")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="free each unit's gathered parameters after its forward and gather again for the backward "
                        "(default: yes)")
    p.add_argument("--offload", default=None, choices=("optimizer", "params"),
                   help="CPU offload: master shards and optimizer state in host memory (optimizer), and parameter "
                        "shards too (params, ZeRO-3 only); device and host memory are both shown")
    p.add_argument("--offload-fraction", type=_fraction, default=None, metavar="F|auto",
                   help="offload only this share (0 < F <= 1) of the trainable buffers (default 1); auto: the "
                        "smallest that fits --device-memory")
    p.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                   help="device memory budget in GiB per device, for --offload-fraction auto")
    p.add_argument("--param-dtype", default=None, metavar="DTYPE",
                   help="store parameters in this dtype, e.g. fp32 (default: the model's)")
    p.add_argument("--compute-axes", default=None, metavar="AXES",
                   help="mesh axes that shard compute (tensor parallelism), e.g. tp (default: the rules file's "
                        "compute_axes)")
    p.add_argument("--trace-tokens", default=None, metavar="BxT",
                   help="trace the forward once with a (B, T) token tensor on the meta device, e.g. 1x4096: the "
                        "unit order it takes and the tensor-parallel activation bytes per step")
    if not views:
        return p
    p.add_argument("--rank", type=int, default=0, metavar="R", help="rank whose local shapes and memory are shown")
    p.add_argument("--summary", action="store_true", help="sizes, memory and bytes only: no per-parameter table")
    p.add_argument("--schedule", action="store_true", help="also print the op schedule")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (with memory and bytes per step)")
    p.add_argument("--explain", metavar="NAME", default=None, help="say which rule matches parameter NAME and why")
    return p


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="shardplan", description="Plan sharding of a model without launching anything.",
                                 epilog=MAIN_EXAMPLES, formatter_class=_Formatter, allow_abbrev=False)
    ap.add_argument("--version", action="version", version=f"shardplan {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = plan_options_parser()
    p = sub.add_parser("plan", parents=[common], help="print the plan for a model, mesh and rules", epilog=PLAN_EXAMPLES,
                       description="Print the plan of a model on a mesh: parameters, units, memory per rank, bytes\n"
                                   "per step, the planner's choices and its warnings.",
                       formatter_class=_Formatter, allow_abbrev=False)
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="also write the planned schedule as a Chrome trace to FILE (open it in ui.perfetto.dev): "
                        "its order and sizes at --trace-gbps, a picture of the plan, not a measurement")
    p.add_argument("--trace-gbps", type=float, default=100.0, metavar="GBPS",
                   help="link speed the --trace picture assumes, in GB/s")
    f = add_forecast(sub, common)  # `shardplan forecast`: the plan options, and its own (src/shardplan/forecast/cli.py)
    f.formatter_class, f.allow_abbrev, f.epilog = _Formatter, False, FORECAST_EXAMPLES
    f.description = textwrap.fill(f.description or "", 100)  # the examples keep their layout, so wrap this here
    f.add_argument("-h", "--help", action="help", help="show this help message and exit")  # the shared options have none
    h = add_rehearse(sub, plan_options_parser(views=False))  # `shardplan rehearse` (src/shardplan/rehearsal/cli.py)
    h.formatter_class, h.allow_abbrev, h.epilog = _Formatter, False, REHEARSE_EXAMPLES
    h.description = textwrap.fill(h.description or "", 100)
    h.add_argument("-h", "--help", action="help", help="show this help message and exit")
    r = sub.add_parser("rules", help="propose partition rules for a model (shardplan.auto_rules) as a rules file",
                       description="Print proposed partition rules and units as a Python rules file, which\n"
                                   "`shardplan plan --rules FILE` reads back.",
                       epilog=RULES_EXAMPLES, formatter_class=_Formatter, allow_abbrev=False)
    r.add_argument("target", help="path/to/file.py:fn, package.module:fn or hf:CONFIG (a config.json, a model "
                                  "folder, or a shipped config such as hf:llama3_8b)")
    r.add_argument("--mesh", required=True, metavar="AXES", help="axes, e.g. dp=8 or replica=2,shard=4")
    r.add_argument("--min-shard-bytes", type=parse_size, default="1MiB", metavar="SIZE",
                   help="replicate parameters below this size")
    return ap


def run_rules(args) -> str:
    import shlex
    mesh = Mesh.parse(args.mesh)
    model = build_model(args.target)
    source = auto_rules(model, mesh, min_shard_bytes=args.min_shard_bytes).to_source()
    target, axes = shlex.quote(args.target), shlex.quote(args.mesh)
    return (f"# proposed by: shardplan rules {target} --mesh {axes}\n"
            f"# plan with it: shardplan plan {target} --mesh {axes} --rules THIS_FILE\n\n" + source)


def plan_options(args, file: Optional[RulesFile]) -> dict:
    """Keywords of shardplan.plan: the defaults, then the rules file's OPTIONS, then the flags given."""
    opts = dict(file.options) if file else {}
    given = {"strategy": args.strategy, "compute_dtype": args.dtype, "reduce_dtype": args.reduce_dtype,
             "prefetch": args.prefetch, "min_unit_bytes": args.min_unit_bytes, "order": args.order,
             "reshard_after_forward": args.reshard_after_forward, "offload": args.offload,
             "offload_fraction": args.offload_fraction, "gather_dtype": getattr(args, "gather_dtype", None),
             "fp8": getattr(args, "fp8", None),
             "device_memory": None if getattr(args, "device_memory", None) is None else int(args.device_memory * 2**30)}
    if args.compute_axes is not None:
        given["compute_axes"] = tuple(a.strip() for a in args.compute_axes.split(",") if a.strip())
    opts.update({k: v for k, v in given.items() if v is not None})
    strategy = opts.get("strategy")
    if isinstance(strategy, str) and strategy.isdigit():
        opts["strategy"] = int(strategy)
    return opts


def run(args) -> str:
    if args.command == "rules":
        return run_rules(args)
    if args.command == "forecast":
        return run_forecast(args, run)
    if args.command == "rehearse":
        return run_rehearse(args, run, build_model)

    file = load_rules_file(args.rules) if args.rules else None
    if args.mesh is not None:
        mesh = Mesh.parse(args.mesh)
    elif file is not None and file.mesh is not None:
        mesh = file.mesh
    else:
        raise CliError("no mesh: pass --mesh, e.g. --mesh dp=8 or --mesh replica=2,shard=4"
                       + (f" (or define MESH in {file.path})" if file else ""))
    model = build_model(args.target, args.param_dtype)
    rules_obj = file.rules if file else auto_rules(model, mesh)
    if args.explain:
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        if args.explain not in names:
            close = [n for n in names if args.explain.split(".")[-1] in n][:5] or names[:5]
            raise CliError(f"{args.target} has no parameter {args.explain!r}; it has e.g. {close}")
        return explain(rules_obj, args.explain)
    units = args.units if args.units is not None else (file.units if file else None)  # None: the repeated blocks
    opts = plan_options(args, file)
    strategy_level(opts.get("strategy", "optim_grads_params"))
    if not 0 <= args.rank < mesh.size:
        raise CliError(f"--rank {args.rank} is outside the mesh's {mesh.size} ranks")
    if args.trace_tokens is not None:  # called as a training step calls it (targets too, where it takes them)
        opts["trace"] = token_inputs(model, trace_tokens(args.trace_tokens))
    p = plan(model, rules_obj, mesh, units=units, **opts)
    trace = getattr(args, "trace", None)  # `shardplan forecast` asks for the plan without --trace (its own is another)
    if trace:
        try:
            p.to_chrome_trace(trace, gbps=args.trace_gbps)
        except OSError as exc:
            raise CliError(f"--trace {trace}: cannot write it: {exc.strerror or exc}") from None
        print(f"shardplan: wrote the schedule's Chrome trace to {trace} (open it in ui.perfetto.dev)",
              file=sys.stderr)
    if args.json:
        d = to_dict(p)
        d["memory"] = vars(p.memory(args.rank)) | {"rank": args.rank}
        d["comm_bytes_per_step"] = p.comm_bytes(args.rank)
        return json.dumps(d, indent=1, sort_keys=True)
    out = render(p, rank=args.rank, max_rows=0 if args.summary else 100_000)
    if file is None and nothing_sharded(p):  # why: the automatic rules' threshold, and how to shard anyway
        biggest = max((p_.numel * itemsize(p_.dtype) for p_ in p.params), default=0)
        head, _, rest = out.partition("\n")
        out = (f"{head}\n(no --rules, so shardplan.auto_rules chose the specs: it replicates every parameter under "
               f"1 MiB, and this model's largest holds {fmt_bytes(biggest)}; pass --rules FILE, e.g. one written by "
               f"`shardplan rules {args.target} --mesh {args.mesh} --min-shard-bytes 0`)\n{rest}")
    if args.schedule:
        out += "\n\nschedule:\n" + render_schedule(p)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # [Note: only shardplan speaks] the installed extras log while they load (torchao: "Failed to load
    # _C_mxfp8...so" on a CPU build; torch's pytree: a deprecation of register_constant) and warn; the plan's
    # own warnings are printed in its table, so the CLI's output is shardplan's messages only
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            text = run(args)
    except (CliError, ShardingError) as exc:
        msg = str(exc).strip().replace("\n", " | ")
        print(f"shardplan: error: {msg}", file=sys.stderr)
        return 2
    finally:
        logging.disable(logging.NOTSET)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
