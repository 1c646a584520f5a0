"""The ``shardplan plan`` CLI: tables, JSON, explain, and exit code 2 with one line on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import shardplan as sp


def cli(*args):
    """Run the CLI in this process (imports are the slow part of a subprocess); same exit code and streams."""
    import contextlib
    import io
    import types
    from shardplan.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: --version, usage errors
            code = exc.code
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_70b_table_at_dp64():
    out = cli("plan", "examples/gpt.py:llama_70b", "--mesh", "dp=64", "--rules", "examples/gpt_rules.py", "--dtype", "bf16")
    assert out.returncode == 0, out.stderr
    for needle in ("layers.79.feed_forward.w2.weight", "memory on rank 0", "sent per step per rank", "81 units"):
        assert needle in out.stdout


def test_json_round_trips_and_hsdp_mesh(tmp_path):
    rules = tmp_path / "rules.py"
    rules.write_text("from shardplan import P\nrules = [(r'.*norm.*', P()), (r'.*', P('shard'))]\n")
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "replica=2,shard=2", "--rules", str(rules),
              "--units", r"layers\.\d+", "--strategy", "2", "--json", "--min-unit-bytes", "0")
    assert out.returncode == 0, out.stderr
    plan = sp.Plan.from_json(out.stdout)
    assert plan.strategy == "optim_grads" and plan.mesh == sp.Mesh(replica=2, shard=2)
    assert json.loads(out.stdout)["units"][1]["name"] == "layers.0"


def test_explain_and_schedule():
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--rules", "examples/gpt_rules.py",
              "--explain", "layers.0.attention.wq.weight")
    assert out.returncode == 0 and "MATCHES" in out.stdout
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--rules", "examples/gpt_rules.py", "--schedule",
              "--min-unit-bytes", "0")
    assert "reduce_scatter" in out.stdout and " prefetch" in out.stdout and "wait params" in out.stdout
    assert "post_backward(layers.1):" in out.stdout  # ops are listed under the event that triggers them


def test_bad_input_exits_2_with_one_line(tmp_path):
    cases = [
        ("plan", "examples/gpt.py:missing", "--mesh", "dp=2", "--rules", "examples/gpt_rules.py"),
        ("plan", "examples/gpt.py:tiny", "--mesh", "dp=two", "--rules", "examples/gpt_rules.py"),
        ("plan", "examples/gpt.py:tiny", "--mesh", "tp=2", "--rules", "examples/gpt_rules.py"),
        ("plan", "nowhere.py:fn", "--mesh", "dp=2", "--rules", "examples/gpt_rules.py"),
        ("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--rules", "examples/gpt_rules.py", "--strategy", "zero7"),
        ("plan", "examples/gpt.py", "--mesh", "dp=2", "--rules", "examples/gpt_rules.py"),
    ]
    for args in cases:
        out = cli(*args)
        assert out.returncode == 2, (args, out.stderr)
        lines = [l for l in out.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("shardplan: error:"), (args, out.stderr)
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "tp=2", "--rules", "examples/gpt_rules.py")
    assert "tok_embeddings.weight" in out.stderr and "'tp'" in out.stderr


def test_new_user_rough_edges(tmp_path):
    """Issue 10's list: duplicate axes, raising callables, --explain of a missing name, module targets
    from the repository root, --rules FILE:NAME, --json figures, --version, --summary, size strings."""
    bad = [
        ("plan", "examples/gpt.py:tiny", "--mesh", "dp=2,dp=4", "--rules", "examples/gpt_rules.py"),
        ("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--rules", "examples/gpt_rules.py", "--explain", "no.such"),
        ("plan", "nowhere.py:fn", "--mesh", "dp=2", "--rules", "examples/gpt_rules.py", "--explain", "x"),
        ("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--rules", "examples/gpt_rules.py:NOPE"),
    ]
    raising = tmp_path / "raising.py"
    raising.write_text("def spec(path, leaf):\n    raise ValueError('boom')\nrules = [(r'.*', spec)]\n")
    bad.append(("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--rules", str(raising)))
    errs = []
    for args in bad:
        out = cli(*args)
        lines = [l for l in out.stderr.splitlines() if l.strip()]
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("shardplan: error:"), (args, out.stderr)
        errs.append(out.stderr)
    assert "given twice" in errs[0] and "no parameter 'no.such'" in errs[1]
    assert "rule #0" in errs[4] and "boom" in errs[4] and "tok_embeddings.weight" in errs[4]
    with __import__("pytest").raises(sp.errors.MeshError, match="twice"):
        sp.Mesh.parse("dp=2,dp=4")
    out = cli("plan", "examples.gpt:tiny", "--mesh", "replica=2,shard=2",
              "--rules", "examples/gpt_rules.py:HSDP_RULES", "--min-unit-bytes", "1MiB", "--summary")
    assert out.returncode == 0, out.stderr
    assert "layers.0.attention.wq.weight" not in out.stdout and "memory on rank 0" in out.stdout
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--rules", "examples/gpt_rules.py", "--json")
    d = json.loads(out.stdout)
    assert d["memory"]["peak"] > 0 and d["comm_bytes_per_step"]["total"] > 0
    assert sp.Plan.from_json(out.stdout).mesh == sp.Mesh(dp=2)
    version = subprocess.run(["shardplan", "--version"], capture_output=True, text=True, timeout=120)  # the entry point
    assert version.returncode == 0 and sp.__version__ in version.stdout


def _imports_after(*args) -> set:
    """The modules a fresh interpreter holds after running ``shardplan ARGS`` (``--help`` exits: caught)."""
    code = ("import runpy, sys\nsys.argv = ['shardplan', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('shardplan', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('MODULES', ' '.join(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    line = [l for l in out.stdout.splitlines() if l.startswith("MODULES ")]
    assert line, out.stderr
    return set(line[0].split()[1:])


def test_help_and_version_answer_without_importing_torch():
    """torch is what makes a start slow (seconds): --help and --version never import it."""
    for args in (("--help",), ("--version",), ("plan", "--help"), ("rules", "--help"), ("forecast", "--help")):
        mods = _imports_after(*args)
        assert "torch" not in mods and "shardplan.cli" in mods, args


LAZY_CHECK = """
import contextlib, io, sys
sys.modules["numpy"] = None        # numpy is no dependency: without it, nothing is printed either
import shardplan as sp
assert "torch" not in sys.modules
assert callable(sp.plan) and sp.plan.__module__ == "shardplan.planner.compiler"
from shardplan.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--summary"]) == 0
mods = [m for m in sys.modules if m.startswith("shardplan")]
assert "torch" in sys.modules and "shardplan.planner.render" in mods and callable(sp.plan)
assert not [m for m in mods if m.startswith(("shardplan.runtime", "shardplan.dropin", "shardplan.tree",
                                             "shardplan.optim"))], mods    # `plan` imports the planner only
