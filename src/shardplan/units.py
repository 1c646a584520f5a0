"""Units: groups of parameters gathered and freed together, chosen by regexes over module paths."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .errors import PlanError, PlanWarning, RuleError
from .rules import leaves_with_paths
from .metatrace import meta_trace, reraise, training_call

ROOT = "<root>"


def natural_key(name: str) -> list:
    """Sort key that orders numbered names as people count them: ``layers.2`` before ``layers.10``."""
    return [int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", name))]


def natural_sorted(names) -> list[str]:
    return sorted(names, key=natural_key)


@dataclass(frozen=True)
class LeafInfo:
    name: str
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype
    requires_grad: bool
    aliases: tuple[str, ...] = ()  # other names of the same (tied) parameter


def collect_leaves(model_or_tree) -> tuple[list[LeafInfo], list[Any], list[str], Any]:
    """Leaves (tied parameters once, under their first name), the leaf objects, candidate unit paths."""
    import torch.nn as nn

    if isinstance(model_or_tree, nn.Module):
        by_id: dict[int, list[str]] = {}
        objs: dict[int, Any] = {}
        for name, p in model_or_tree.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
            objs[id(p)] = p
        infos, leaves = [], []
        for pid, names in by_id.items():
            p = objs[pid]
            infos.append(LeafInfo(names[0], tuple(p.shape), p.dtype, bool(p.requires_grad), tuple(names[1:])))
            leaves.append(p)
        modules = [n for n, _ in model_or_tree.named_modules() if n]
        return infos, leaves, modules, model_or_tree

    paths, leaves, _ = leaves_with_paths(model_or_tree)
    infos, kept = [], []
    for path, leaf in zip(paths, leaves):
        shape = getattr(leaf, "shape", None)
        if shape is None:
            raise PlanError(f"leaf {path!r} ({type(leaf).__name__}) has no shape; plan() takes a pytree of tensors")
        # a pytree is JAX-style: every floating-point leaf is trained (tensors default to requires_grad=False)
        trains = bool(getattr(leaf, "requires_grad", False)) or bool(getattr(leaf, "is_floating_point", lambda: False)())
        infos.append(LeafInfo(path, tuple(shape), leaf.dtype, trains))
        kept.append(leaf)
    prefixes: dict[str, None] = {}
    for path in paths:
        parts = path.split(".")
        for i in range(1, len(parts)):
            prefixes[".".join(parts[:i])] = None
    return infos, kept, list(prefixes), None


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _matcher(i: int, u, classes: dict[str, type]):
    """A unit rule as a predicate over (module path, module class): a class (or subclass) object, a class
    named by its import path or bare name (when a module of the model has that class), or a regex over
    module paths."""
    if isinstance(u, type):
        return lambda path, cls: cls is not None and issubclass(cls, u)
    if not isinstance(u, str):
        raise RuleError(f"unit rule #{i} {u!r} must be a regex over module paths, a module class or a class's import path")
    names = {class_name(c) for c in classes.values()} | {c.__name__ for c in classes.values()}
    if u in names:
        return lambda path, cls: cls is not None and (class_name(cls) == u or cls.__name__ == u)
    try:
        rx = re.compile(u)
    except re.error as exc:
        raise RuleError(f"unit rule #{i}: invalid regex {u!r}: {exc}") from None
    return lambda path, cls: rx.fullmatch(path) is not None


def _owner(name: str, unit_paths: set[str]) -> str:
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):  # deepest unit wins, as with nested fully_shard
        prefix = ".".join(parts[:i])
        if prefix in unit_paths:
            return prefix
    return ROOT


def assign_units(infos: Sequence[LeafInfo], candidates: Sequence[str], patterns: Sequence,
                 classes: Optional[dict[str, type]] = None) -> tuple[dict[str, str], list[str], list[str]]:
    """Map each leaf to its unit; return (unit of leaf, units in registration order, notes).

    ``patterns``: regexes over module paths, module classes, or class import paths / names
    (``classes``: each candidate path's module class, when planning a module)."""
    classes = classes or {}
    matchers = [_matcher(i, u, classes) for i, u in enumerate(patterns)]
    used = [False] * len(matchers)
    unit_paths: dict[str, None] = {}
    for path in candidates:
        for i, m in enumerate(matchers):
            if m(path, classes.get(path)):
                unit_paths[path] = None
                used[i] = True
                break
    for i, u in enumerate(patterns):
        if not used[i]:
            what = class_name(u) if isinstance(u, type) else u
            warnings.warn(f"unit rule {what!r} matches no module; every parameter it was meant for stays in the root unit",
                          PlanWarning, stacklevel=3)
    paths = set(unit_paths)
    owner: dict[str, str] = {}
    notes: list[str] = []
    for info in infos:
        units = {_owner(n, paths) for n in (info.name,) + info.aliases}
        if len(units) > 1:
            owner[info.name] = ROOT
            notes.append(f"tied parameter {info.name!r} (also {', '.join(info.aliases)}) is used by units "
                         f"{natural_sorted(units)}; it lives in the root unit, gathered for the whole step")
        else:
            owner[info.name] = units.pop()
    order = [u for u in unit_paths if u in set(owner.values())]
    return owner, order, notes


def trace_args(trace) -> tuple[tuple, dict]:
    """``trace=`` as (args, kwargs): one input, a tuple of inputs, or ``(args, kwargs)``."""
    args, kwargs = trace if isinstance(trace, tuple) and len(trace) == 2 and isinstance(trace[1], dict) else (trace, {})
    return (args if isinstance(args, tuple) else (args,)), kwargs


_TRACING = [0]  # how many planner's traced steps are running in this process


def tracing() -> bool:
    """Whether the planner is running a traced step now: the runtime's collectives inside module calls
    (context-parallel attention) take their plain, local path then."""
    return _TRACING[0] > 0


_CP_ATTENTION = [0]  # how many sp.context_parallel.attention calls are running (the traced step's plain path)


class cp_attention:
    """``with cp_attention(): ...``: :func:`in_cp_attention` is true inside. ``sp.context_parallel.attention``
    marks its plain call so, and the planner's traced step tells its attention from one a model makes itself."""

    def __enter__(self):
        _CP_ATTENTION[0] += 1
        return self

    def __exit__(self, *exc):
        _CP_ATTENTION[0] -= 1
        return False


def in_cp_attention() -> bool:
    """Whether the scaled-dot-product attention running now was called by ``sp.context_parallel.attention``."""
    return _CP_ATTENTION[0] > 0


class traced_step:
    """``with traced_step(): model(...)``: :func:`tracing` is true inside.

    [Note: a process that shard()ed a context-parallel plan and plans again with ``trace=`` (a second model,
    the next mesh of a test) would otherwise gather keys and values over cp inside the trace]"""

    def __enter__(self):
        _TRACING[0] += 1

    def __exit__(self, *exc):
        _TRACING[0] -= 1
        return False


def run_traced(model, trace, hooks: dict, grad: bool = False) -> None:
    """Run the traced forward once, without autograd unless ``grad`` (then tensors say whether they
    require a gradient), with ``hooks`` ({module path: (kind, fn)}, kind ``"pre"`` or ``"post"``)
    registered for that run only."""
    import torch

    args, kwargs = training_call(model, *trace_args(trace))  # as a training step calls it (no KV cache)
    modules = dict(model.named_modules())
    handles = [modules[path].register_forward_pre_hook(fn) if kind == "pre" else modules[path].register_forward_hook(fn)
               for path, (kind, fn) in hooks.items()]
    try:
        with torch.set_grad_enabled(grad), traced_step(), meta_trace():
            model(*args, **kwargs)
    except Exception as exc:
        reraise(model, exc, "the traced forward")
    finally:
        for h in handles:
            h.remove()


def has_forward(mod) -> bool:
    """Whether calling ``mod`` runs code of its own: its class (or the instance) defines ``forward``.
    A plain ``nn.Module()`` holding submodules, an ``nn.ModuleList`` or ``nn.ModuleDict`` does not: the
    model calls its children directly, and hooks on the container itself never run."""
    import torch.nn as nn
    return "forward" in mod.__dict__ or type(mod).forward is not nn.Module.forward


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def entry_points(model, path: str, unit_paths=()) -> list[str]:
    """The module paths whose calls mean unit ``path`` computes: ``[path]`` when its module has a forward;
    for a container without one, its outermost descendants with a forward that hold parameters of the
    unit (subtrees of other units, ``unit_paths``, excluded: their parameters are theirs).

    [Note: containers as units] ``blocks.0 = nn.Module(); blocks.0.q = nn.Linear(...)`` with the model's
    forward calling ``blk.q(x)`` never calls ``blocks.0``: a unit hooked there would never gather, and its
    modules would compute with their local shards (a shape error, or under tensor parallelism ``aten.mm
    got mixed torch.Tensor and DTensor``). The runtime hooks these entry points instead: the first one
    called gathers the unit, each one's outputs start its backward, and the unit is freed when the
    schedule moves on (the next unit's forward, or the root's end)."""
    mod = model.get_submodule(path)
    if has_forward(mod):
        return [path]
    skip = [u for u in unit_paths if u != path]
    out: list[str] = []
    for name, child in mod.named_children():
        sub = f"{path}.{name}" if path else name
        if _under(sub, skip):
            continue
        if any(not _under(n, skip) for n, _ in child.named_parameters(prefix=sub, remove_duplicate=False)):
            out += entry_points(model, sub, unit_paths)
    return out


def check_entries(model, unit_order: Sequence[str], infos: Sequence[LeafInfo], owner: dict[str, str]) -> None:
    """Every parameter of a forward-less container unit must live in one of its entry points: one the
    container holds directly (or through another forward-less holder) is only read by code outside any
    forward shardplan sees, where the module holds its local shard."""
    for u in unit_order:
        mod = model.get_submodule(u)
        if has_forward(mod):
            continue
        entries = entry_points(model, u, unit_order)
        loose = [i.name for i in infos if owner[i.name] == u
                 and not any(_under(n, entries) for n in (i.name,) + tuple(i.aliases))]
        if loose:
            raise PlanError(
                f"unit {u!r} ({type(mod).__name__}) has no forward of its own, so shardplan gathers it when one of "
                f"its submodules runs ({entries or 'none holds parameters'}); parameters {loose} belong to no "
                f"submodule with a forward and would be read as local shards by the code that uses them. Fix: give "
                f"{u!r} a forward that uses them, move them into a submodule, or choose units whose modules are "
                f"called (units=[...] naming its submodules, or leave {u!r} out: its parameters join the root unit)")


def trace_order(model, units: Sequence[str], trace) -> list[str]:
    """Order in which a forward pass (on meta tensors, ideally) enters the unit modules (a container
    without a forward: its entry points, see :func:`entry_points`)."""
    seen: list[str] = []

    def entered(unit):
        return lambda _m, _a: None if unit in seen else seen.append(unit)

    run_traced(model, trace, {e: ("pre", entered(u)) for u in units for e in entry_points(model, u, units)})
    missing = [u for u in units if u not in seen]
    if missing:
        warnings.warn(f"the traced forward never entered units {missing}; they are scheduled last", PlanWarning, stacklevel=3)
    return seen + missing


def module_classes(module) -> dict[str, type]:
    """Each submodule path's class (the classes unit rules may name)."""
    return {n: type(m) for n, m in module.named_modules() if n}


def _num_experts(mod) -> Optional[int]:
    n = getattr(mod, "num_experts", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def expert_count(mod) -> Optional[int]:
    """``num_experts`` of an *expert module*: an integer ``num_experts`` and at least one parameter of its own
    that stacks one matrix per expert (``[num_experts, ...]``, 3 or more dimensions), which tokens are
    dispatched to. ``None`` for anything else.

    [Note: routers are dense] A router also says ``num_experts`` and holds an ``[num_experts, hidden]`` weight
    (Hugging Face's ``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter``,
    ``DeepseekV3TopkRouter``), but every token multiplies all of its rows (one logit per expert): it is a
    dense parameter, replicated or ZeRO-sharded like a Linear's weight, and the expert axis is a data axis for
    it. Splitting it by expert would give each rank the logits of its own experts only. Per-expert biases
    (``[num_experts, out]``) of an expert module are expert weights with the matrices they belong to."""
    n = _num_experts(mod)
    if n is None:
        return None
    for p in mod.parameters(recurse=False):
        if p.dim() >= 3 and p.shape[0] == n:
            return n
    return None
