"""Memory traffic a step has beside its matmuls, per unit: what the model's own memory-bound ops move
(counted op by op in a traced plan, :func:`traced_bytes`; else estimated: the loss over the output head's
logits), and the runtime's local copies and casts of parameters and gradients. All are memory-bound; the
forecast times them at the compute model's ``memory_gbs``.

>>> traced_bytes(plan, batch=(8, 1024))                                  # {unit: (forward bytes, backward bytes)}
>>> unit_traffic(plan, batch=(8, 1024), logit_bytes=40.0, copies=True)   # the same, for the loss and the copies
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional

from ..planner.accounting import sizes
from ..planner.kinds import ALL_GATHER, PARAMS
from ..units import ROOT

if TYPE_CHECKING:  # pragma: no cover
    from ..planner.facade import Plan

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
    write in the compute dtype), cast for the reduction when the reduce dtype differs (one pass with the
    copy where they land in the reduce dtype: ``BufferPlan.lands_in_reduce_dtype``), and cast back when
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
            if b.lands_in_reduce_dtype:  # land and cast in one pass: read the compute dtype, write the reduce dtype
                out[b.unit][1] += b.grad_numel * (ct + rt)
            else:
                out[b.unit][1] += s["flat"] * 2                             # land: read and write, compute dtype
                if rt != ct:
                    out[b.unit][1] += b.gathered_numel * (ct + rt)          # cast for the reduction
            if rt != it:
                out[b.unit][1] += b.reduced_numel * (rt + it)               # the local gradient's cast
    return {u: (f, bw) for u, (f, bw) in out.items()}


def traced_bytes(plan: "Plan", batch: tuple[int, int]) -> Optional[dict[str, tuple[float, float]]]:
    """(forward, backward) bytes that each unit's memory-bound ops move, counted op by op in the plan's
    traced step (``trace=``; :mod:`shardplan.optraffic`), scaled from the traced tokens to ``batch``'s;
    ``None`` for a plan not traced, or traced before the count existed, or not on tokens.

    >>> traced_bytes(plan, (8, 1024))["layers.0"]          # a GPT-1B block in bf16: about 0.9 and 2.1 GiB
    (9.35e+08, 2.21e+09)

    [Note: attribution by the profile's events. Each point holds the bytes moved since the previous
    event: the one ending at ``post_forward(u)`` is u's forward, at ``post_backward(u)`` u's backward
    (the profile adds the ops after its parameters' gradients formed, up to its input's gradient), and
    any left from ``post_backward(u)`` to the next ``pre_backward`` is u's too. Everything else (the embedding, the head, the loss, the gaps) is the root's, forward before
    ``begin_backward``, backward after. The traced bytes grow with the tokens except a few weight-sized
    ones (the embedding's gradient), so scaling them linearly is exact at the traced batch and close
    elsewhere.]
    """
    acts = getattr(plan, "activations", None)
    if acts is None or not acts.tokens or any(p.moved is None for p in acts.plain):
        return None
    scale = batch[0] * batch[1] / acts.tokens
    out = {u.name: [0.0, 0.0] for u in plan.units}
    backward, last_done = False, None
    for p in acts.plain:
        event, _, at = p.event.partition("(")
        unit = at[:-1] if at else ""
        if event == "begin_backward":
            backward = True
        if event == "post_forward" and unit in out and unit != ROOT:
            owner, phase = unit, 0
        elif event == "post_backward" and unit in out:
            owner, phase = unit, 1
        elif event == "pre_backward" and last_done is not None:
            owner, phase = last_done, 1
        else:
            owner, phase = ROOT, int(backward)
        out[owner][phase] += p.moved * scale
        last_done = unit if event == "post_backward" else None
    return {u: (f, b) for u, (f, b) in out.items()}
