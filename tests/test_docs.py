"""The snippets in docs/ run as written (those that need no torchrun)."""

from __future__ import annotations

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def blocks(name):
    text = (DOCS / name).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("name", ["rules.md", "plans.md", "schedule.md"])
def test_doc_snippets_run(name, capsys):
    found = blocks(name)
    assert found, f"{name} has no python snippet"
    namespace: dict = {}  # one page is one session: later snippets use earlier names
    for code in found:
        exec(compile(code, f"docs/{name}", "exec"), namespace)
