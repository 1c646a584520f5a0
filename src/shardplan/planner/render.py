"""Human-readable views of a plan: the table ``str(plan)`` prints, the schedule, a Chrome trace."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from .. import layout as L
from ..dtypes import itemsize
from .accounting import coverage, low_precision_masters, optimizer_state_dtypes
from .capture import describe as describe_capture
from . import context_parallel as CPX, expert_parallel as EPX, tensor_parallel as TPX
from .offload import HOST_GBPS, host_step_bytes
from .kinds import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COPY_D2H, COPY_H2D, FREE, OPTIM_STEP, PARAMS, PREPARE,
                    REDUCE_SCATTER, SCALES, WAIT)
from .kinds import Strategy, strategy_level

if TYPE_CHECKING:  # pragma: no cover
    from .facade import Plan


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _shape(s) -> str:
    return "(" + ", ".join(map(str, s)) + ")"


def header(plan: "Plan") -> str:
    dtypes = sorted({p.dtype for p in plan.params})
    compute = plan.compute_dtype or "their own dtype"
    reduce = plan.reduce_dtype or ("the compute dtype" if plan.compute_dtype else "their own dtype")
    if any(b.reduce_quant for b in plan.buffers):
        reduce = f"{reduce} (quantized per block, all-to-all, summed in fp32)"
    return (f"shardplan {plan.strategy} on {plan.mesh!r}: parameters stored in {'/'.join(dtypes)}, computed in "
            f"{compute}, gradients reduced in {reduce}; prefetch {plan.prefetch}, "
            f"reshard after forward {plan.reshard_after_forward}, order {plan.order}; fingerprint {plan.fingerprint()}")


def activations_note(plan: "Plan", rank: int, m) -> str:
    """What the printed peak says about activations: included (traced) or not."""
    if m.activations is None:
        why = ("tensor parallelism: not measured yet" if TPX.of(plan).axes else
               "plan with trace=example inputs, CLI --trace-tokens, to count them")
        return f"(activations not counted: {why})"
    ck = plan.memory(rank, recompute=True)
    return (f"(activations included: {fmt_bytes(m.activations)} of it, traced on {plan.activations.inputs}; with every "
            f"unit checkpointed the peak is {fmt_bytes(ck.peak)}, activations {fmt_bytes(ck.activations)})")


def render(plan: "Plan", rank: int = 0, max_rows: int = 100_000) -> str:
    """The parameter table, units, memory, bytes per step and warnings; ``max_rows=0`` for a summary."""
    c = plan.comm_bytes(rank)
    out = _param_table(plan, rank, max_rows) + [""] + _units(plan, max_rows) + _memory(plan, rank, c) \
        + _sent(plan, c) + _axes(plan) + _closing(plan, rank)
    return "\n".join(out)


def _param_table(plan: "Plan", rank: int, max_rows: int) -> list[str]:
    """The header, the parameter table (``max_rows`` of it), the totals and the packing."""
    tp = bool(TPX.of(plan).axes or EPX.of(plan).modules)  # then: the global shape, what a rank computes with, its shard
    head = ("parameter", "shape", "dtype", "spec") + ((("tp-local shape" if TPX.of(plan).axes else "ep-local shape"),)
                                                      if tp else ()) + \
        ("local shape", "unit", "bytes/rank")
    rows = []
    for p in plan.params[:max_rows]:
        local = plan.local_shape(p.name, rank)
        rows.append((p.name + (" (tied)" if p.aliases else ""), _shape(p.global_shape), p.dtype, repr(p.spec))
                    + ((_shape(p.shape),) if tp else ()) + (_shape(local), p.unit, f"{math.prod(local) * itemsize(p.dtype):,}"))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda r: "  ".join(c.ljust(w) if i < len(head) - 1 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    out = [header(plan)] + [x for x in [nothing_sharded(plan)] if x]
    if rows:
        out += [line(head), line(tuple("-" * w for w in widths))] + [line(r) for r in rows]
    if len(plan.params) > max_rows and max_rows:
        out.append(f"... {len(plan.params) - max_rows} more parameters")
    total, padding = sum(math.prod(p.global_shape) for p in plan.params), sum(b.padding for b in plan.buffers)
    out.append(f"{len(plan.params)} parameters, {total:,} elements, {len(plan.units)} units, {len(plan.buffers)} buffers, "
               f"padding {padding:,} elements ({100 * padding / max(sum(p.numel for p in plan.params), 1):.3f}%)")
    packed = sum(1 for p in plan.params if plan.buffers[p.buffer].layout == L.CONTIGUOUS
                 and coverage(plan.mesh, p, plan.buffers[p.buffer])[0] < plan.buffers[p.buffer].group_size)
    if packed:
        out.append(f"{packed} parameters are packed contiguously onto a subset of their group's ranks "
                   f"(zero copy-out; every rank still stores exactly S elements per buffer)")
    return out


def _units(plan: "Plan", max_rows: int) -> list[str]:
    """Each unit's buffers, in forward order (the first 4 and last 2 of a summary's many)."""
    out = ["units (forward order):"]
    shown = plan.units if max_rows or len(plan.units) <= 8 else plan.units[:4] + plan.units[-2:]
    for u in shown:
        bufs = [plan.buffers[i] for i in u.buffers]
        desc = "; ".join(f"#{b.index} {b.layout} {b.dtype}->{b.compute_dtype}"
                         f"{' (gathered as ' + b.gather_dtype + ')' if b.gather_dtype else ''} axes={','.join(b.axes) or '-'} "
                         f"S={b.shard_numel:,} pad={b.padding:,}" for b in bufs)
        out.append(f"  {u.name:<28} reshard_after_forward={u.reshard_after_forward!s:<5} {desc}")
    if len(shown) < len(plan.units):
        out.insert(len(out) - 2, f"  ... {len(plan.units) - len(shown)} more units")
    return out


def _memory(plan: "Plan", rank: int, c: dict) -> list[str]:
    """Device memory on ``rank``; under offload, host memory and the host step."""
    m = plan.memory(rank)
    out = [""]
    where = "device memory" if plan.offload else "memory"
    out.append(f"{where} on rank {rank}: params {fmt_bytes(m.params)}, grads {fmt_bytes(m.grads)}, "
               f"optimizer {fmt_bytes(m.optimizer)} ({states_said(plan)}), "
               f"gathered peak {fmt_bytes(m.gathered_peak)}, peak {fmt_bytes(m.peak)} " + activations_note(plan, rank, m))
    if plan.offload:
        hosted = [b for b in plan.buffers if b.offload]
        trainable = sum(b.shard_numel * b.itemsize for b in plan.buffers if b.requires_grad)
        share = sum(b.shard_numel * b.itemsize for b in hosted if b.requires_grad) / max(trainable, 1)
        out.append(f"host memory on rank {rank}: {fmt_bytes(m.host)} (offload={plan.offload}: {len(hosted)} of "
                   f"{len(plan.buffers)} buffers, {100 * share:.0f}% of the trainable shard bytes; master, gradient and "
                   f"{plan.optimizer_states} state shards), host peak {fmt_bytes(m.host_peak)}, pinned on a GPU "
                   f"{fmt_bytes(m.host_pinned)} (power-of-two slabs); copied per step: "
                   f"device->host {fmt_bytes(c['copy_d2h'])}, host->device {fmt_bytes(c['copy_h2d'])}; the host steps "
                   f"each buffer as its gradient arrives (optim_step), overlapping backward and the next forward")
        out.append(f"host step: {fmt_bytes(host_step_bytes(plan.buffers, plan.optimizer_states))} of host memory "
                   f"traffic, ~{1e3 * plan.host_step_s(HOST_GBPS):.3g} ms at {HOST_GBPS:g} GB/s (measure yours: "
                   f"benchmarks/host_adamw.py); a step takes at least max(device step, host step): offload less "
                   f"(offload_fraction, plan.balanced_offload_fraction) where the device step is shorter")
    return out


def _sent(plan: "Plan", c: dict) -> list[str]:
    """Bytes sent per step per rank, by kind and compute axis; the quantized gathers' share."""
    out = []
    tp_part = ""
    if TPX.of(plan).axes:
        tp_part = (f", tensor-parallel activations {fmt_bytes(c['tensor_parallel'])}" if c["tensor_parallel"] is not None
                   else ", tensor-parallel activations not estimated (plan with trace=example inputs)")
    if EPX.of(plan).modules:
        tp_part += (f", expert all-to-all {fmt_bytes(c['expert_parallel'])}" if c["expert_parallel"] is not None
                    else ", expert all-to-all not estimated (plan with trace=example inputs)")
    if "cp" in plan.mesh.axis_names:
        tp_part += (f", context-parallel keys/values {fmt_bytes(c['context_parallel'])}"
                    if c["context_parallel"] is not None
                    else ", context-parallel keys/values not estimated (plan with trace=example inputs)")
    out.append(f"sent per step per rank: all_gather {fmt_bytes(c['all_gather'])}, reduce_scatter "
               f"{fmt_bytes(c['reduce_scatter'])}, all_reduce {fmt_bytes(c['all_reduce'])}{tp_part}, "
               f"total {fmt_bytes(c['total'])}")
    if "gather_scales" in c:
        q = [b for b in plan.buffers if b.gather_dtype and not b.tensorwise]
        full = sum(b.gathered_numel * b.compute_itemsize for b in q)
        wire = sum(b.gather_bytes for b in q)
        out.append(f"quantized gathers ({', '.join(sorted({b.gather_dtype for b in q}))}): {len(q)} buffers, all_gather "
                   f"includes {fmt_bytes(c['gather_scales'])} of fp32 block scales; their gathers carry "
                   f"{100 * wire / max(full, 1):.1f}% of the compute-dtype bytes")
    return out


