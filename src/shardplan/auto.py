"""Choices the planner can make for you: partition rules from a model's shapes, and how many small
blocks to merge into one unit. Each returns plain data you can print, paste and edit.

>>> rules = sp.auto_rules(model, sp.Mesh(dp=8))
>>> print(rules.to_source())          # a rules file: paste it, edit it, pass it back to sp.plan
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional, Sequence

from .errors import SpecError
from .mesh import Mesh
from .rules import Rules, regex_list_source
from .spec import P
from .units import collect_leaves, expert_count

AUTO_UNIT_BYTES = 16 * 2 ** 20
"""Units smaller than this are merged with their neighbours by default: each unit costs a fixed
~0.3 ms per step (hooks, launch and latency of two to three collectives), which dominates blocks of a
few MiB (200 blocks of 4 MiB on one H200: 1.27x unsharded unmerged, 0.89-0.99x at 16 MiB)."""

MIN_MERGED_UNITS = 8
"""Automatic merging leaves at least this many units where the blocks allow it: a unit's gathers overlap
the compute of the unit before it, so the first unit's gather in forward and in backward is exposed; one
merged unit for the whole model exposes every gather (4 blocks of 0.8 MiB merged into one: 0.82x FSDP2 on
2 CPU ranks with gloo, 0.78x kept as 4 units)."""

REPLICA_AXIS_NAMES = ("replica", "replicate", "dp_replicate", "outer", "dp_outer")


def _mib(nbytes: float) -> str:
    x = nbytes / 2 ** 20
    return f"{x:,.0f} MiB" if x >= 100 else f"{x:.3g} MiB"


def choose_min_unit_bytes(unit_bytes: Sequence[int]) -> tuple[int, str]:
    """``(min_unit_bytes, why)`` for units of these sizes (parameter bytes, forward order)."""
    if len(unit_bytes) < 2:
        return 0, "one unit: nothing to merge"
    median = sorted(unit_bytes)[len(unit_bytes) // 2]
    if median >= AUTO_UNIT_BYTES:
        return 0, (f"units kept as given: the median unit holds {_mib(median)}, at least the "
                   f"{_mib(AUTO_UNIT_BYTES)} below which merging pays")
    target = min(AUTO_UNIT_BYTES, sum(unit_bytes) // MIN_MERGED_UNITS)
    if target <= median:
        return 0, (f"units kept as given: merging {len(unit_bytes)} blocks of {_mib(median)} would leave fewer than "
                   f"{MIN_MERGED_UNITS} units, whose gathers the compute could no longer hide")
    return target, (f"the median block holds {_mib(median)}, and a unit's fixed cost per step (hooks, collective "
                    f"launches) outweighs the compute of so small a block"
                    + ("" if target == AUTO_UNIT_BYTES else
                       f"; target {_mib(target)}, so that at least {MIN_MERGED_UNITS} units remain to overlap"))


def merge_note(min_unit_bytes: int, blocks: Sequence[int], units: Sequence[tuple[int, int]], why: str = "",
               automatic: bool = False) -> str:
    """What merging did, in words that hold for any model size: ``blocks`` are the sizes of the units before
    merging, ``units`` the (blocks, bytes) of each unit after (``why``: the automatic choice's reason)."""
    said = ([_mib(min_unit_bytes)] if min_unit_bytes else []) + (["automatic"] if automatic else [])
    head = f"min_unit_bytes={min_unit_bytes}" + (f" ({', '.join(said)})" if said else "")
    if not min_unit_bytes or len(units) == len(blocks):
        return f"{head}: {why}" if why else f"{head}: no neighbouring units small enough to merge"
    counts = [n for n, _ in units]
    if len(set(counts)) == 1:
        of = f"of {counts[0]} blocks"
    elif len(counts) <= 4:
        of = "of " + ", ".join(map(str, counts[:-1])) + f" and {counts[-1]} blocks"
    else:
        of = f"of {min(counts)} to {max(counts)} blocks"
    each = [b for _, b in units]
    size = (f"{_mib(each[0])}" if len(each) == 1 else f"about {_mib(sum(each) / len(each))} each")
    total = sum(blocks)
    short = (f", more than all {len(blocks)} blocks hold together" if total < min_unit_bytes else "")
    text = (f"{head}: merged {len(blocks)} blocks into {len(units)} unit{'s' if len(units) > 1 else ''} {of} "
            f"({size}; target {_mib(min_unit_bytes)}{short})")
    if why:
        text += f": {why}"
    return text + ("; pass min_unit_bytes=0 to keep one unit per block" if automatic else "")


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes parameters are sharded over by default: every axis not named like a replica axis."""
    axes = tuple(a for a in mesh.axis_names if a not in REPLICA_AXIS_NAMES)
    return axes or mesh.axis_names


ROOT_WARN_BYTES = 2 ** 30
"""A root-only plan warns when its root unit gathers at least this many parameter bytes *and* more than a
quarter of the model's (:func:`root_unit_warning`): the root unit stays gathered for the whole step, so
its full size adds to every rank's peak (70B at dp=64 with one root unit: ~530 GiB per rank)."""


def _container_pattern(path: str, container) -> str:
    import torch.nn as nn
    child = r"[^.]+" if isinstance(container, nn.ModuleDict) else r"\d+"
    return (re.escape(path) + r"\." if path else "") + child


def find_units(module) -> list[str]:
    """Unit regexes for the repeated blocks of ``module``, as a torch user would ``fully_shard`` them: the
    elements of every ``ModuleList``, ``ModuleDict`` or ``Sequential`` whose (at least two) elements that
    hold parameters share one class and are blocks (own submodules), outermost containers only (a
    decoder's layers, not the experts inside them). ``[]`` when there are none.

    >>> sp.auto.find_units(llama)           # ['model\\.layers\\.\\d+']
    >>> sp.auto.find_units(t5)              # ['encoder\\.block\\.\\d+', 'decoder\\.block\\.\\d+']
    """
    import torch.nn as nn
    found: list[str] = []
    taken: list[str] = []  # containers chosen: nothing inside their elements is considered
    for path, mod in module.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        if any(path.startswith(t + ".") for t in taken):
            continue
        elems = [m for m in mod.children() if any(True for _ in m.parameters())]
        if len(elems) < 2 or len({type(m) for m in elems}) != 1 or not any(True for _ in elems[0].children()):
            continue
        found.append(_container_pattern(path, mod))
        taken.append(path)
    return found


def root_unit_warning(root_bytes: int, total_bytes: int, suggestion: list) -> str:
    """The warning for a plan whose root unit is large (``""`` when it is not; see ``ROOT_WARN_BYTES``)."""
    if root_bytes < ROOT_WARN_BYTES or 4 * root_bytes <= total_bytes:
        return ""
    fix = (f"pass units={regex_list_source(suggestion)} (the model's repeated blocks)" if suggestion else
           "pass units=[...] naming the model's blocks (regexes over module paths, or block classes)")
    return (f"the root unit holds {root_bytes / 2 ** 30:.2f} GiB of {total_bytes / 2 ** 30:.2f} GiB of parameters and "
            f"stays gathered for the whole step on every rank, so sharding saves little memory; {fix} so that "
            f"each block is gathered only while it runs")


def _best_dim(shape: tuple[int, ...], parts: int) -> tuple[int, str]:
    """Dim 0 (zero copy-out) unless another dimension divides by ``parts`` and dim 0 would pad > 1%."""
    waste0 = (-shape[0]) % parts / max(shape[0], 1)
    if waste0 <= 0.01 or len(shape) == 1:
        return 0, ""
    for d in range(1, len(shape)):
        if shape[d] % parts == 0:
            return d, (f"dim 0 ({shape[0]}) would pad {100 * waste0:.1f}% over {parts} shards; "
                       f"dim {d} ({shape[d]}) divides evenly")
    return 0, ""


def _expert_counts(module, mesh: Mesh, axes) -> dict[str, int]:
    """{module path: num_experts} of the expert modules (stacked per-expert matrices, not routers:
    :func:`shardplan.units.expert_count`) when ``ep`` is one of ``axes``: their stacked
    weights are split by expert (expert parallelism)."""
    if module is None or "ep" not in axes:
        return {}
    out = {}
    for path, mod in module.named_modules():
        n = expert_count(mod)
        if n is not None:
            out[path] = n
    return out


def _check_experts_divide(name: str, path: str, n: int, mesh: Mesh) -> None:
    size = mesh.axis_size("ep")
    if n % size:
        fits = [s for s in range(1, n + 1) if n % s == 0]
        raise SpecError(f"auto_rules: parameter {name!r} stacks the {n} experts of module {path!r}, which do not "
                        f"divide over expert axis 'ep' of size {size}; use an ep size in {fits} (e.g. Mesh(dp=..., "
                        f"ep={max(s for s in fits if s <= size)})), or name no 'ep' axis in the mesh")


def _expert_spec(shape: tuple[int, ...], mesh: Mesh, axes) -> P:
    """Stacked experts: dim 0 over ``ep`` (whole experts per rank), the other axes after it on dim 0 when
    the local experts divide by them, else on the best other dimension of the local block."""
    rest = tuple(a for a in axes if a != "ep")
    if not rest:
        return P("ep")
    local = (shape[0] // mesh.axis_size("ep"),) + tuple(shape[1:])
    d, _ = _best_dim(local, mesh.axis_size(rest))
    entry = rest[0] if len(rest) == 1 else rest
    if d == 0:
        return P(("ep",) + rest)
    return P(*(["ep"] + [None] * (d - 1) + [entry]))


def _generalize(name: str) -> str:
    """A regex for ``name`` and its siblings in repeated blocks: numeric path parts become ``\\d+``."""
    return r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split("."))


def auto_rules(model_or_tree: Any, mesh: Mesh, *, min_shard_bytes: int = 2 ** 20,
               axes: Optional[Sequence[str]] = None) -> Rules:
    """Propose partition rules for ``model_or_tree`` on ``mesh``.

    >>> rules = sp.auto_rules(model, sp.Mesh(dp=8))
    >>> plan = sp.plan(model, rules, sp.Mesh(dp=8))

    Parameters of at least ``min_shard_bytes`` are sharded over ``axes`` (default: every mesh axis not
    named like a replica axis, e.g. ``shard`` on ``Mesh(replica=2, shard=4)``) along dim 0, or along
    another dimension when dim 0 would pad more than 1% and that one divides evenly (the rule says so in
    a comment); smaller ones (norms, biases, scalars) are replicated. Tied parameters are one parameter.
    Names that differ only in block indices share one rule; the commonest sharded spec becomes a
    catch-all at the end.

    The returned ``Rules`` also carries ``.units``: the units :func:`find_units` proposes for a module
    (``[]`` for a pytree), which ``to_source()`` writes as ``UNITS = [...]`` (the CLI reads it back) and
    which :func:`shardplan.plan` uses by default anyway: ``sp.plan(model, rules, mesh, units=rules.units)``.
    """
    infos, _, _, module = collect_leaves(model_or_tree)
    axes = tuple(axes) if axes is not None else data_axes(mesh)
    entry = axes[0] if len(axes) == 1 else tuple(axes)
    parts = mesh.axis_size(axes)
    experts = _expert_counts(module, mesh, axes)
    named, why = [], {}
    for info in infos:
        nbytes = math.prod(info.shape) * info.dtype.itemsize
        if not info.shape or nbytes < min_shard_bytes:
            named.append((info.name, P()))
            continue
        path = info.name.rpartition(".")[0]
        if experts.get(path) == info.shape[0]:
            _check_experts_divide(info.name, path, info.shape[0], mesh)
            named.append((info.name, _expert_spec(info.shape, mesh, axes)))
            continue
        d, reason = _best_dim(info.shape, parts)
        named.append((info.name, P(*([None] * d + [entry]))))
        if reason:
            why[info.name] = reason
    out = rules_from_specs(named)
    comments: dict[str, list[str]] = {}
    for name, reason in why.items():  # on the rule that takes the parameter, the catch-all included
        comments.setdefault(out.find(name).pattern, []).append(f"{name}: {reason}")
    out.comments = {pat: "; ".join(notes[:3]) + (f"; and {len(notes) - 3} more" if len(notes) > 3 else "")
                    for pat, notes in comments.items()}
    out.units = find_units(module) if module is not None else []
    return out


def _patterns_of(named: Sequence[tuple[str, P]]) -> dict[str, str]:
    """Each name's rule pattern: its block-generalised form, or itself escaped when siblings that share
    the generalised form have another spec."""
    first: dict[str, P] = {}
    out = {}
    for name, spec in named:
        g = _generalize(name)
        first.setdefault(g, spec)
        out[name] = g if first[g] == spec else re.escape(name)
    return out


def rules_from_specs(named: Sequence[tuple[str, P]]) -> Rules:
    """Rules giving each name its spec: exceptions first, then one rule per block-generalised name, then
    the commonest sharded spec as the closing catch-all (first seen wins a tie)."""
    patterns = _patterns_of(named)
    specific, general = {}, {}
    for name, spec in named:
        pat = patterns[name]
        (general if pat == _generalize(name) else specific).setdefault(pat, spec)
    counts: dict[P, int] = {}
    for spec in general.values():
        if spec != P():
            counts[spec] = counts.get(spec, 0) + 1
    common = max(counts, key=lambda s: (counts[s], -list(counts).index(s))) if counts else P()
    rules = list(specific.items()) + [(p, s) for p, s in general.items() if s != common] + [(r".*", common)]
    return Rules(rules)
