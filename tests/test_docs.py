"""The README and docs/ run as written, so they cannot drift from the code.

* Every fenced block whose info string starts with ``python`` in README.md and docs/*.md runs. A page's
  blocks run in order in one namespace (later blocks use earlier names), in a fresh working directory with
  the repository root importable (``from examples.gpt import build``).
* A page that needs a process group says so with an HTML comment anywhere on it,
  ``<!-- docs-test: N ranks -->``: its blocks then run in N processes under a real gloo group, as torchrun
  would start them (each block calls ``dist.init_process_group("gloo")`` itself).
* A block that cannot run here is preceded, on the line just above its fence, by
  ``<!-- no-test: WHY -->``; WHY must say what it needs (``needs megatron-fsdp and CUDA``), and such a
  block is skipped. Nothing else is skipped.
* Every ``shardplan ...`` line of a ```bash block (README, docs, and the examples in the CLI's own
  ``--help``) runs through the CLI in-process: they only plan, which is cheap. ``> FILE`` is honoured.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import shlex
import sys

import pytest

from distributed import run

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))

FENCE = re.compile(r"^(?P<marker><!--[^\n]*-->\n)?```(?P<info>[^\n]*)\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)
NO_TEST = re.compile(r"<!--\s*no-test:\s*(?P<why>.*?)\s*-->")
RANKS = re.compile(r"<!--\s*docs-test:\s*(\d+)\s+ranks?\b.*?-->")


def fenced(path: pathlib.Path, lang: str, lines: bool = False) -> list[tuple]:
    """``[(code, why it is not run or None)]`` of the page's blocks in language ``lang``, in order (with
    ``lines``: ``(code, why, the page's line number of the code's first line)``)."""
    out = []
    text = path.read_text()
    for m in FENCE.finditer(text):
        if m.group("info").split(" ")[0].strip() != lang:
            continue
        skip = NO_TEST.search(m.group("marker") or "")
        found = (m.group("code"), skip.group("why") if skip else None)
        out.append(found + (text.count("\n", 0, m.start("code")) + 1,) if lines else found)
    return out


def blocks(path: pathlib.Path, lang: str = "python") -> list[str]:
    """The blocks of ``path`` in ``lang`` that run (opted-out ones left out)."""
    return [code for code, why in fenced(path, lang) if why is None]


def page_code(path: pathlib.Path) -> str:
    """The page's python blocks that run, as one program whose line numbers are the page's."""
    code = ""
    for block, why, line in fenced(path, "python", lines=True):
        if why is None:
            code += "\n" * (line - 1 - code.count("\n")) + block
    return code


def ranks_of(path: pathlib.Path) -> int:
    m = RANKS.search(path.read_text())
    return int(m.group(1)) if m else 0


def _page_worker(rank, world, code, name, where):
    sys.path.insert(0, str(ROOT))
    os.chdir(where)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, name, "exec"), {"__name__": "__doc_page__"})
    return out.getvalue()


def run_page(path: pathlib.Path, where: pathlib.Path) -> list[str]:
    """Run a page's python blocks (in N processes when it says so); each process's stdout."""
    code = page_code(path)
    name = str(path)
    # [Note: a page without ranks runs in one forked process too, not in pytest's: rehearsals (a fake
    # process group), DTensor and meshes leave process-wide state behind (caches, a destroyed default
    # group) that later tests' forked workers would inherit]
    return run(_page_worker, ranks_of(path) or 1, code, name, str(where), init=False)


SLOW_PAGES = {"tensor_parallel.md"}   # 4 ranks: ~10 s on two cores


def _torch_fsdp2_runs_on_cpu() -> bool:
    import torch
    return hasattr(torch.cpu.current_stream(), "record_event")  # torch 2.6's FSDP2 needs it, and CPU streams lack it


NEEDS = {"migrating.md": (_torch_fsdp2_runs_on_cpu, "the page trains torch's own FSDP2 beside shardplan, and the "
                                                      "installed torch's FSDP2 cannot run on CPU")}


def _page_params():
    for path in PAGES:
        if not fenced(path, "python"):
            continue
        marks = [pytest.mark.slow] if path.name in SLOW_PAGES else []
        if path.name in NEEDS and not NEEDS[path.name][0]():
            marks.append(pytest.mark.skip(reason=NEEDS[path.name][1]))
        yield pytest.param(path, id=path.name, marks=marks)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", list(_page_params()))
def test_python_blocks_run(path, tmp_path):
    out = run_page(path, tmp_path)
    if path.name == "README.md":
        assert "shardplan optim_grads_params on Mesh(dp=2)" in out[0]
        assert "(slice(" in out[0], "local_slices must print the box rank 0 owns"
        assert (tmp_path / "ckpt" / ".metadata").exists()


def test_every_python_block_runs_or_says_why():
    """No page slips out of the tests: every python block is run, or opted out with a reason."""
    seen = 0
    for path in PAGES:
        for code, why in fenced(path, "python"):
            seen += 1
            if why is not None:
                assert len(why.split()) >= 2, f"{path.name}: a no-test marker must say why, got {why!r}"
        text = path.read_text()
        assert "```python" not in NO_TEST.sub("", text) or fenced(path, "python"), path
    assert seen >= 20
    # pages that call init_process_group must declare their ranks
    for path in PAGES:
        if "init_process_group" in "\n".join(blocks(path)):
            assert ranks_of(path) >= 2, f"{path.name} needs a process group: mark it <!-- docs-test: 2 ranks -->"


def test_snippets_run_outside_a_checkout():
    """A snippet pasted into one's own script runs after `pip install shardplan`: the pages import the example
    models from the package (`shardplan.models`), never from the checkout's examples/ (issue 39 item 1)."""
    for path in PAGES:
        for code, _ in fenced(path, "python"):
            assert not re.search(r"^\s*(from|import)\s+examples\b", code, re.M), f"{path.name}: {code[:200]}"
        for block in blocks(path, "bash"):
            for line in cli_lines(block):
                assert "examples/" not in line and "examples." not in line, f"{path.name}: {line}"
    from shardplan.cli import FORECAST_EXAMPLES, MAIN_EXAMPLES, PLAN_EXAMPLES, REHEARSE_EXAMPLES, RULES_EXAMPLES
    for text in (MAIN_EXAMPLES, PLAN_EXAMPLES, RULES_EXAMPLES, FORECAST_EXAMPLES, REHEARSE_EXAMPLES):
        assert "examples/" not in text and "examples." not in text.replace("examples:", ""), text