def _axes(plan: "Plan") -> list[str]:
    """FP8 compute, the expert, context and compute axes."""
    out = []
    if plan.fp8_modules:
        out.append(fp8_line(plan))
    if EPX.of(plan).modules:
        m0 = EPX.of(plan).modules[0]
        out.append(f"expert axis {m0.axis}: {len(EPX.of(plan).modules)} expert modules, {m0.local_experts} of "
                   f"{m0.num_experts} experts per rank, tokens dispatched and combined by all-to-all; the batch is "
                   f"split {plan.data_size} ways over {', '.join(plan.data_axes)}")
    if "cp" in plan.mesh.axis_names:
        cp = plan.mesh.axis_size("cp")
        calls = CPX.of(plan).calls
        seen = (f"{len(calls)} attention calls traced, each all-gathering its keys and values over cp (and "
                f"reduce-scattering their gradients)" if calls is not None else "attention calls not traced")
        out.append(f"context axis cp={cp}: each rank holds 2 of {2 * cp} chunks of every sequence; {seen}")
    if TPX.of(plan).axes:
        out.append(f"compute axes {', '.join(TPX.of(plan).axes)}: {len(TPX.of(plan).modules)} modules tensor-parallel; the batch "
                   f"is split {plan.data_size} ways over {', '.join(plan.data_axes)}")
        out += render_tp(plan)
    return out


