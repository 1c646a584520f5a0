"""Matmul FLOPs per unit, read from the plan's parameters (no model needed), counted as torchtitan and
PaLM count them for MFU: per token, 2 FLOPs per weight of every matrix in the forward (embedding lookups
excluded, a tied output head included), and 4 x T x (query width) per attention layer for the scores
and their weighted sum; backward twice the forward.

>>> f = unit_flops(plan, batch=(1, 4096))        # {unit: forward FLOPs of one rank's step}
>>> sum(f.values()) * 3 / 4096                   # FLOPs per token, forward + backward
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ..planner.facade import Plan

# [Note: the plan knows parameter names and shapes, not module types, so lookups and attention are named by
# convention: torchtitan/examples (tok_embeddings, pos_embeddings, wq), Hugging Face (embed_tokens,
# q_proj, query), GPT-2 (wte, wpe). A tied embedding (it has aliases: the output head) is a matmul.]
EMBEDDING = re.compile(r"(^|.*\.)(\w*embed\w*|wte|wpe)\.weight$")
QUERY = re.compile(r"(^|.*\.)(wq|q_proj|query)\.weight$")


def unit_flops(plan: "Plan", batch: tuple[int, int]) -> dict[str, float]:
    """Forward matmul FLOPs of one rank's step, per unit (every unit listed, the root first). Shapes are
    the tensor-parallel-local ones, so a tensor-parallel rank gets its share."""
    b, t = batch
    tokens = b * t
    out = {u.name: 0.0 for u in plan.units}
    for p in plan.params:
        if len(p.shape) < 2 or (EMBEDDING.match(p.name) and not p.aliases):
            continue
        out[p.unit] += 2.0 * tokens * p.numel
        if QUERY.match(p.name):
            out[p.unit] += 4.0 * tokens * t * p.shape[0]
    return out


def unit_widths(plan: "Plan") -> dict[str, int]:
    """Each unit's hidden size: the dimension its matrices share most often (``d`` in a transformer block,
    whose matrices are d x d, kv x d, ffn x d, d x ffn), 0 for a unit without matrices. The forecast charges
    non-matmul work (norms, activations, residuals) per token and unit of this width.

    [Note: the plan has shapes, not activations; counting dimensions is the width that needs no trace.
    Ties go to the smaller dimension]
    """
    counts: dict[str, dict[int, int]] = {u.name: {} for u in plan.units}
    for p in plan.params:
        if len(p.shape) < 2:
            continue
        for s in p.shape:
            counts[p.unit][s] = counts[p.unit].get(s, 0) + 1
    return {u: (min(c, key=lambda s: (-c[s], s)) if c else 0) for u, c in counts.items()}


def model_flops(plan: "Plan", batch: tuple[int, int]) -> float:
    """Training FLOPs of one rank's step (forward + backward = 3 x forward), the MFU numerator."""
    return 3.0 * sum(unit_flops(plan, batch).values())

