"""The snippets in docs/ and the README run as written: python blocks (those that need a process group
under a real 2-rank gloo group), and the README's `shardplan plan` lines."""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import shlex

import pytest

from distributed import run

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def blocks(path: pathlib.Path, lang: str = "python") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("name", ["rules.md", "plans.md", "schedule.md", "architecture.md", "forecast.md"])
def test_doc_snippets_run(name, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))   # snippets import examples/ as the README does
    monkeypatch.chdir(ROOT)
    found = blocks(DOCS / name)
    assert found, f"{name} has no python snippet"
    namespace: dict = {}  # one page is one session: later snippets use earlier names
    for code in found:
        exec(compile(code, f"docs/{name}", "exec"), namespace)


def _readme_worker(rank, world, code, where):
    import sys
    sys.path.insert(0, str(ROOT))
    os.chdir(where)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    return out.getvalue()


@pytest.mark.timeout(200)
def test_functional_doc_runs_on_two_ranks(tmp_path):
    code = "\n".join(blocks(DOCS / "functional.md"))
    assert "value_and_grad" in code
    run(_readme_worker, 2, code, str(tmp_path), init=False)


@pytest.mark.timeout(200)
def test_migrating_doc_runs_on_two_ranks(tmp_path):
    code = "\n".join(blocks(DOCS / "migrating.md"))   # Megatron-FSDP's own snippet is fenced apart: not run
    assert "fully_shard_model" in code and "from torch.distributed.fsdp import fully_shard" in code
    run(_readme_worker, 2, code, str(tmp_path), init=False)


@pytest.mark.timeout(200)
def test_tensor_parallel_doc_runs_on_four_ranks(tmp_path):
    code = "\n".join(blocks(DOCS / "tensor_parallel.md"))
    assert "compute_axes" in code and "data_index" in code
    run(_readme_worker, 4, code, str(tmp_path), init=False)
    from shardplan.cli import main
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for line in (l.strip() for b in blocks(DOCS / "tensor_parallel.md", "bash") for l in b.splitlines()):
            if line.startswith("shardplan plan"):
                with contextlib.redirect_stdout(io.StringIO()):
                    assert main(shlex.split(line)[1:]) == 0, line
    finally:
        os.chdir(cwd)


@pytest.mark.timeout(200)
def test_readme_example_runs_on_two_ranks(tmp_path):
    code = blocks(ROOT / "README.md")[0]
    out = run(_readme_worker, 2, code, str(tmp_path), init=False)
    assert "shardplan optim_grads_params on Mesh(dp=2)" in out[0]
    assert "(slice(" in out[0], "local_slices must print the box rank 0 owns"
    assert (tmp_path / "ckpt" / ".metadata").exists()


def test_readme_cli_lines_run():
    from shardplan.cli import main
    lines = [l.strip() for b in blocks(ROOT / "README.md", "bash") for l in b.splitlines()
             if l.strip().startswith("shardplan plan")]
    assert len(lines) >= 2
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for line in lines:
            with contextlib.redirect_stdout(io.StringIO()):
                assert main(shlex.split(line, comments=True)[1:]) == 0, line
    finally:
        os.chdir(cwd)
