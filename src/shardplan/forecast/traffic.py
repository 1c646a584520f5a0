"""Memory traffic a step has beside its matmuls and the blocks' elementwise work, per unit: the loss over
the output head's logits, and the runtime's local copies and casts of parameters and gradients. Both are
memory-bound; the forecast times them at the compute model's ``memory_gbs``.

>>> unit_traffic(plan, batch=(8, 1024), logit_bytes=40.0, copies=True)   # {unit: (forward bytes, backward bytes)}
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..plan.accounting import sizes
from ..plan.kinds import ALL_GATHER, PARAMS

if TYPE_CHECKING:  # pragma: no cover
    from ..plan.facade import Plan

# [Note: the plan has parameter names, not module types: the head is named by convention (torchtitan and
# examples: output; Hugging Face: lm_head), or is a tied embedding (a weight with aliases)]
HEAD = re.compile(r"(^|.*\.)(output|lm_head)\.weight$")


def _head(plan: "Plan"):
    return next((p for p in plan.params if len(p.shape) == 2 and (HEAD.match(p.name) or p.aliases)), None)


def logits_per_token(plan: "Plan") -> int:
    """Logits per token: the rows of the output head (shapes are tensor-parallel-local), 0 without one."""
    head = _head(plan)
    return int(head.shape[0]) if head is not None else 0


def unit_traffic(plan: "Plan", batch: tuple[int, int], logit_bytes: float,
                 copies: bool = True) -> dict[str, tuple[float, float]]:
    """(forward, backward) bytes per unit beyond the blocks' own work.

    The loss: ``logit_bytes`` per logit, split 18 : 22 between forward and backward (an fp32 cross-entropy
    over bf16 logits: cast up 2 + 4, log-softmax 12; its backward: the loss's gradient 4, log-softmax's 12,
    cast down 4 + 2 = 40 bytes), charged to the unit holding the head.
    The copies: each gather of a unit's buffer reads this rank's shard and writes it in the compute dtype
    when the dtypes differ or the gather is local (world 1: the copy is the gather); a unit gathered again
    for its backward pays it again there. Its gradients are copied into the unsharded gradient (read and
    write in the compute dtype), cast for the reduction when the reduce dtype differs, and cast back when
    the parameters' dtype differs from the reduce dtype.
    """
    out = {u.name: [0.0, 0.0] for u in plan.units}
    tokens = batch[0] * batch[1]
    head = _head(plan)
    if head is not None and logit_bytes:
        n = tokens * int(head.shape[0])
        out[head.unit][0] += n * logit_bytes * 18 / 40
        out[head.unit][1] += n * logit_bytes * 22 / 40
    if not copies:
        return {u: (f, bw) for u, (f, bw) in out.items()}
    gathers: dict[str, int] = {}
    for op in plan.ops():
        if op.kind == ALL_GATHER and op.what == PARAMS and not op.in_module:
            gathers[op.unit] = gathers.get(op.unit, 0) + 1
    for b in plan.buffers:
        s = sizes(b)
        it, ct, rt = b.itemsize, b.compute_itemsize, b.reduce_itemsize
        local = not (b.sharded and b.group_size > 1)
        cast = b.shard_numel * (it + ct) if (ct != it or local) and not b.alias else 0
        n = gathers.get(b.unit, 0)
        if n:
            out[b.unit][0] += cast
            out[b.unit][1] += cast * (n - 1)
        if b.requires_grad:
            out[b.unit][1] += s["flat"] * 2                                 # land: read and write, compute dtype
            if rt != ct:
                out[b.unit][1] += b.gathered_numel * (ct + rt)              # cast for the reduction
            if rt != it:
                out[b.unit][1] += b.reduced_numel * (rt + it)               # the local gradient's cast
    return {u: (f, bw) for u, (f, bw) in out.items()}
