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


def cli_process(*args):
    return subprocess.run([sys.executable, "-m", "shardplan", *args], capture_output=True, text=True, timeout=120)


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
    with __import__("pytest").raises(sp.MeshError, match="twice"):
        sp.Mesh.parse("dp=2,dp=4")
    out = subprocess.run(["shardplan", "plan", "examples.gpt:tiny", "--mesh", "replica=2,shard=2",
                          "--rules", "examples/gpt_rules.py:HSDP_RULES", "--min-unit-bytes", "1MiB", "--summary"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "layers.0.attention.wq.weight" not in out.stdout and "memory on rank 0" in out.stdout
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--rules", "examples/gpt_rules.py", "--json")
    d = json.loads(out.stdout)
    assert d["memory"]["peak"] > 0 and d["comm_bytes_per_step"]["total"] > 0
    assert sp.Plan.from_json(out.stdout).mesh == sp.Mesh(dp=2)
    version = cli_process("--version")
    assert version.returncode == 0 and sp.__version__ in version.stdout


def test_import_is_quiet_without_numpy():
    """numpy is no dependency: importing shardplan where it is missing prints nothing."""
    code = "import sys; sys.modules['numpy'] = None; import shardplan"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr
