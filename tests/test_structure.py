"""The package's import graph: no module of ``shardplan.planner`` takes part in an import cycle, and (once the
runtime's cycle is gone) no module of ``shardplan`` does. Imports are read with ``ast`` at any depth (inside
functions too, where cycles hide), except those under ``if TYPE_CHECKING:`` (annotations only)."""

from __future__ import annotations

import ast
from pathlib import Path


SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "shardplan"


def modules() -> dict[str, Path]:
    """{dotted module name: file} for every module of the package (a package is its ``__init__``)."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST):
    """Every Import / ImportFrom below ``node``, skipping the bodies of ``if TYPE_CHECKING:`` (not their else)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports_of(other)
            continue
        yield from _imports_of(child)


def _imports_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _imports(node)


def edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """{module: modules of the package it imports}; ``from X import name`` counts ``X.name`` if that is a module."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = here[:len(here) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # `from X import name`: the module X.name if there is one, else X itself. [Note: X is then a
                # package already being imported (the parent of X.name), not a dependency of its own]
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
            for t in targets:
                while t and t not in mods and "." in t:  # `import shardplan.planner.x.y`: the deepest module named
                    t = t.rpartition(".")[0]
                if t in mods and t != mod:
                    graph[mod].add(t)
                # [Note: importing shardplan.runtime.collectives runs shardplan/runtime/__init__.py first: a package
                # above the target is a dependency too, unless it is one of the importer's own packages]
                while "." in t and t.count(".") > 1:
                    t = t.rpartition(".")[0]
                    if t in mods and not f"{mod}.".startswith(f"{t}."):
                        graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(comps: list[list[str]], graph) -> str:
    lines = []
    for comp in comps:
        inside = set(comp)
        lines.append(" <-> ".join(comp) + ": " + "; ".join(
            f"{m} -> {sorted(graph[m] & inside)}" for m in comp))
    return "\n".join(lines)


def test_the_walker_sees_function_level_imports_and_skips_type_checking(tmp_path):
    code = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import X\nelse:\n    from .c import Y\n"
            "def f():\n    from . import d\n")
    found = [(n.level, n.module, [a.name for a in n.names]) for n in _imports(ast.parse(code))]
    assert found == [(0, "typing", ["TYPE_CHECKING"]), (1, "c", ["Y"]), (1, None, ["d"])]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_plan_package_has_no_import_cycle():
    graph = edges(modules())
    assert "shardplan.planner.facade" in graph and "shardplan.planner.values" in graph["shardplan.planner.facade"]
    bad = [c for c in cycles(graph) if any(m.startswith(f"{PACKAGE}.planner.") or m == f"{PACKAGE}.planner" for m in c)]
    assert not bad, "import cycles through shardplan.planner:\n" + _describe(bad, graph)


# the planner's layers, bottom up: a module imports (at run time) only modules of ``plan`` in lower layers,
# or pure-function neighbours in its own layer (the cycle test above keeps those acyclic); above the function
# modules, the facade (``Plan``: a frozen dataclass whose methods call them), then the compiler
LAYERS = (("kinds",), ("values", "ops"),
          ("heads", "float8", "axis", "tp_styles", "tp_partial", "tensor_parallel", "expert_parallel", "context_parallel",
           "axes", "geometry", "offload", "schedule", "validate", "accounting", "serialize", "capture", "options",
           "grouping", "passes", "transforms", "rebuild", "render"),
          ("facade",), ("compiler",), ("",))

# the floor below the planner: the language (specs, meshes, rules, layouts, dtypes, quantized formats), the
# module walks and the tracers the planner calls (units, activations, optraffic) and the automatic choices
BELOW_PLAN = ("flow", "flow_rules", "flow_marks", "flow_products", "flow_index", "flow_tokens", "metatrace", "errors", "dtypes", "spec", "mesh", "layout", "lowp", "rules", "units", "auto", "activations", "step_call",
              "optraffic")


def test_plan_modules_are_layered():
    """Values at the bottom (``kinds``, then ``values``: no function module); function modules import values,
    never the facade; the facade (``Plan`` itself) above them, the compiler above it."""
    graph = edges(modules())
    layer = {f"{PACKAGE}.planner" + (f".{m}" if m else ""): k for k, names in enumerate(LAYERS) for m in names}
    assert set(layer) == {m for m in graph if m == f"{PACKAGE}.planner" or m.startswith(f"{PACKAGE}.planner.")}, \
        "a new module of shardplan.planner: give it a layer in LAYERS"
    for mod, k in layer.items():
        for dep in graph[mod]:
            if dep in layer:
                ok = layer[dep] < k or (layer[dep] == k and k == 2)
                assert ok, f"{mod} (layer {k}) imports {dep} (layer {layer[dep]})"


def test_plan_imports_nothing_above_it():
    """``shardplan.planner`` imports only itself and the floor below it (``BELOW_PLAN``), and that floor imports
    neither the planner nor anything above it (at any depth: function-level imports count)."""
    graph = edges(modules())
    below = {f"{PACKAGE}.{m}" for m in BELOW_PLAN}
    plan = {m for m in graph if m == f"{PACKAGE}.planner" or m.startswith(f"{PACKAGE}.planner.")}
    assert below <= set(graph)
    up = sorted((m, d) for m in plan for d in graph[m] - plan - below)
    assert not up, "shardplan.planner imports modules above it (forecast, runtime, ...): " + repr(up)
    up = sorted((m, d) for m in below for d in graph[m] - below)
    assert not up, "the floor below shardplan.planner imports the planner or above: " + repr(up)


def test_whole_package_has_no_import_cycle():
    graph = edges(modules())
    bad = cycles(graph)
    assert not bad, "import cycles:\n" + _describe(bad, graph)


# ---- the public surface -----------------------------------------------------------------------------------

PUBLIC_MODULES = {"checkpoint", "optim", "metrics", "forecast", "expert_parallel", "context_parallel", "errors"}
SURFACE_BUDGET = 41


def _public_names() -> list[str]:
    import subprocess
    import sys
    code = "import json, shardplan; print(json.dumps([n for n in dir(shardplan) if not n.startswith('_')]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(SRC), "PATH": ""})
    import json
    return json.loads(out.stdout)


def test_dir_shardplan_is_the_small_surface():
    """``dir(shardplan)`` is ``__all__``: at most SURFACE_BUDGET names, and the only modules in it are the
    subpackages meant to be used (no leaked ``mesh``, ``units``, ``dtypes``, ...)."""
    import shardplan
    names = _public_names()
    assert sorted(names) == sorted(shardplan.__all__)
    assert len(names) <= SURFACE_BUDGET, f"{len(names)} public names (budget {SURFACE_BUDGET}): {names}"
    mods = {n for n in names if type(getattr(shardplan, n)).__name__ == "module"}
    assert mods == PUBLIC_MODULES, f"modules in dir(shardplan): {sorted(mods)}"


def test_no_name_is_kept_for_history():
    """One name per thing: no compatibility table at the top level, no import alias for the planner's old package
    name, no mixin in ``Plan``'s bases; names that moved are read from their subpackage."""
    import subprocess
    import sys
    import shardplan
    from shardplan.planner.facade import Plan
    assert not hasattr(shardplan, "_MOVED") and Plan.__bases__ == (object,) and "__setstate__" not in vars(Plan)
    for name in ("PlanError", "state_dict", "Op", "Precision", "tp_modules"):
        assert not hasattr(shardplan, name), name
    code = ("import shardplan, sys\n"
            "try:\n    import shardplan.plan.render\nexcept ImportError:\n    pass\n"
            "else:\n    raise SystemExit('shardplan.plan.render imported')\n"
            "assert not any(type(f).__name__ == '_PlannerAlias' or getattr(f, '__name__', '') == '_PlannerAlias' "
            "for f in sys.meta_path)\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": str(SRC), "PATH": ""}, timeout=120)


def test_the_planner_never_imports_the_forecast():
    """Not even for annotations (``if TYPE_CHECKING:`` counts here): the forecast sits above the planner."""
    mods = modules()
    found = []
    for mod, path in mods.items():
        if not (mod == f"{PACKAGE}.planner" or mod.startswith(f"{PACKAGE}.planner.")):
            continue
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1]) if node.level else ""
                names = [".".join(x for x in (base, node.module or "") if x)]
                names += [f"{names[0]}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{path.name}:{node.lineno}"] if any(n.startswith(f"{PACKAGE}.forecast") for n in names) else []
    assert not found, f"the planner imports the forecast: {found}"


def test_the_forecast_reads_no_private_attribute():
    """The forecast reads plans through their public fields and methods and the planner's functions: no
    ``x._name`` of anything but its own objects (``self``)."""
    found = []
    for path in sorted((SRC / PACKAGE / "forecast").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, f"the forecast reads private attributes: {found}"


def _has_example(doc: str) -> bool:
    return ">>>" in doc or "::\n" in doc


def test_every_public_name_is_typed_with_a_docstring_and_an_example():
    import inspect
    import types
    import shardplan
    bad = []
    for name in shardplan.__all__:
        obj = getattr(shardplan, name)
        doc = inspect.getdoc(obj) or ""
        if not _has_example(doc):
            bad.append(f"{name}: no docstring with an example (>>> or a :: block)")
        if isinstance(obj, types.ModuleType) or not callable(obj):
            continue
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        untyped = [p.name for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty
                   and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"]
        if untyped:
            bad.append(f"{name}: untyped parameters {untyped}")
        if not isinstance(obj, type) and sig.return_annotation is inspect.Signature.empty:
            bad.append(f"{name}: no return annotation")
    assert not bad, "\n".join(bad)


def test_the_op_docstring_names_every_kind_and_subject():
    from shardplan.planner.kinds import OpKind, Subject
    from shardplan.planner.ops import Op
    doc = " ".join(Op.__doc__.split())
    missing = [m.value for m in (*OpKind, *Subject) if m.value not in doc]
    assert not missing, f"Op's docstring does not name {missing}"


def test_every_module_is_on_the_map():
    """docs/architecture.md names every module of ``src/`` (as `` `name.py` ``) in the section of its package:
    ``## ... (`src/shardplan/planner/`)`` for ``planner/``, ``(`src/shardplan/`)`` for the top level; a module of a
    subpackage of these (``runtime/checkpoint/``) in its parent's section."""
    import re
    text = (SRC.parent / "docs" / "architecture.md").read_text()
    sections: dict[str, str] = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        m = re.search(r"`src/shardplan/([\w/]*)`", part.splitlines()[0])
        if m:
            sections[m.group(1).strip("/")] = part
    missing = []
    for mod, path in modules().items():
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(SRC / PACKAGE)
        pkg = rel.parts[0] if len(rel.parts) > 1 else ""
        section = sections.get(pkg)
        if section is None or (f"`{rel.name}`" not in section and f"`{rel.as_posix()}`" not in section):
            missing.append(f"{rel} (section {pkg or 'top level'!r})")
    assert not missing, "modules docs/architecture.md does not place: " + ", ".join(missing)


# ---- figures: the package's size, its longest parts and its function-level imports ----------------------------

def _function_imports(node: ast.AST, inside: bool = False):
    """The Import / ImportFrom nodes inside a function body below ``node`` (TYPE_CHECKING blocks skipped)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            continue
        if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _function_imports(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                         ast.Lambda)))


def function_level_imports(mods: dict[str, Path]) -> list[tuple[str, int, str]]:
    """``(module, line, imported module)`` for each import of one of the package's own modules made inside a
    function (not at module level)."""
    out = []
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in _function_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
            elif node.level:
                names = [".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))]
            else:
                names = [node.module] if (node.module or "").split(".")[0] == PACKAGE else []
            out.extend((mod, node.lineno, n) for n in names)
    return out


def functions(mods: dict[str, Path]) -> list[tuple[int, str]]:
    """``(lines, module:qualified name)`` of every function and method, longest first."""
    out = []
    for mod, path in mods.items():
        def walk(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append((child.end_lineno - child.lineno + 1, f"{mod}:{prefix}{child.name}"))
                    walk(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")
                else:
                    walk(child, prefix)
        walk(ast.parse(path.read_text(), str(path)), "")
    return sorted(out, reverse=True)


def figures() -> dict:
    """The structure's figures (``python3 tests/test_structure.py`` prints them)."""
    import subprocess
    import sys
    mods = modules()
    lines = {m: len(p.read_text().splitlines()) for m, p in mods.items()}
    names = subprocess.run([sys.executable, "-c", "import shardplan; print(len([n for n in dir(shardplan) "
                            "if not n.startswith('_')]))"], capture_output=True, text=True, check=True,
                           env={"PYTHONPATH": str(SRC), "PATH": ""}).stdout.strip()
    longest_module = max(lines, key=lines.get)
    return {"modules": len(mods), "source_lines": sum(lines.values()), "dir_shardplan": int(names),
            "function_level_imports": len(function_level_imports(mods)),
            "longest_function": functions(mods)[0], "longest_module": (lines[longest_module], longest_module)}


# imports of the package's own modules made inside a function: each breaks a real cycle, keeps a module
# torch-free (``import shardplan``, ``shardplan --help``) or keeps a heavy import (torch's DCP) off the common path,
# and says which in a comment on its line. The budget only goes down.
FUNCTION_LEVEL_IMPORTS = 5  # the CLI and rehearsal torch-free (3), flow.py (torch) under the planner, DCP cost


def test_function_level_imports_are_few_and_say_why():
    mods = modules()
    found = function_level_imports(mods)
    lines = {m: p.read_text().splitlines() for m, p in mods.items()}
    bare = [f"{m}:{n}" for m, n, _ in found if "#" not in lines[m][n - 1]]
    assert not bare, f"function-level imports without a comment saying why (a cycle, torch-free, cost): {bare}"
    assert len(found) <= FUNCTION_LEVEL_IMPORTS, (
        f"{len(found)} function-level imports of the package's own modules (budget {FUNCTION_LEVEL_IMPORTS}); "
        f"import at module level unless it breaks a cycle or keeps `import shardplan` torch-free: "
        + ", ".join(f"{m}:{n} ({t})" for m, n, t in found))


if __name__ == "__main__":
    for k, v in figures().items():
        print(f"{k:24} {v}")


def test_planner_package_is_not_shadowed():
    """The planner package is ``shardplan.planner``; ``sp.plan`` is the function, and stays the function."""
    code = ("import shardplan as sp, shardplan.planner as pl, shardplan.planner.ops as v, sys\n"
            "assert callable(sp.plan) and sp.plan is pl.plan and not isinstance(sp.plan, type(sys))\n"
            "assert sp.Plan is pl.Plan and 'torch' not in sys.modules\n"
            "import pickle; assert pickle.loads(pickle.dumps(v.Op)) is v.Op\n")
    import subprocess
    import sys
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": str(SRC), "PATH": ""}, timeout=120)


def _torch_names(tree: ast.AST) -> set[str]:
    """The names a module binds to torch's modules and objects (``import torch``, ``import torch.nn.functional as
    F``, ``from torch import nn``, ``from torch.nn import Linear``), at any depth."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names
                         if a.name == "torch" or a.name.startswith("torch."))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and (node.module == "torch" or node.module.startswith("torch.")):
            names.update(a.asname or a.name for a in node.names)
    return names


def _root_name(node: ast.AST):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def torch_assignments(path: Path) -> list[str]:
    """Every statement of ``path`` that sets or deletes an attribute of something torch owns (``F.x = ...``,
    ``torch.nn.Module.x = ...``, ``setattr(torch.x, ...)``, ``del F.x``): patching torch."""
    tree = ast.parse(path.read_text(), str(path))
    names = _torch_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        else:
            continue
        for t in targets:
            for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                if isinstance(e, ast.Attribute) and _root_name(e) in names:
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_nothing_of_torch_is_assigned(tmp_path):
    """torch's contracts through torch's extension points only (override modes, hooks, autograd functions): no
    module of the package assigns (or deletes) an attribute of torch (``F.scaled_dot_product_attention = guard``
    once made attention context-parallel for the whole process). The scan sees the patterns it refuses."""
    found = [f for path in modules().values() for f in torch_assignments(path)]
    assert not found, f"torch patched (use a TorchFunctionMode, a module hook or an autograd.Function): {found}"
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
                   "def f(g):\n    F.scaled_dot_product_attention = g\n    torch.nn.functional.relu = g\n"
                   "    setattr(nn.Module, 'x', g)\n    nn.Linear.forward, y = g, 1\n"
                   "    m = nn.Linear(1, 1)\n    m.forward = g\n")          # (an instance's attribute: not torch's)
    assert sorted(f.split(":")[1] for f in torch_assignments(bad)) == ["5", "6", "7", "8"]