def _closing(plan: "Plan", rank: int) -> list[str]:
    """The schedule's size, what keeps it from capture, the planner's choices and the warnings."""
    out = []
    out.append(f"schedule: {len(plan.schedule)} ops ({sum(o.is_collective for o in plan.schedule)} collectives)")
    out.append(describe_capture(plan))
    if plan.notes:
        out.append("")
        out.append("planner's choices:")
        out += [f"  - {n}" for n in plan.notes]
    said = list(plan.warnings) + masters_warning(plan, rank)
    if said:
        out.append("")
        out.append("warnings:")
        out += [f"  - {w}" for w in said]
    return out


def states_said(plan: "Plan") -> str:
    """``2 fp32 states``: how many optimizer states per parameter, in which dtype (the parameters' own: what a
    torch optimizer keeps)."""
    dtypes = optimizer_state_dtypes(plan) or ["float32"]
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
    return f"{plan.optimizer_states} {'/'.join(short.get(d, d) for d in dtypes)} states"


def nothing_sharded(plan: "Plan") -> str:
    """A line for a plan whose strategy shards but whose specs shard nothing (every parameter ``P()``), or ``""``."""
    if plan.strategy == Strategy.NO_SHARD or plan.mesh.size == 1 or TPX.of(plan).axes or EPX.of(plan).modules:
        return ""
    if any(b.axes for b in plan.buffers):
        return ""
    return (f"nothing is sharded: every parameter's spec names no mesh axis (P(), replicated), so each of the "
            f"{plan.mesh.size} ranks holds all parameters, gradients and optimizer states, as under no_shard: "
            f"{plan.strategy} only all-reduces the gradients. Shard them with rules naming a mesh axis, e.g. "
            f"[(r\".*\", P({plan.mesh.axis_names[0]!r}))]")