assert callable(sp.shard) and sp.checkpoint.save and sp.optim.adamw and sp.runtime.api
assert set(sp.__all__) <= set(dir(sp))
from shardplan import *
assert fully_shard and value_and_grad
"""


def test_lazy_top_level_names_and_what_plan_imports():
    """`import shardplan` is the planner (no torch); the runtime's names import on first use; `shardplan
    plan` imports torch (to build the model) and the planner, not the runtime; all of it quietly."""
    out = subprocess.run([sys.executable, "-c", LAZY_CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr
    import pytest
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        sp.nope


def test_help_shows_defaults_and_examples_and_takes_no_abbreviations(tmp_path):
    out = cli("plan", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for needle in ("(default: 100.0)", "(default: 0)", "default: the rules file's OPTIONS, else optim_grads_params",
                   "examples:", "shardplan plan shardplan.models.gpt:llama_70b", "--trace plan_trace.json"):
        assert needle in text, needle
    assert "(default: None)" not in text and "(default: False)" not in text
    out = cli("rules", "--help")
    assert "(default: 1MiB)" in out.stdout and out.stdout.count("shardplan ") >= 3
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--trac", str(tmp_path / "t.json"))
    assert out.returncode == 2 and "unrecognized arguments: --trac" in out.stderr  # no abbreviation of --trace
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--trace-tok", "1x8")
    assert out.returncode == 2


def test_trace_writes_the_chrome_trace(tmp_path):
    path = tmp_path / "plan.json"
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--rules", "examples/gpt_rules.py", "--summary",
              "--trace", str(path), "--min-unit-bytes", "0")
    assert out.returncode == 0, out.stderr
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert events and events[0]["name"] == "all_gather <root>" and str(path) in out.stderr
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--trace", str(tmp_path / "no" / "dir.json"))
    assert out.returncode == 2 and "cannot write" in out.stderr


def _same_plan(a: str, b: str) -> bool:
    """Two `--json` outputs describe the same plan: equal up to the rules' wording and the notes."""
    pa, pb = sp.Plan.from_json(a), sp.Plan.from_json(b)
    return pa.equivalent(pb)


def test_printed_rules_load_back_and_give_the_same_plan(tmp_path):
    """`shardplan rules` -> a file -> `shardplan plan --rules FILE` is the plan `shardplan plan` makes alone."""
    for target, mesh in (("examples/gpt.py:tiny", "dp=4"), ("hf:examples/hf/mixtral_8x7b.json", "replica=2,shard=4")):
        printed = cli("rules", target, "--mesh", mesh)
        assert printed.returncode == 0 and "UNITS = [" in printed.stdout, printed.stderr
        path = tmp_path / "rules.py"
        path.write_text(printed.stdout)
        via_file = cli("plan", target, "--mesh", mesh, "--rules", str(path), "--json")
        alone = cli("plan", target, "--mesh", mesh, "--json")
        assert via_file.returncode == 0 and alone.returncode == 0, via_file.stderr + alone.stderr
        assert _same_plan(via_file.stdout, alone.stdout), target


def test_plan_to_source_loads_back_in_the_cli(tmp_path):
    """plan.to_source() is a rules file: no edits, no --mesh, the same plan (units, options, tensor parallelism)."""
    import torch
    sys.path.insert(0, "examples")
    try:
        import gpt
        import gpt_rules_tp
    finally:
        sys.path.pop(0)
    with torch.device("meta"):
        model = gpt.tiny()
    plans = [
        sp.plan(model, sp.auto_rules(model, sp.Mesh(dp=2)), sp.Mesh(dp=2)),  # automatic units, merged
        sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=4), units=[r"layers\.1"], strategy="optim_grads",
                prefetch=2, min_unit_bytes=0, compute_dtype="bf16", reshard_after_forward=False, layout="chunked"),
        sp.plan(model, gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2), compute_axes=("tp",), units=gpt_rules_tp.UNITS,
                order="dynamic"),
    ]
    for i, plan in enumerate(plans):
        src = plan.to_source()
        assert "UNITS = [" in src and "MESH = sp.Mesh(" in src and "OPTIONS = dict(" in src
        path = tmp_path / f"plan{i}.py"
        path.write_text(src)
        out = cli("plan", "examples/gpt.py:tiny", "--rules", str(path), "--json")
        assert out.returncode == 0, (src, out.stderr)
        assert plan.equivalent(sp.Plan.from_json(out.stdout)), src
        ns: dict = {}
        exec(compile(src, str(path), "exec"), ns)
        assert plan.equivalent(ns["make_plan"](model))
    out = cli("plan", "examples/gpt.py:tiny", "--rules", str(tmp_path / "plan1.py"), "--strategy", "optim",
              "--mesh", "dp=2", "--json")  # flags override the file
    back = sp.Plan.from_json(out.stdout)
    assert back.strategy == "optim" and back.mesh == sp.Mesh(dp=2) and back.prefetch == 2
    out = cli("plan", "examples/gpt.py:tiny", "--rules", "examples/gpt_rules.py")
    assert out.returncode == 2 and "no mesh: pass --mesh" in out.stderr
    bad = tmp_path / "bad.py"
    bad.write_text("rules = [('.*', None)]\nOPTIONS = dict(stratgy='optim')\n")
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--rules", str(bad))
    assert out.returncode == 2 and "stratgy" in out.stderr and "'strategy'" in out.stderr


def test_unit_lists_sort_naturally_and_merging_is_described():
    from shardplan.units import natural_sorted
    assert natural_sorted(["layers.10", "layers.2", "layers.1.mlp", "emb"]) == ["emb", "layers.1.mlp", "layers.2",
                                                                                 "layers.10"]
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--summary")
    text = " ".join(out.stdout.split())
    assert "units kept as given: merging 2 blocks of 0.157 MiB would leave fewer than 8 units" in text, text
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--summary", "--min-unit-bytes", str(2 ** 24))
    text = " ".join(out.stdout.split())
    assert "merged 2 blocks into 1 unit of 2 blocks" in text and "target 16 MiB, more than all 2 blocks hold" in text
    assert "merged to at least" not in text


# -- issue 39: snippets outside a checkout, and a newcomer's rough edges (items 1, 10-13) ----------------------

def test_shipped_models_rules_and_configs_run_outside_a_checkout(tmp_path, monkeypatch):
    """`shardplan.models` ships the example GPT, its rules and the Hugging Face configs: the --help examples
    run from any directory (no examples/ there), and examples/*.py re-export the same objects."""
    from shardplan.cli_inputs import bundled_hf_configs
    monkeypatch.chdir(tmp_path)
    out = cli("plan", "shardplan.models.gpt:tiny", "--mesh", "replica=2,shard=2",
              "--rules", "shardplan.models.gpt_rules:HSDP_RULES", "--summary")
    assert out.returncode == 0 and "Mesh(replica=2, shard=2)" in out.stdout, out.stderr
    out = cli("plan", "hf:llama3_8b", "--mesh", "dp=8", "--summary")
    assert out.returncode == 0 and "291 parameters" in out.stdout, out.stderr
    assert bundled_hf_configs() == ["gpt2_tiny", "llama3_70b", "llama3_8b", "mixtral_8x7b", "qwen2_7b"]
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    try:
        import examples.gpt
        import examples.gpt_rules
        import shardplan.models.gpt
        import shardplan.models.gpt_rules
    finally:
        sys.path.pop(0)
    assert examples.gpt.Block is shardplan.models.gpt.Block and examples.gpt.build is shardplan.models.gpt.build
    assert examples.gpt_rules.HSDP_RULES is shardplan.models.gpt_rules.HSDP_RULES


def test_hf_targets_folders_bad_json_and_typos(tmp_path):
    """hf:DIR (a model folder), hf: JSON errors said in one line, misspelt functions and axes get a suggestion."""
    folder = tmp_path / "my-llama"
    folder.mkdir()
    cfg = json.load(open(sp.models.__path__[0] + "/hf/llama3_8b.json"))
    cfg.update(num_hidden_layers=2, architectures=["LlamaForCausalLM"], transformers_version="4.40.0")
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text("{}")
    out = cli("plan", f"hf:{folder}", "--mesh", "dp=8", "--summary")
    assert out.returncode == 0 and "model.layers.1" in out.stdout, out.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "llama",}')
    cases = {
        ("plan", f"hf:{bad}", "--mesh", "dp=8"): ["is not valid JSON", "line 1"],
        ("plan", f"hf:{tmp_path}", "--mesh", "dp=8"): ["holds no config.json"],
        ("plan", "hf:llama3_8", "--mesh", "dp=8"): ["did you mean 'llama3_8b'?", "hf:mixtral_8x7b"],
        ("plan", "shardplan.models.gpt:llama70b", "--mesh", "dp=8"): ["did you mean 'llama_70b'?", "'tiny'"],
        ("plan", "shardplan.models.gpt:tiny", "--mesh", "dq=2", "--rules", "shardplan.models.gpt_rules"):
            ["did you mean 'dq'?"],
        ("plan", "shardplan.models.gpt:tiny", "--mesh", "dp=2,tp=2", "--compute-axes", "tq"): ["did you mean 'tp'?"],
    }
    for args, needles in cases.items():
        out = cli(*args)
        lines = [l for l in out.stderr.splitlines() if l.strip()]
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("shardplan: error:"), (args, out.stderr)
        for needle in needles:
            assert needle in out.stderr, (args, needle, out.stderr)


def test_missing_targets_are_said_before_torch_loads(tmp_path):
    """A missing file or config is found without importing torch (3-4 s): the process never loads it."""
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    code = ("import sys; from shardplan.cli import main\n"
            f"codes = [main(a) for a in (['plan', 'nowhere.py:fn', '--mesh', 'dp=2'], ['plan', 'hf:nowhere.json', "
            f"'--mesh', 'dp=2'], ['plan', 'hf:{bad}', '--mesh', 'dp=2'], ['rules', 'nowhere.py:fn', '--mesh', 'dp=2'])]\n"
            "print(codes, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[2, 2, 2, 2] False", out.stdout + out.stderr


def test_nothing_sharded_is_said_with_the_reason():
    out = cli("plan", "shardplan.models.gpt:tiny", "--mesh", "dp=8", "--summary")
    head = out.stdout.splitlines()[:3]
    assert out.returncode == 0 and "auto_rules" in head[1] and "1 MiB" in head[1] and "64.00 KiB" in head[1], head
    assert head[2].startswith("nothing is sharded") and "as under no_shard" in head[2], head
    out = cli("plan", "shardplan.models.gpt:tiny", "--mesh", "dp=8", "--rules", "shardplan.models.gpt_rules", "--summary")
    assert out.returncode == 0 and "nothing is sharded" not in out.stdout and "auto_rules" not in out.stdout
    import torch.nn as nn
    plan = sp.plan(nn.Linear(8, 8), [(r".*", sp.P())], sp.Mesh(dp=4))
    assert "nothing is sharded" in str(plan) and "P('dp')" in str(plan)
    assert "nothing is sharded" not in str(sp.plan(nn.Linear(8, 8), [(r".*", sp.P())], sp.Mesh(dp=4), strategy=0))


def test_optimizer_states_are_counted_in_the_parameters_dtype():
    """torch's AdamW keeps bf16 states for bf16 parameters: the plan counts them so and suggests fp32 masters;
    fp32 plans are unchanged (8 bytes per element, no warning)."""
    import torch
    import torch.nn as nn
    rules, mesh = [(r".*", sp.P("dp"))], sp.Mesh(dp=4)
    fp32 = sp.plan(nn.Linear(64, 64, bias=False), rules, mesh)
    bf16 = sp.plan(nn.Linear(64, 64, bias=False).to(torch.bfloat16), rules, mesh)
    masters = sp.plan(nn.Linear(64, 64, bias=False), rules, mesh, compute_dtype="bf16")
    assert fp32.memory(0).optimizer == 64 * 64 // 4 * 2 * 4 == masters.memory(0).optimizer
    assert bf16.memory(0).optimizer == 64 * 64 // 4 * 2 * 2
    assert "(2 fp32 states)" in str(fp32) and "fp32 master" not in str(fp32) and "fp32 master" not in str(masters)
    text = str(bf16)
    assert "(2 bf16 states)" in text and "no fp32 master weights" in text and "--param-dtype fp32 --dtype bf16" in text
    assert fp32.warnings == bf16.warnings == ()  # said in the table only: plan JSON and fingerprints keep their values


def test_cli_output_is_shardplans_only(monkeypatch, caplog):
    """The extras' log lines (torchao's "Failed to load ...so", torch's pytree deprecations) are not printed."""
    import logging
    import shardplan.hf as H
    real = H.model_from_config

    def noisy(*a, **k):
        logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so")
        logging.getLogger("torch.utils._pytree").warning("register_constant() on Enum subclasses is deprecated")
        return real(*a, **k)

    monkeypatch.setattr(H, "model_from_config", noisy)
    with caplog.at_level(logging.WARNING):
        out = cli("plan", "hf:llama3_8b", "--mesh", "dp=8", "--summary")
    assert out.returncode == 0 and out.stderr == "" and not caplog.records, (out.stderr, caplog.records)
    assert logging.getLogger("torchao").isEnabledFor(logging.WARNING)  # restored after the command