def test_the_markers_are_parsed(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: 2 ranks (gloo) -->\n\n```python\na = 1\n```\n\n<!-- no-test: needs CUDA here -->\n"
                    "```python megatron\nimport megatron\n```\n\n```bash\nshardplan --version\n```\n")
    assert fenced(page, "python") == [("a = 1\n", None), ("import megatron\n", "needs CUDA here")]
    assert blocks(page) == ["a = 1\n"] and ranks_of(page) == 2 and blocks(page, "bash") == ["shardplan --version\n"]


# -- shardplan command lines ------------------------------------------------------------------------------

def cli_lines(text: str) -> list[str]:
    out, pending = [], ""
    for line in text.splitlines():
        line = pending + line.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("shardplan "):
            out.append(line)
    return out


def _doc_cli_blocks() -> list[tuple[str, list[str]]]:
    """``[(where, the shardplan lines of one block)]``: README and docs bash blocks, the CLI's --help examples."""
    from shardplan.cli import FORECAST_EXAMPLES, MAIN_EXAMPLES, PLAN_EXAMPLES, RULES_EXAMPLES
    found = [(path.name, cli_lines(b)) for path in PAGES for b in blocks(path, "bash")]
    found += [("--help", cli_lines(text)) for text in (MAIN_EXAMPLES, PLAN_EXAMPLES, RULES_EXAMPLES, FORECAST_EXAMPLES)]
    return [(where, lines) for where, lines in found if lines]


SLOW_LINES = (("llama_70b",), ("llama3_70b",), ("mixtral_8x7b", "--trace"))  # a 70B plan, an 8x7B traced:
# seconds each (a line is slow when it holds every word of one entry)


def _line_params():
    for where, lines in _doc_cli_blocks():
        for i, line in enumerate(lines):
            # a line reads what earlier lines of its block wrote (`> FILE`): those run first
            before = [l for l in lines[:i] if " > " in l]
            marks = [pytest.mark.slow] if any(all(w in l for w in s) for l in before + [line] for s in SLOW_LINES) \
                else []
            yield pytest.param(before + [line], id=f"{where}: {line[10:70]}", marks=marks)


def run_cli_line(line: str, where: pathlib.Path) -> None:
    """Run one documented command line in ``where`` (the repository's examples/ linked in)."""
    words = shlex.split(line, comments=True)[1:]
    target = None
    if ">" in words:
        i = words.index(">")
        words, target = words[:i], words[i + 1]
    link = where / "examples"
    if not link.exists():
        link.symlink_to(ROOT / "examples")
    # [Note: in a forked process, not in pytest's: a rehearsal under tensor parallelism leaves DeviceMeshes
    # behind (DTensor specs keep them), and a later test's forked workers would compute with them]
    (code, out, err), = run(_cli_worker, 1, words, str(where), init=False)
    assert code == 0, f"{line}\n{err}"
    if target:
        (where / target).write_text(out)


def _cli_worker(rank, world, words, where):
    from shardplan.cli import main
    os.chdir(where)
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(words)
    return code, out.getvalue(), err.getvalue()


def test_cli_lines_are_found():
    lines = [line for _, block in _doc_cli_blocks() for line in block]
    assert len(lines) >= 10 and any("--trace " in l for l in lines) and any(" rules " in l for l in lines)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("lines", list(_line_params()))
def test_cli_lines_run(lines, tmp_path):
    for line in lines:
        run_cli_line(line, tmp_path)