def masters_warning(plan: "Plan", rank: int = 0) -> list[str]:
    """The trainable parameters kept in 16 bits with no fp32 master copy: said with the fix (fp32 masters)."""
    n, size = low_precision_masters(plan, rank)
    if not n:
        return []
    dtypes = "/".join(sorted({p.dtype for p in plan.params if p.requires_grad and itemsize(p.dtype) == 2}))
    return [f"{n} trainable parameter(s) ({fmt_bytes(size)} on rank {rank}) are stored in {dtypes} with no fp32 "
            f"master weights: a torch optimizer keeps its states in {dtypes} too (counted so above) and rounds away "
            f"updates below that dtype's precision (bf16: about 2^-8 of a weight). Keep fp32 masters and compute in {dtypes}: an fp32 model "
            f"planned with compute_dtype=\"bf16\" (CLI: --param-dtype fp32 --dtype bf16; fully_shard: "
            f"MixedPrecisionPolicy(param_dtype=torch.bfloat16) on an fp32 model; fully_shard_model: "
            f"preserve_fp32_weights=True), at twice the parameter and optimizer-state bytes"]


def render_tp(plan: "Plan") -> list[str]:
    """The tensor-parallel modules of the root and of the first unit that has any (others repeat it),
    with the collectives each issues (the schedule's ``activations`` ops)."""
    tp_paths = {m.path for m in TPX.of(plan).modules}
    ops = [o for o in plan.schedule if o.in_module and o.at in tp_paths]  # (cp and ep ops: their own lines)
    if not TPX.of(plan).modules:
        return []
    by_path: dict[str, list[str]] = {}
    for o in ops:
        if o.when in ("recompute", "recompute_whole"):
            continue
        side = "forward" if o.event == "module_forward" else "backward"
        what = "output" if side == "forward" else "input's gradient"
        by_path.setdefault(o.at, []).append(f"{side}: {o.kind} of the {what}")
    units = list(dict.fromkeys(m.unit for m in TPX.of(plan).modules))
    shown = [u for u in units if u in ("", "<root>")] + [u for u in units if u not in ("", "<root>")][:1]
    out = [f"  tensor-parallel modules (shown for {', '.join(shown)}; {len(units)} units have some):"]
    for m in TPX.of(plan).modules:
        if m.unit not in shown:
            continue
        acts = "; ".join(by_path.get(m.path, [])) or "no collective"
        if m.shares_with:
            acts = f"reads {m.shares_with.rpartition('.')[2]}'s input: its gradient is all-reduced once, there"
        out.append(f"    {m.path:<34} {m.kind + ' ' + m.style:<25} {acts}")
    n_f = sum(o.event == "module_forward" and not o.when for o in ops)
    n_b = sum(o.event == "module_backward" for o in ops)
    n_r = sum(o.when == "recompute" for o in ops)
    n_w = sum(o.when == "recompute_whole" for o in ops)
    out.append(f"  activation collectives per step: {n_f} in forward, {n_b} in backward, {n_r} more when units are "
               f"recomputed (activation checkpointing; {n_r + n_w} if recomputed whole, without torch's early stop); "
               f"plan.ops() lists them in order")
    return out


def fp8_line(plan: "Plan") -> str:
    """FP8 compute: which Linears, what their gathers carry, and where the float8 matmuls pay (planner/float8.py)."""
    mods = plan.fp8_modules
    pays = sorted(m.min_tokens for m in mods if m.min_tokens)
    gathered = tw = 0  # the bytes the float8 Linears' weights take in the all-gathers, per step and rank
    for m in mods:
        p = plan.param(m.weight)
        b, u = plan.buffers[p.buffer], next(u for u in plan.units if u.name == p.unit)
        tw += b.tensorwise
        if strategy_level(plan.strategy) >= 3 and b.sharded and b.group_size > 1:
            times = 2 if u.reshard_after_forward else 1
            gathered += times * p.numel * b.gathered_itemsize * (b.group_size - 1) // b.group_size
    span = f"{pays[0]:,d}" if pays and pays[0] == pays[-1] else f"{pays[0]:,d} to {pays[-1]:,d}" if pays else ""
    where = (f"FP8 matmuls pay from {span} tokens per rank per step for {len(pays)} of them, "
             f"never for {len(mods) - len(pays)}" if pays else "FP8 matmuls pay for none of them at any batch")
    c = plan.comm_bytes()
    how = (f"all-gathered as float8 codes ({fmt_bytes(gathered)} of all_gather per step; absmax all-reduce "
           f"{fmt_bytes(c.get('fp8_amax', 0))}), bound to torchao without a dequantize" if tw else
           f"gathered in the compute dtype ({fmt_bytes(gathered)} of all_gather per step) and cast to float8 after "
           f"the gather")
    return (f"fp8 compute (torchao Float8Linear, tensorwise scales): {len(mods)} Linear modules; their weights are "
            f"{how}; {where} (rule of thumb, docs/low_precision.md#fp8-compute)")


