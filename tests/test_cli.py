"""The ``shardplan plan`` CLI: tables, JSON, explain, and exit code 2 with one line on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import shardplan as sp


def cli(*args):
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
              "--units", r"layers\.\d+", "--strategy", "2", "--json")
    assert out.returncode == 0, out.stderr
    plan = sp.Plan.from_json(out.stdout)
    assert plan.strategy == "optim_grads" and plan.mesh == sp.Mesh(replica=2, shard=2)
    assert json.loads(out.stdout)["units"][1]["name"] == "layers.0"


def test_explain_and_schedule():
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--rules", "examples/gpt_rules.py",
              "--explain", "layers.0.attention.wq.weight")
    assert out.returncode == 0 and "MATCHES" in out.stdout
    out = cli("plan", "examples/gpt.py:tiny", "--mesh", "dp=2", "--rules", "examples/gpt_rules.py", "--schedule")
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
