"""Accounting: memory per rank walked op by op, bytes sent per step, and the plan's warnings.

The memory walk follows the runtime's storage exactly: every tensor the runtime allocates for a buffer
(the local shard, the gathered buffer, the send copy, the unsharded gradient, the reduction's input and
output, the local gradients) comes alive and dies at the op that allocates and releases it, so the
runtime's own accounting equals :meth:`Plan.memory` (tests check it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

from .. import layout as L
from ..dtypes import itemsize
from ..units import natural_sorted
from ..mesh import Mesh
from . import axes as AX
from .kinds import (ALL_GATHER, ALL_REDUCE, COPY_D2H, COPY_H2D, FREE, GRADS, PARAMS, PARTIAL_GRADS, PREPARE, REDUCE_SCATTER,
                    SCALES, WAIT, Offload)
from .offload import host_bytes, pinned_host_bytes
from .values import BufferPlan, ParamPlan, UnitPlan

if TYPE_CHECKING:  # pragma: no cover
    from .facade import Plan


def sizes(b: BufferPlan) -> dict[str, int]:
    """Bytes of each tensor the runtime keeps for buffer ``b`` (0: the tensor is not made)."""
    it, ct, rt = b.itemsize, b.compute_itemsize, b.reduce_itemsize
    collective = b.sharded and b.group_size > 1
    return dict(
        shard=0 if b.alias else b.shard_numel * it,
        # [Note: a tensorwise (FP8 compute) gather] writes float8 codes straight into full (or packed): 1 byte each
        full=(b.numel if b.copy_out else b.gathered_numel) * b.gathered_itemsize,  # the full params' storage
        packed=b.gathered_numel * b.gathered_itemsize if b.copy_out else 0,       # before the copy-out
        send=b.shard_numel * ct if collective and (ct != it or b.alias) and not b.gather_dtype else 0,
        # [Note: a quantized gather] sends codes and scales (qsend, one rank's wire segment) into the gathered
        # wire, which the wait dequantizes into the full (or packed) buffer and releases
        qsend=b.wire_shard_bytes if collective else 0,
        wire=b.gather_bytes if b.gather_dtype and not b.tensorwise else 0,
        flat=b.grad_numel * b.flat_itemsize if b.requires_grad else 0,  # unsharded gradient
        # the reduction's input: the cast (or packed) unsharded gradient, unless it landed in the reduce dtype
        rin=0 if b.lands_in_reduce_dtype else (b.gathered_numel * rt) if (rt != ct or b.copy_out) and not b.reduce_quant
        else b.reduce_bytes if b.reduce_quant else 0,
        # [Note: a quantized reduction] quantizes the gradient into rin (every segment's codes and scales), receives
        # every rank's codes and scales for its own segment (recv) and sums them in fp32 into rout, even in a group of one
        recv=b.reduce_bytes if b.reduce_quant and collective else 0,
        rout=b.shard_numel * rt if collective or b.reduce_quant else 0,
        lgrad=b.reduced_numel * it if rt != it else 0,             # a fresh local gradient (else the result itself)
    )


def reduction_result(b: BufferPlan) -> str:
    """Which tensor holds a buffer's reduced gradient: the reduce-scatter output, the cast/packed copy, or
    the unsharded gradient itself."""
    if b.sharded and (b.group_size > 1 or b.reduce_quant):
        return "rout"
    s = sizes(b)
    return "rin" if s["rin"] else "flat"


def memory(plan: "Plan", rank: int = 0, recompute: bool = False) -> dict:
    """The walk: model states op by op; with a traced plan, the activation profile's bytes at the same
    events (``recompute``: every unit checkpointed) on top of them."""
    per = {b.index: sizes(b) for b in plan.buffers}
    live: dict[tuple[str, int], int] = {}
    lent: set[int] = set()

    def put(kind: str, i: int) -> None:
        if per[i][kind]:
            live[(kind, i)] = per[i][kind]

    for b in plan.buffers:
        if b.offload != Offload.PARAMS:  # offloaded parameters: on the device from copy_h2d to the gather's wait
            put("shard", b.index)
        if b.persistent:
            put("full", b.index)
        if b.requires_grad and b.keeps_grads:
            put("flat", b.index)
    params = sum(v for (k, _), v in live.items() if k in ("shard", "full"))
    transient_full = {b.index for b in plan.buffers if not b.persistent}
    peak = gathered_peak = states_peak = 0
    collected: set[int] = set()
    acts = getattr(plan, "activations", None)
    points = {p.event: p for p in acts.points(recompute)} if acts is not None else {}
    act = act_at_peak = 0  # activation bytes alive now; those alive at the peak
    # [Note: forming gradients] from its ``prepare`` to its reduction a unit's unsharded gradient is
    # still forming on the parameters (autograd's ``.grad``); the model states count all of it from
    # ``prepare`` on (as the runtime's own accounting does), but a profile that counts gradients as they
    # form (``Activations.grads``) already holds the part formed so far: the peak leaves the rest out
    forming: set[int] = set()
    grads_in_profile = acts is not None and acts.grads

    def bump(extra: int) -> None:
        nonlocal peak, gathered_peak, states_peak, act_at_peak
        states = sum(live.values())
        states_peak = max(states_peak, states)
        # (the profile holds them as autograd forms them: in the compute dtype, whatever the flat gradient's)
        held = states - (sum(plan.buffers[i].grad_numel * plan.buffers[i].compute_itemsize for i in forming)
                         if grads_in_profile else 0)
        if held + extra > peak:
            peak, act_at_peak = held + extra, extra
        gathered_peak = max(gathered_peak, sum(v for (k, i), v in live.items()
                                               if k in ("packed", "wire") or (k == "full" and i in transient_full)))

    def landing() -> None:  # a landing moment inside an op ([Note: landing in the reduce dtype])
        bump(act)
        _settle(live, forming)

    schedule = plan.schedule
    for step in plan.program.canonical():
        # [Note: activations at events] the compute between the previous event and this one (a unit's
        # forward, its backward) held at most point.peak activation bytes, beside the model states as the
        # previous step's ops left them; after this step's ops, point.live stay alive
        point = points.get(step.name)
        if point is not None:
            bump(point.peak)
        for op in (schedule[i] for i in step.ops if schedule[i].applies(recompute=recompute)):
            _apply(op, plan, per, live, lent, collected, put, forming, landing)
            bump(act)
        if point is not None:
            act = point.live
            bump(act)
    optimizer = 0
    if plan.optimizer_states:
        for p in plan.params:
            if p.requires_grad and not plan.buffers[p.buffer].offload:  # offloaded: the state is on the host
                optimizer += math.prod(plan.local_shape(p.name, rank)) * state_itemsize(p) * plan.optimizer_states
    grads = sum(v for (k, _), v in live.items() if k in ("lgrad", "flat", "rin", "recv", "rout"))
    trainable: dict[int, int] = {}  # buffer index -> trainable parameters (each has a host step count)
    for p in plan.params:
        if p.requires_grad:
            trainable[p.buffer] = trainable.get(p.buffer, 0) + 1
    host = sum(host_bytes(b, plan.optimizer_states, trainable.get(b.index, 0)) for b in plan.buffers)
    pinned = pinned_host_bytes(plan.buffers, plan.optimizer_states, trainable) if plan.offload else 0
    return dict(params=params, grads=grads, optimizer=optimizer, gathered_peak=gathered_peak, peak=peak + optimizer,
                host=host, host_peak=host, host_pinned=pinned, activations=act_at_peak if acts is not None else None, recompute=recompute,
                states_peak=states_peak + optimizer)


def state_itemsize(p: ParamPlan) -> int:
    """Bytes per element of one optimizer state of ``p``: a torch optimizer (AdamW's ``exp_avg``, ``exp_avg_sq``)
    keeps its states in the parameter's dtype, so fp32 parameters (fp32 master weights) get fp32 states and
    bf16 parameters bf16 states."""
    return itemsize(p.dtype)


def optimizer_state_dtypes(plan: "Plan") -> list[str]:
    """The dtypes the optimizer states of the plan's trainable parameters are kept in (their storage dtypes)."""
    return sorted({p.dtype for p in plan.params if p.requires_grad})


def low_precision_masters(plan: "Plan", rank: int = 0) -> tuple[int, int]:
    """``(count, bytes on rank)`` of the trainable parameters stored in a 16-bit dtype: no fp32 master weights,
    so the optimizer steps (and keeps its states) in 16 bits."""
    n = size = 0
    for p in plan.params:
        if p.requires_grad and itemsize(p.dtype) == 2:
            n += 1
            size += math.prod(plan.local_shape(p.name, rank)) * itemsize(p.dtype)
    return n, size


def _apply(op, plan, per, live, lent, collected, put, forming: set, moment) -> None:
    bufs = [plan.buffers[i] for i in op.buffers]
    if op.kind == COPY_H2D:
        for b in bufs:
            if b.offload == Offload.PARAMS:
                put("shard", b.index)
    elif op.kind == PREPARE:
        for b in bufs:
            if ("flat", b.index) not in live:
                # [Note: forming gradients] until they land they are autograd's, in the compute dtype (a buffer
                # that lands in the reduce dtype gets its wider unsharded gradient at the landing)
                live[("flat", b.index)] = b.grad_numel * b.compute_itemsize
                forming.add(b.index)
    elif op.kind == ALL_GATHER:
        for b in bufs:
            if not b.persistent:
                put("full", b.index)
            put("packed", b.index)
            put("send", b.index)
            put("qsend", b.index)
            put("wire", b.index)
    elif op.kind == WAIT and op.what == PARAMS:
        for b in bufs:
            live.pop(("send", b.index), None)
            live.pop(("qsend", b.index), None)
            live.pop(("wire", b.index), None)
            live.pop(("packed", b.index), None)
            if b.offload == Offload.PARAMS:
                live.pop(("shard", b.index), None)
    elif op.kind == FREE and op.what == PARAMS:
        for b in bufs:
            if not b.persistent:
                live.pop(("full", b.index), None)
    elif op.kind in (REDUCE_SCATTER, ALL_REDUCE) and op.what in (GRADS, PARTIAL_GRADS):
        # [Note: a unit's gradients land together] the first reduction that touches a unit (its partial-gradient
        # sum included) lands the gradients of every buffer of the unit and makes their reduction inputs
        # (runtime/handlers.py, ``_reduction_inputs``), not only those of the op's buffers: a replicated buffer
        # reduced by a later op (or by its wait, on a group of one) holds its landed gradient from then on
        for i in plan.unit(op.unit).buffers:
            b = plan.buffers[i]
            if b.requires_grad and i not in collected:
                if _landed(b, live, per, forming):  # the runtime copies the formed gradients into it
                    moment()
                collected.add(i)
                put("rin", i)
        if op.what == GRADS:
            for b in bufs:
                put("recv", b.index)
                put("rout", b.index)
    elif op.kind == WAIT and op.what == GRADS:
        for b in bufs:
            i = b.index
            if i not in collected:  # no reduction op ran (nothing to reduce over: a replicated buffer on a group of
                put("rin", i)       # one): the wait makes the reduction's input, the result (as the runtime does)
            collected.discard(i)
            if _landed(b, live, per, forming):
                moment()
            result = reduction_result(b)
            if per[i]["lgrad"]:
                put("lgrad", i)
            elif result == "flat":
                lent.add(i)
            else:
                live[("lgrad", i)] = live.pop((result, i))
            live.pop(("rin", i), None)
            live.pop(("recv", i), None)
            live.pop(("rout", i), None)
    elif op.kind == FREE and op.what == GRADS:
        for b in bufs:
            forming.discard(b.index)
            if b.index not in lent:
                live.pop(("flat", b.index), None)


def _landed(b: BufferPlan, live: dict, per: dict, forming: set) -> bool:
    """``b``'s formed gradients landed in its unsharded gradient (of its own dtype from now on). Returns whether
    they and a wider unsharded gradient are alive together now: the caller counts that moment, then settles."""
    i = b.index
    # [Note: landing in the reduce dtype] autograd's gradients (compute dtype) are copied into an unsharded
    # gradient of the reduce dtype allocated for it: both are alive at that moment, as a bf16 unsharded gradient
    # and its fp32 reduction input were before ([Note: gradients land in the reduce dtype], values.py)
    if b.lands_in_reduce_dtype and ("flat", i) in live and i in forming:
        live[("landing", i)] = per[i]["flat"]
        return True
    forming.discard(i)
    if ("flat", i) in live:
        live[("flat", i)] = per[i]["flat"]
    return False


def _settle(live: dict, forming: set) -> None:
    """After the landing moment: the formed gradients are gone, the unsharded gradient holds them."""
    for k in [k for k in live if k[0] == "landing"]:
        live[("flat", k[1])] = live.pop(k)
        forming.discard(k[1])


def comm_bytes(plan: "Plan") -> dict:
    out = {ALL_GATHER: 0, REDUCE_SCATTER: 0, ALL_REDUCE: 0}
    copies = {COPY_D2H: 0, COPY_H2D: 0}
    for op in plan.ops():
        if op.kind in copies:
            copies[op.kind] += op.bytes
        if not op.is_collective or op.in_module:  # activations (tp, cp, ep): counted below
            continue
        n = plan.mesh.axis_size(op.axes) if op.axes else 1
        factor = 2 if op.kind == ALL_REDUCE else 1
        out[op.kind] += op.bytes * factor * (n - 1) // n
    out["total"] = sum(out.values())
    quantized = [b for b in plan.buffers if b.gather_dtype and not b.tensorwise and b.sharded]
    if quantized:  # [Note: part of all_gather, not added to the total again]
        scales = {b.index: b.scale_bytes * b.group_size for b in quantized}
        out["gather_scales"] = sum(scales[i] * (plan.mesh.axis_size(op.axes) - 1) // plan.mesh.axis_size(op.axes)
                                   for op in plan.ops() if op.kind == ALL_GATHER and op.what == PARAMS
                                   for i in op.buffers if i in scales)
    if any(b.amax_bytes for b in plan.buffers):  # FP8 compute's absmax all-reduces (their own ops, `scales`):
        # already in all_reduce and the total; this says how much of them they are
        out["fp8_amax"] = sum(op.bytes * 2 * (plan.mesh.axis_size(op.axes) - 1) // plan.mesh.axis_size(op.axes)
                              for op in plan.ops() if op.what == SCALES)
    for key, sent in AX.comm_bytes(plan).items():  # each compute axis's in-module traffic (planner/axes.py)
        out[key] = sent
        if sent is not None:
            out["total"] += sent
    if plan.offload:  # host<->device copies over PCIe, not the network: not in "total"
        out.update(copies)
    return out


def max_gathered_units(plan: "Plan") -> int:
    live, most = set(), 0
    transient = {u.name for u in plan.units if any(not plan.buffers[i].persistent for i in u.buffers)}
    for op in plan.ops():
        if op.in_module:
            continue
        if op.kind == ALL_GATHER and op.unit in transient:
            live.add(op.unit)
        elif op.kind == FREE and op.what == PARAMS:
            live.discard(op.unit)
        most = max(most, len(live))
    return most


def coverage(mesh: Mesh, p: ParamPlan, b: BufferPlan) -> tuple[int, bool]:
    """(ranks of its shard group ``b`` that hold a piece of ``p``, whether pieces differ in size). O(1) per param."""
    W = b.group_size
    if b.layout == L.REPLICATED or p.numel == 0 or W == 1:
        return W, False
    if b.layout == L.CONTIGUOUS:
        S = b.shard_numel
        first, last = p.offset // S, (p.offset + p.numel - 1) // S
        sizes = {L.contiguous_rows(p.offset, p.numel, p.row, S, k) for k in {first, min(first + 1, last), last}}
        lens = {r1 - r0 for r0, r1 in sizes}
        return last - first + 1, len(lens) > 1 or last - first + 1 < W
    held, uneven = 1, False
    spec = p.storage_spec
    for d, size in enumerate(p.shape):
        axes = spec.dim_axes(d)
        if axes:
            parts = mesh.axis_size(axes)
            c = -(-size // parts)
            held *= min(parts, -(-size // c)) if size else 0
            uneven |= size % parts != 0
    return held, uneven


def plan_warnings(mesh: Mesh, params: Sequence[ParamPlan], buffers: Sequence[BufferPlan],
                  units: Sequence[UnitPlan]) -> tuple[str, ...]:
    """The planner's warnings about a layout: parameters some ranks hold none of, uneven shards, padding, copy-out.
    From the values alone, so the compiler says them before it builds the :class:`Plan`."""
    out = []
    empty, uneven = [], []
    for p in params:
        b = buffers[p.buffer]
        if b.layout == L.CONTIGUOUS:
            continue  # packed by design: ranks hold whole rows of some parameters, S bytes each
        held, odd = coverage(mesh, p, b)
        W = b.group_size
        if held < W:
            empty.append(f"{p.name} {tuple(p.shape)} on {held}/{W}")
        elif odd:
            uneven.append(p.name)
    if empty:
        out.append(f"{len(empty)} parameter(s) are held by only some ranks of their shard group (others hold none): "
                   + "; ".join(empty[:6]) + (" ..." if len(empty) > 6 else "")
                   + ". Shard a larger dimension, or replicate them with P()")
    if uneven:
        out.append(f"{len(uneven)} parameter(s) have uneven shards (dimension not divisible by the shard count): "
                   + ", ".join(uneven[:6]) + (" ..." if len(uneven) > 6 else ""))
    for u in units:
        pad = sum(buffers[i].padding for i in u.buffers)
        data = sum(buffers[i].numel for i in u.buffers)
        if data and pad / data > 0.01 and pad > 4096:
            out.append(f"unit {u.name}: padding wastes {100 * pad / data:.2f}% ({pad:,} elements); "
                       f"fewer ranks per shard group or row sizes dividing the shard size reduce it")
    # (FP8 compute's float8 gathers are left out: their cast replaces torchao's own, adding neither time nor error)
    local = [b for b in buffers if ((b.gather_dtype and not b.tensorwise) or b.reduce_quant) and b.group_size == 1]
    if local:
        out.append(f"{len(local)} buffer(s) quantize their gathers or gradient reduction (gather_dtype/reduce_dtype) "
                   f"over a shard group of one: nothing crosses the network, so quantizing only costs time and adds "
                   f"error; it pays where the gathers are exposed on the network (docs/low_precision.md)")
    copy = [b for b in buffers if b.copy_out]
    if copy:
        out.append(f"{len(copy)} buffer(s) need a copy-out after each all-gather (spec shards a dim other than 0, "
                   f"several dims, or zero-copy placement would pad too much): units "
                   + ", ".join(natural_sorted({b.unit for b in copy})[:6]))
    return tuple(out)