def _quantized(plan: "Plan", op) -> str:
    """The quantized gather formats of ``op``'s buffers ("int8", "int8+float8_e4m3fn", or "")."""
    return "+".join(sorted({plan.buffers[i].gather_dtype for i in op.buffers
                            if plan.buffers[i].gather_dtype and not plan.buffers[i].tensorwise}))


def _tensorwise(plan: "Plan", op) -> int:
    """The absmax bytes all-reduced before ``op``'s tensorwise (FP8 compute) gathers; 0: none."""
    return sum(plan.buffers[i].amax_bytes or (4 if plan.buffers[i].tensorwise else 0) for i in op.buffers)


def render_schedule(plan: "Plan") -> str:
    """The schedule, one op per line under the event that triggers it: where each collective is issued
    and where it is waited on."""
    lines, last = [], None
    for i, op in enumerate(plan.schedule):
        if op.trigger != last:
            lines.append(f"{op.trigger}:")
            last = op.trigger
        flags = (" prefetch" if op.prefetch else "") + (f"  [{op.when}]" if op.when else "")
        if op.kind in (COPY_D2H, COPY_H2D, OPTIM_STEP):
            body = f"{op.kind} {op.what} {op.unit or 'all'}, {fmt_bytes(op.bytes)}"
        elif op.is_collective:
            ax = ",".join(op.axes) or "local"
            body = f"{op.kind} {op.what} {op.unit or 'all'} over {ax}, {fmt_bytes(op.bytes)}"
            q, tw = _quantized(plan, op), _tensorwise(plan, op)
            if q and op.kind == ALL_GATHER:
                body = f"quantize {q} (fp32 block scales), " + body
            if tw and op.kind == ALL_GATHER:
                body = "quantize float8 (one scale per weight), " + body
            if op.what == SCALES:
                body = f"absmax (max) of float8 weights, then their scales: {body}"
        else:
            body = f"{op.kind} {op.what} {op.unit or 'all'}"
            q = _quantized(plan, op)
            if q and op.kind == WAIT and op.what == PARAMS:
                body += f", dequantize {q} -> compute dtype"
            if _tensorwise(plan, op) and op.kind == WAIT and op.what == PARAMS:
                body += ", float8 weights to torchao as they are (no dequantize)"
        lines.append(f"  {i:>4}  {body}{flags}")
    return "\n".join(lines)


def chrome_trace(plan: "Plan", path: str, gbps: float) -> None:
    """One track per op kind; each collective's length is its payload at ``gbps`` GB/s, laid end to end
    per track in schedule order; waits and frees are instants."""
    tracks = {ALL_GATHER: 1, REDUCE_SCATTER: 2, ALL_REDUCE: 3, WAIT: 4, FREE: 5, PREPARE: 6, COPY_D2H: 7, COPY_H2D: 8,
              OPTIM_STEP: 9, ALL_TO_ALL: 10}
    clock = {t: 0.0 for t in tracks.values()}
    start = 0.0
    events = []
    for i, op in enumerate(plan.schedule):
        if op.when in ("recompute", "recompute_whole"):  # a training step without activation checkpointing
            continue
        tid = tracks[op.kind]
        dur = max(op.bytes / (gbps * 1e3), 1.0)  # microseconds
        ts = max(clock[tid], start)
        events.append({"name": f"{op.kind} {op.unit}", "cat": op.phase, "ph": "X", "pid": 0, "tid": tid,
                       "ts": ts, "dur": dur, "args": {"index": i, "unit": op.unit, "trigger": op.trigger,
                                                      "bytes": op.bytes, "axes": list(op.axes), "when": op.when,
                                                      "prefetch": op.prefetch, "what": op.what}})
        clock[tid] = ts + dur
        start = ts + (0.0 if op.prefetch else 0.5)
    write_trace(path, {str(k): t for k, t in tracks.items()}, events)


def write_trace(path: str, tracks: dict[str, int], events: list[dict]) -> None:
    """A Chrome/Perfetto trace file: one named track (``tid``) per entry of ``tracks``, then ``events``
    (``"ph": "X"`` slices with ``ts``/``dur`` in microseconds). The planned schedule and the forecast's
    predicted timeline are both written through here."""
    meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
            for name, tid in tracks.items()]
    with open(path, "w") as f:
        json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
