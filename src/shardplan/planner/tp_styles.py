"""Tensor parallelism's styles, resolved from the specs: which dimension of a parameter a compute axis keeps
sharded while computing, and which style (``colwise``, ``colwise_gather``, ``rowwise``, ``rowwise_split``)
each module runs (the table in :mod:`shardplan.planner.tensor_parallel`). Pure functions."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from ..errors import PlanError, SpecError, did_you_mean
from ..mesh import Mesh
from ..spec import P
from .heads import check_whole_heads, per_head_axis
from .values import Compute

LINEAR, EMBEDDING = "linear", "embedding"
STYLES = ("colwise", "colwise_gather", "rowwise", "rowwise_split")
WEIGHT_DIM = {LINEAR: {"colwise": 0, "colwise_gather": 0, "rowwise": 1, "rowwise_split": 1},
              EMBEDDING: {"colwise": 1, "colwise_gather": 1, "rowwise": 0}}
BIAS_SHARDED = {"colwise": True, "colwise_gather": True, "rowwise": False, "rowwise_split": False}


@dataclass(frozen=True)
class TPModule:
    """One module run tensor-parallel: its path, kind (``linear``/``embedding``), style and compute axis;
    where its collectives sit in the schedule: ``unit`` (the unit whose forward calls it), ``after`` (the
    forward step it runs after) and ``back_after`` (the backward step its input's gradient forms after);
    ``shares_with``: the column-parallel sibling whose input it reads too (one gradient all-reduce for
    both, issued by that sibling), or ``""``; ``input_grad``: its input takes a gradient (a traced plan
    knows; otherwise assumed); ``recomputed``: its forward collective runs again when torch's checkpoint,
    with its default early stop, recomputes the unit (``False``: the recompute ends before it, and only a
    whole recompute repeats it; see :func:`place`)."""

    path: str
    kind: str
    style: str
    axis: str
    unit: str = ""
    after: str = ""
    back_after: str = ""
    shares_with: str = ""
    input_grad: bool = True
    recomputed: bool = True

    @property
    def input_sharded(self) -> bool:
        """Whether the module's input arrives sharded on its last dim (the output of a colwise module)."""
        return self.kind == LINEAR and self.style == "rowwise"

    @property
    def output_sharded(self) -> bool:
        return self.style == "colwise"


def as_compute_axes(compute_axes, mesh: Mesh) -> tuple[str, ...]:
    axes = (compute_axes,) if isinstance(compute_axes, str) else tuple(compute_axes or ())
    for a in axes:
        if a not in mesh.axis_names:
            raise PlanError(f"compute axis {a!r} is not an axis of {mesh!r}{did_you_mean(a, mesh.axis_names)}; name one of {mesh.axis_names} or add it "
                            f"to the mesh, e.g. Mesh(dp=2, {a}=2)")
    if len(set(axes)) != len(axes):
        raise PlanError(f"compute_axes {axes} names an axis twice")
    return axes


def compute_of(spec: P, shape: tuple[int, ...], compute_axes: Sequence[str], mesh: Mesh, *, name: str,
               rule: str) -> Optional[Compute]:
    """The compute sharding ``spec`` asks for (``None``: replicated over every compute axis)."""
    found = [(d, a) for d in range(len(spec)) for a in spec.dim_axes(d) if a in compute_axes]
    if not found:
        return None
    where = f"parameter {name!r} (shape {tuple(shape)}, spec {spec!r}, rule {rule})"
    if len(found) > 1:
        raise SpecError(f"{where} is sharded over several compute axes {[a for _, a in found]}; a parameter is "
                        f"tensor-parallel over one compute axis: keep one in its spec")
    d, axis = found[0]
    if spec.dim_axes(d)[0] != axis:
        fixed = list(spec)
        fixed[d] = (axis,) + tuple(a for a in spec.dim_axes(d) if a != axis)
        raise SpecError(f"{where}: compute axis {axis!r} must come first in its dimension's entry, so that each "
                        f"{axis} rank computes with one contiguous block; write {P(*fixed)!r}")
    size = mesh.axis_size(axis)
    if shape[d] % size:
        raise SpecError(f"{where}: dimension {d} ({shape[d]}) is not divisible by compute axis {axis!r} of size "
                        f"{size}, which tensor parallelism needs; shard another dimension over {axis!r}, change the "
                        f"mesh, or keep {axis!r} out of the spec (replicated compute)")
    return Compute(d, axis, size)


def with_compute(spec: P, dim: int, axis: str) -> P:
    """``spec`` with ``axis`` put first in ``dim``'s entry (a bias following its weight)."""
    entries = [spec.entry(d) for d in range(max(len(spec), dim + 1))]
    entries[dim] = (axis,) + tuple(a for a in spec.dim_axes(dim) if a != axis)
    return P(*entries)


def local_shape(shape: tuple[int, ...], c: Optional[Compute]) -> tuple[int, ...]:
    if c is None:
        return tuple(shape)
    return tuple(s // c.size if d == c.dim else s for d, s in enumerate(shape))


def _kind(mod) -> Optional[str]:
    import torch.nn as nn
    if isinstance(mod, nn.Embedding):
        return EMBEDDING
    if isinstance(mod, nn.Linear):
        return LINEAR
    return None


def _as_style_rules(styles) -> list[tuple[Any, str]]:
    if styles is None:
        return []
    pairs = list(styles.items()) if isinstance(styles, Mapping) else list(styles)
    out = []
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise PlanError(f"styles entry {pair!r} must be (module path regex, style name); styles: {STYLES}")
        pattern, style = pair
        if style not in STYLES:
            raise PlanError(f"styles entry {pair!r}: unknown style {style!r}; use one of {STYLES}")
        try:
            out.append((re.compile(pattern), style))
        except re.error as exc:
            raise PlanError(f"styles entry {pair!r}: bad regex: {exc}") from None
    return out


def resolve(module, names_specs: list[tuple[Any, P, str]], compute_axes: tuple[str, ...], mesh: Mesh,
            styles=None) -> tuple[dict[str, Optional[Compute]], dict[str, P], tuple[TPModule, ...]]:
    """Per parameter its compute sharding and effective spec (biases follow their weights), and the
    modules run tensor-parallel. ``names_specs``: (LeafInfo, spec, rule description) per parameter."""
    compute: dict[str, Optional[Compute]] = {}
    specs: dict[str, P] = {}
    if not compute_axes:
        return {i.name: None for i, _, _ in names_specs}, {i.name: s for i, s, _ in names_specs}, ()
    if module is None:
        raise PlanError("compute_axes= needs an nn.Module: tensor-parallel styles belong to modules, and a plain "
                        "pytree has none; plan the module, or leave compute_axes out")
    info_of = {}
    for info, spec, rule in names_specs:
        compute[info.name] = compute_of(spec, info.shape, compute_axes, mesh, name=info.name, rule=rule)
        specs[info.name] = spec
        info_of[info.name] = (info, rule)
    mods = dict(module.named_modules())
    # every module that owns a compute-sharded parameter (tied ones: every owner)
    owners: dict[str, list[tuple[str, str]]] = {}  # module path -> [(attribute, canonical name)]
    for info, _, _ in names_specs:
        for full in (info.name,) + tuple(info.aliases):
            path, _, attr = full.rpartition(".")
            owners.setdefault(path, []).append((attr, info.name))
    explicit = _as_style_rules(styles)
    heads = _head_candidates(owners, compute, info_of, mods, explicit)
    sharded = {path for path, ps in owners.items() if path not in heads and any(compute[n] is not None for _, n in ps)}
    chosen: dict[str, tuple[str, str, str]] = {}  # path -> (kind, style, axis)
    for path in sorted(sharded, key=list(mods).index):
        mod = mods[path]
        params = dict(owners[path])
        style = next((s for rx, s in explicit if rx.fullmatch(path)), None)
        kind = _kind(mod) or (LINEAR if style else None)
        first = next(n for _, n in owners[path] if compute[n] is not None)
        c, (info, rule) = compute[first], info_of[first]
        shown = path or "<root>"
        if kind is None:
            raise PlanError(
                f"parameter {first!r} (rule {rule}) is sharded over compute axis {c.axis!r}, but its module {shown!r} "
                f"({type(mod).__name__}) has no tensor-parallel style: shardplan runs nn.Linear and nn.Embedding "
                f"tensor-parallel, and other modules given a style in styles=[(module regex, style)]. Fix: keep "
                f"{c.axis!r} out of its spec (replicated compute, e.g. P() or the data axes only)")
        extra = sorted(set(params) - {"weight", "bias"})
        if extra or "weight" not in params:
            raise PlanError(f"module {shown!r} ({type(mod).__name__}) owns compute-sharded parameter {first!r} but "
                            f"parameters {extra or list(params)} that no tensor-parallel style covers (styles shard "
                            f"'weight' and 'bias'); keep {c.axis!r} out of their specs")
        wname = params["weight"]
        wc = compute[wname]
        winfo, wrule = info_of[wname]
        if wc is None:
            raise PlanError(f"parameter {first!r} (rule {rule}) is sharded over {c.axis!r} but the weight of its module "
                            f"{shown!r} is not: a bias follows its weight. Shard {wname!r} over {c.axis!r} (column- or "
                            f"row-parallel) or keep {c.axis!r} out of the bias's spec")
        if len(winfo.shape) != 2:
            raise PlanError(f"parameter {wname!r} (rule {wrule}) has shape {winfo.shape}; tensor-parallel styles need a "
                            f"2-D weight. Keep {wc.axis!r} out of its spec")
        if style is None:
            style = _infer(kind, wc.dim, path, mods, owners, compute)
        elif WEIGHT_DIM[kind].get(style) != wc.dim:
            raise PlanError(f"styles gives module {shown!r} style {style!r}, which shards a {kind} weight on dim "
                            f"{WEIGHT_DIM[kind].get(style)}, but {wname!r}'s spec {specs[wname]!r} (rule {wrule}) shards "
                            f"dim {wc.dim} over {wc.axis!r}; change the style or the spec")
        if style not in WEIGHT_DIM[kind]:
            raise PlanError(f"style {style!r} does not apply to {kind} module {shown!r}; use one of {tuple(WEIGHT_DIM[kind])}")
        if kind == LINEAR and style == "colwise":  # its output stays sharded: the model splits it into heads
            check_whole_heads(module, mods[path.rpartition(".")[0]], path, wname, wrule, winfo.shape[0], wc.axis, wc.size)
        if "bias" in params:
            _bias_follows(params["bias"], style, wc, shown, compute, specs, info_of, compute_axes, mesh)
        prev = chosen.get(path)
        if prev is not None and prev != (kind, style, wc.axis):
            raise PlanError(f"module {shown!r} would run as {prev} and {(kind, style, wc.axis)}")
        chosen[path] = (kind, style, wc.axis)
    modules = tuple(TPModule(p, *chosen[p]) for p in chosen)
    _split_heads(module, mods, heads, modules, compute, specs, info_of, mesh, compute_axes)
    return compute, specs, modules


def _bias_follows(bname: str, style: str, wc: Compute, shown: str, compute: dict, specs: dict, info_of: dict,
                  compute_axes, mesh: Mesh) -> None:
    """A bias follows its weight: sharded on dim 0 under column styles (its spec given the axis when it has none),
    replicated under row styles (added after the all-reduce)."""
    bc = compute[bname]
    binfo, brule = info_of[bname]
    if BIAS_SHARDED[style]:
        want = Compute(0, wc.axis, wc.size)
        if bc is None:
            compute[bname] = compute_of(with_compute(specs[bname], 0, wc.axis), binfo.shape, compute_axes, mesh,
                                        name=bname, rule=brule)
            specs[bname] = with_compute(specs[bname], 0, wc.axis)
        elif bc != want:
            raise PlanError(f"bias {bname!r} (rule {brule}) of {style} module {shown!r} must be sharded on dim 0 "
                            f"over {wc.axis!r}, like its weight's output dimension; its spec is {specs[bname]!r}")
    elif bc is not None:
        raise PlanError(f"bias {bname!r} (rule {brule}) of row-parallel module {shown!r} is added after the "
                        f"all-reduce and must be replicated over {bc.axis!r}: keep {bc.axis!r} out of its spec")


def _head_candidates(owners: dict, compute: dict, info_of: dict, mods: dict, explicit) -> dict[str, list[str]]:
    """Module path -> its parameters that may hold one row per head (heads.py's Note: per-head parameters): of
    modules with no style of their own, parameters of 2 or more dimensions replicated or compute-sharded on
    dim 0, every compute-sharded one of the module among them."""
    out = {}
    for path, ps in owners.items():
        if _kind(mods[path]) is not None or any(rx.fullmatch(path) for rx, _ in explicit):
            continue
        names = [n for _, n in ps if len(info_of[n][0].shape) >= 2 and (compute[n] is None or compute[n].dim == 0)]
        if names and all(n in names for _, n in ps if compute[n] is not None):
            out[path] = names
    return out


def _split_heads(root, mods: dict, heads: dict, modules, compute: dict, specs: dict, info_of: dict, mesh: Mesh,
                 compute_axes) -> None:
    """Split the per-head parameters with their heads (heads.py's Note): compute-sharded on dim 0 over their
    projection's axis; a compute-sharded one that holds no row per head raises."""
    colwise = {m.path: (m.axis, mods[m.path].weight.shape[0]) for m in modules
               if m.kind == LINEAR and m.style == "colwise" and any(
                   o.style == "rowwise" and o.path.rpartition(".")[0] == m.path.rpartition(".")[0] for o in modules)}
    for path, names in heads.items():
        for n in names:
            info, rule = info_of[n]
            found = per_head_axis(root, mods, path, info.shape, colwise)
            if found is None:
                if compute[n] is not None:
                    raise PlanError(
                        f"parameter {n!r} (rule {rule}) is sharded over compute axis {compute[n].axis!r}, but its "
                        f"module {path!r} ({type(mods[path]).__name__}) has no tensor-parallel style, and the "
                        f"parameter holds no row per head of a column-parallel projection of its block (shape "
                        f"{info.shape}). Fix: keep {compute[n].axis!r} out of its spec (replicated compute)")
                continue
            axis = found[0]
            if mesh.axis_size(axis) <= 1 or (compute[n] is not None and compute[n].axis != axis):
                continue
            specs[n] = with_compute(specs[n], 0, axis)
            compute[n] = compute_of(specs[n], info.shape, compute_axes, mesh, name=n, rule=rule)


def _infer(kind: str, dim: int, path: str, mods: dict, owners: dict, compute: dict) -> str:
    if kind == EMBEDDING:
        return "rowwise" if dim == 0 else "colwise_gather"
    parent = path.rpartition(".")[0] if "." in path else ""
    sibling_dims = set()
    for other, ps in owners.items():
        if other == path or _kind(mods[other]) != LINEAR:
            continue
        if (other.rpartition(".")[0] if "." in other else "") != parent or other == "":
            continue
        w = dict(ps).get("weight")
        if w is not None and compute.get(w) is not None:
            sibling_dims.add(compute[w].dim)
    if dim == 0:
        return "colwise" if 1 in sibling_dims else "colwise_gather"
    return "rowwise" if 0 in sibling_dims else "rowwise_split"

