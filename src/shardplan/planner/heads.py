"""Attention heads under tensor parallelism: a column-parallel projection must give every rank whole heads.

A model reshapes a projection's output into ``(..., heads, head_dim)``; with ``out/tp`` local features
that are not a multiple of ``head_dim`` (or ``heads % tp != 0``), that reshape fails inside the forward
with a bare torch error. The planner checks it instead, from what the projection's parent module (an
attention module) or the model's Hugging Face ``config`` declares.
"""

from __future__ import annotations

from typing import Optional

from ..errors import PlanError

HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "heads",
               "num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads", "n_head_kv")
HEAD_DIMS = ("head_dim", "key_value_proj_dim", "d_kv", "head_size", "attention_head_size")


def _ints(obj, names) -> dict[str, int]:
    out = {}
    for n in names:
        v = getattr(obj, n, None) if obj is not None else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out[n] = v
    return out


def _head_dim(parent, config) -> tuple[Optional[int], str]:
    """``(head_dim, where it was declared)`` from the attention module, else its config."""
    for obj, where in ((parent, type(parent).__name__), (config, "config")):
        dims = _ints(obj, HEAD_DIMS)
        if dims:
            name, v = next(iter(dims.items()))
            return v, f"{where}.{name}={v}"
    counts = _ints(config, ("num_attention_heads", "num_heads", "n_head", "n_heads"))
    hidden = _ints(config, ("hidden_size", "d_model", "n_embd"))
    if counts and hidden:
        (cn, c), (hn, h) = next(iter(counts.items())), next(iter(hidden.items()))
        if h % c == 0:
            return h // c, f"config.{hn}/config.{cn}={h}/{c}"
    return None, ""


def check_whole_heads(root, parent, path: str, weight: str, rule: str, out_features: int, axis: str,
                      size: int) -> None:
    """Raise a :class:`PlanError` when column-parallel ``weight`` (module ``path``, ``out_features`` rows,
    ``size`` ranks of ``axis``) would split an attention head. Silent when nothing declares heads."""
    own = _ints(parent, HEAD_COUNTS + HEAD_DIMS)
    attention = "attn" in path.lower() or "attention" in type(parent).__name__.lower()
    if not own and not attention:
        return  # [Note: a model's config declares heads for every module; only attention projections hold them]
    config = getattr(parent, "config", None) or getattr(root, "config", None)
    head_dim, declared = _head_dim(parent, config)
    counts = {**_ints(config, HEAD_COUNTS), **_ints(parent, HEAD_COUNTS)}
    if head_dim is None:
        if len(set(counts.values())) != 1 or out_features % next(iter(counts.values())):
            return  # heads of this projection unknown
        n = next(iter(counts.values()))
        head_dim, declared = out_features // n, f"{next(iter(counts))}={n}"
    if out_features % head_dim:
        return  # not a per-head projection (e.g. a fused or low-rank one)
    heads = out_features // head_dim
    if heads % size == 0:
        return
    named = ", ".join(f"{k}={v}" for k, v in counts.items()) or declared
    fits = [d for d in range(size - 1, 0, -1) if heads % d == 0]
    raise PlanError(
        f"parameter {weight!r} (rule {rule}) is column-parallel over {axis!r} of size {size}, but its {out_features} "
        f"output features are {heads} attention heads of head_dim {head_dim} ({declared}; {named}): {size} ranks "
        f"cannot each hold whole heads, and the model's reshape into heads would fail in the forward. Fix: a "
        f"{axis!r} size that divides {heads} (e.g. {axis}={fits[0]}), or keep {axis!r} out of this attention's "
        f"projection specs (replicated compute, e.g. P() or the data axes only)")


# [Note: per-head parameters] Between a column-parallel projection and its row-parallel sibling each rank holds
# whole heads of the projection's output, viewed as (..., heads, head_dim). A parameter of a module in between
# that holds one row per head, ``(heads, head_dim, ...)`` (Cohere's ``q_norm`` / ``k_norm`` weights with
# ``use_qk_norm=True``, applied to the viewed heads), must be split with them: rank r holds heads
# ``[r*heads/tp, (r+1)*heads/tp)`` of the projection and needs the same rows of the parameter. Left whole, its
# ``heads`` rows meet ``heads/tp`` local heads (a broadcast error, or with one local head a silent broadcast).
# So such a parameter is compute-sharded on dim 0 over the projection's axis, as a bias follows its weight:
# stored as its tensor-parallel-local rows, computed with as a plain tensor (its module is no tensor-parallel
# module, it runs on the local heads as they are), its gradient whole for those rows (no partial sum). The
# planner infers it (a replicated spec gets the axis put first in dim 0); a spec that puts the axis on dim 0
# itself is accepted too, and any other compute-sharded parameter of such a module is refused as before.
# 1-D parameters are never taken for per-head ones: a ``(head_dim,)`` norm weight (Qwen3's q_norm) is read
# along head_dim by every head, and a ``(heads,)`` vector cannot be told from it when heads == head_dim.


def per_head_axis(root, mods: dict, path: str, shape: tuple, colwise: dict) -> Optional[tuple[str, int, str]]:
    """``(axis, heads, projection)`` when the parameter of module ``path`` with ``shape`` holds one row per head
    of a column-parallel projection of its block (``colwise``: projection path -> (axis, out features), the
    projections of blocks that also hold a row-parallel one), else ``None`` (see the Note)."""
    if len(shape) < 2:
        return None
    for proj, (axis, out) in colwise.items():
        block = proj.rpartition(".")[0]
        if not (path.startswith(block + ".") if block else bool(path)):
            continue
        parent = mods[block]
        head_dim, _ = _head_dim(parent, getattr(parent, "config", None) or getattr(root, "config", None))
        width = 1
        for s in shape[1:]:
            width *= s
        if head_dim and width == head_dim and out == shape[0] * head_dim:
            return axis, shape[0], proj
    return None
