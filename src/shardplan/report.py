"""Human-readable views of a plan: the table ``str(plan)`` prints, and its warnings."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from . import layout as L
from .dtypes import itemsize
from .units import ROOT

if TYPE_CHECKING:
    from .plan import Plan


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _shape(s) -> str:
    return "(" + ", ".join(map(str, s)) + ")"


def _coverage(plan: "Plan", p) -> tuple[int, bool]:
    """(ranks of its shard group that hold a piece, whether pieces differ in size). O(1) per param."""
    b = plan.buffers[p.buffer]
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
    for d, size in enumerate(p.shape):
        axes = p.spec.dim_axes(d)
        if axes:
            parts = plan.mesh.axis_size(axes)
            c = -(-size // parts)
            held *= min(parts, -(-size // c)) if size else 0
            uneven |= size % parts != 0
    return held, uneven


def plan_warnings(plan: "Plan") -> tuple[str, ...]:
    out = []
    empty, uneven = [], []
    for p in plan.params:
        if plan.buffers[p.buffer].layout == L.CONTIGUOUS:
            continue  # packed by design: ranks hold whole rows of some parameters, S bytes each
        held, odd = _coverage(plan, p)
        W = plan.buffers[p.buffer].group_size
        if held < W:
            empty.append(f"{p.name} {_shape(p.shape)} on {held}/{W}")
        elif odd:
            uneven.append(p.name)
    if empty:
        out.append(f"{len(empty)} parameter(s) are held by only some ranks of their shard group (others hold none): "
                   + "; ".join(empty[:6]) + (" ..." if len(empty) > 6 else "")
                   + ". Shard a larger dimension, or replicate them with P()")
    if uneven:
        out.append(f"{len(uneven)} parameter(s) have uneven shards (dimension not divisible by the shard count): "
                   + ", ".join(uneven[:6]) + (" ..." if len(uneven) > 6 else ""))
    for u in plan.units:
        pad = sum(plan.buffers[i].padding for i in u.buffers)
        data = sum(plan.buffers[i].numel for i in u.buffers)
        if data and pad / data > 0.01 and pad > 4096:
            out.append(f"unit {u.name}: padding wastes {100 * pad / data:.2f}% ({pad:,} elements); "
                       f"fewer ranks per shard group or row sizes dividing the shard size reduce it")
    copy = [b for b in plan.buffers if b.copy_out]
    if copy:
        out.append(f"{len(copy)} buffer(s) need a copy-out after each all-gather (spec shards a dim other than 0, "
                   f"several dims, or zero-copy placement would pad too much): units "
                   + ", ".join(sorted({b.unit for b in copy})[:6]))
    return tuple(out)


def render(plan: "Plan", rank: int = 0, max_rows: int = 100_000) -> str:
    header = ("parameter", "shape", "dtype", "spec", "local shape", "unit", "bytes/rank")
    rows = []
    for p in plan.params[:max_rows]:
        local = plan.local_shape(p.name, rank)
        rows.append((p.name + (" (tied)" if p.aliases else ""), _shape(p.shape), p.dtype, repr(p.spec), _shape(local),
                     p.unit, f"{math.prod(local) * itemsize(p.dtype):,}"))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda r: "  ".join(c.ljust(w) if i < 6 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    out = [f"shardplan {plan.strategy} on {plan.mesh!r}  compute={plan.compute_dtype or 'param dtype'} "
           f"reduce={plan.reduce_dtype or 'compute dtype'} prefetch={plan.prefetch} "
           f"reshard_after_forward={plan.reshard_after_forward}  fingerprint={plan.fingerprint()}",
           line(header), line(tuple("-" * w for w in widths))]
    out += [line(r) for r in rows]
    if len(plan.params) > max_rows:
        out.append(f"... {len(plan.params) - max_rows} more parameters")
    total = sum(p.numel for p in plan.params)
    out.append(f"{len(plan.params)} parameters, {total:,} elements, {len(plan.units)} units, {len(plan.buffers)} buffers, "
               f"padding {plan.padding:,} elements ({100 * plan.padding / max(total, 1):.3f}%)")
    packed = sum(1 for p in plan.params if plan.buffers[p.buffer].layout == L.CONTIGUOUS
                 and _coverage(plan, p)[0] < plan.buffers[p.buffer].group_size)
    if packed:
        out.append(f"{packed} parameters are packed contiguously onto a subset of their group's ranks "
                   f"(zero copy-out; every rank still stores exactly S elements per buffer)")
    out.append("")
    out.append("units (forward order):")
    for u in plan.units:
        bufs = [plan.buffers[i] for i in u.buffers]
        desc = "; ".join(f"#{b.index} {b.layout} {b.dtype}->{b.compute_dtype} axes={','.join(b.axes) or '-'} "
                         f"S={b.shard_numel:,} pad={b.padding:,}" for b in bufs)
        out.append(f"  {u.name:<28} reshard_after_forward={u.reshard_after_forward!s:<5} {desc}")
    m = plan.memory(rank)
    out.append("")
    out.append(f"memory on rank {rank}: params {fmt_bytes(m.params)}, grads {fmt_bytes(m.grads)}, "
               f"optimizer {fmt_bytes(m.optimizer)} ({plan.optimizer_states} fp32 states), "
               f"gathered peak {fmt_bytes(m.gathered_peak)}, peak {fmt_bytes(m.peak)} (activations not counted)")
    c = plan.comm_bytes(rank)
    out.append(f"sent per step per rank: all_gather {fmt_bytes(c['all_gather'])}, reduce_scatter "
               f"{fmt_bytes(c['reduce_scatter'])}, all_reduce {fmt_bytes(c['all_reduce'])}, total {fmt_bytes(c['total'])}")
    out.append(f"schedule: {len(plan.schedule)} ops ({sum(o.kind != 'free' for o in plan.schedule)} collectives)")
    if plan.warnings:
        out.append("")
        out.append("warnings:")
        out += [f"  - {w}" for w in plan.warnings]
    return "\n".join(out)


def render_schedule(plan: "Plan") -> str:
    return "\n".join(f"{i:>4} {op}" for i, op in enumerate(plan.schedule))
