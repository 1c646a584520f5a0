"""``forecast(plan, network, compute, batch=...)``: one rank's training step as the executor would run it,
timed. Pure: the plan's program and ops, a network and a compute model in; a :class:`Forecast` out.

>>> f = forecast(plan, "h100-8x-ib400", batch=(1, 4096))      # or plan.forecast(network=..., batch=...)
>>> print(f)

The walk follows ``plan.program`` (the order the executor runs steps in) and the ops of a training step
(``plan.ops()``: stale shards, a backward, synchronised gradients). Each unit's forward runs after its
``pre_forward`` step, its backward after its ``pre_backward`` step; the root unit's own forward (output
head, loss) runs just before ``post_forward(<root>)`` and its backward right after ``begin_backward``;
the optimizer runs after ``end_backward``. All-gathers go on the gather stream, reduce-scatters and
all-reduces of gradients on the reduce stream, the used-parameter exchange on its own; ``wait`` ops stall
compute until what they wait for has ended. Tensor-parallel activation collectives block compute.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional, Union

from ..errors import ForecastError
from ..planner.kinds import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BEGIN_BACKWARD, GRADS, PARAMS, PARTIAL_GRADS, POST_FORWARD,
                          PRE_BACKWARD, PRE_FORWARD, SCALES, USED, WAIT)
from ..units import ROOT
from .compute import ComputeModel, compute_model
from .flops import model_flops, unit_flops, unit_widths
from .traffic import traced_bytes, unit_traffic
from .network import Network, Placement, Timing, check_fits, collective_time, network as resolve_network, placement
from .result import CollectiveForecast, Forecast
from .timeline import Comm, Issue, Item, Run, Wait, Work, simulate
from .tp_comm import activation_collectives
from ..planner.geometry import check_rank
from ..planner.offload import HOST_GBPS
from ..planner import context_parallel as CPX, expert_parallel as EPX, tensor_parallel as TPX

if TYPE_CHECKING:  # pragma: no cover
    from ..planner.facade import Plan


def _batch(batch: Any) -> tuple[int, int]:
    try:
        b, t = batch
        b, t = int(b), int(t)
        assert b > 0 and t > 0 and (b, t) == tuple(batch)
    except (TypeError, ValueError, AssertionError):
        raise ForecastError(f"batch must be (B, T) per rank, two positive integers, e.g. (1, 4096); got {batch!r}") from None
    return b, t


def _stream(kind: str, what: str) -> str:
    if what == USED:
        return "used"
    return "gather" if kind == ALL_GATHER or what == SCALES else "reduce"


def _unit_times(plan: "Plan", cm: ComputeModel, batch: tuple[int, int]) -> tuple[dict[str, tuple[float, float]], list[str], dict]:
    """(forward, backward) seconds per unit, notes, and how the forward + backward time splits
    (``{"matmul_s", "memory_s", "copies_s", "memory_bytes", "traffic"}``; empty for measured units)."""
    measured = cm.measured
    notes = []
    if measured:
        unknown = sorted(set(measured) - {u.name for u in plan.units})
        if unknown:
            raise ForecastError(f"compute model {cm.name!r} times units {unknown[:4]} that this plan does not have "
                                f"(units: {[u.name for u in plan.units][:6]} ...); measure with the same units")
        if cm.batch is not None and tuple(cm.batch) != batch:
            raise ForecastError(f"compute model {cm.name!r} was measured at batch {cm.batch[0]}x{cm.batch[1]} per rank; "
                                f"forecast that batch, or measure at {batch[0]}x{batch[1]}")
    flops = unit_flops(plan, batch)
    widths = unit_widths(plan)
    bw = cm.memory_gbs * 1e9 if cm.memory_gbs else None
    # [Note: the memory-bound work of the model's own ops. A traced plan counts it op by op (every
    # norm, activation, rotary embedding, cast, softmax and the loss: forecast/traffic.traced_bytes); an
    # untraced one estimates it from the unit's width (elementwise_bytes per token and unit of width,
    # fitted on examples/gpt.py's blocks) plus logit_bytes per logit for the loss. Both are timed at
    # elementwise_gbs; the traced count replaces both estimates, so nothing is counted twice. The
    # runtime's own copies (whole flat buffers) run at memory_gbs, as the optimizer does]
    traced = traced_bytes(plan, batch) if bw and cm.tflops and not measured else None
    ebw = (cm.elementwise_gbs or cm.memory_gbs) * 1e9 if bw else None
    loss = unit_traffic(plan, batch, cm.logit_bytes, False) if bw and cm.logit_bytes and not traced else {}
    copies = unit_traffic(plan, batch, 0.0, True) if bw and cm.copy_traffic else {}
    out = {}
    missing = []
    parts = {"matmul_s": 0.0, "memory_s": 0.0, "copies_s": 0.0, "memory_bytes": 0.0,
             "traffic": "traced" if traced else "estimated"}
    for u in plan.units:
        if u.name in measured:
            out[u.name] = measured[u.name]
        elif cm.tflops:
            mm = flops[u.name] / (cm.tflops * 1e12)
            if traced:
                mf, mb = traced[u.name]
                # with activation checkpointing (backward_factor above 2) the backward re-runs the forward
                mb += max(0.0, cm.backward_factor - 2.0) * mf
            elif cm.elementwise_bytes and bw:  # the estimate, split as the matmuls are
                total = cm.elementwise_bytes * batch[0] * batch[1] * widths[u.name]
                mf, mb = total / (1 + cm.backward_factor), total * cm.backward_factor / (1 + cm.backward_factor)
            else:
                mf = mb = 0.0
            lf, lb = loss.get(u.name, (0.0, 0.0))     # the head's loss (estimated when untraced)
            kf, kb = copies.get(u.name, (0.0, 0.0))   # the runtime's copies and casts
            fwd, bwd = mm, cm.backward_factor * mm
            if bw:
                fwd += (mf + lf) / ebw + kf / bw
                bwd += (mb + lb) / ebw + kb / bw
                parts["memory_s"] += (mf + mb + lf + lb) / ebw
                parts["memory_bytes"] += mf + mb + lf + lb
                parts["copies_s"] += (kf + kb) / bw
            parts["matmul_s"] += (1 + cm.backward_factor) * mm
            out[u.name] = (fwd, bwd)
        else:
            missing.append(u.name)
    if missing:
        raise ForecastError(f"compute model {cm.name!r} has no time for unit(s) {missing[:4]} and no FLOP rate; give "
                            f"tflops= (achievable TFLOP/s) or measured times for every unit")
    if measured and len(measured) < len(plan.units):
        notes.append(f"{len(plan.units) - len(measured)} unit(s) not measured: timed from FLOPs at {cm.tflops:g} TFLOP/s")
    if measured:
        parts = {}
    elif bw and not traced:
        notes.append("memory-bound work estimated from each unit's width (elementwise_bytes); plan with trace= example "
                     "inputs (CLI: --trace-tokens) to count it op by op")
    return out, notes, parts


def _optimizer_s(plan: "Plan", cm: ComputeModel, rank: int) -> tuple[float, Optional[str]]:
    if cm.optimizer_s is not None:
        return cm.optimizer_s, None
    if not cm.memory_gbs:
        return 0.0, "optimizer step not timed: the compute model has neither optimizer_s nor memory_gbs"
    # [Note: the optimizer step is memory-bound: optimizer_bytes per trained local element (see
    # forecast/compute.py for the count) at the achievable bandwidth]
    elements = sum(math.prod(plan.local_shape(p.name, rank)) for p in plan.params if p.requires_grad)
    return elements * cm.optimizer_bytes / (cm.memory_gbs * 1e9), None


def _cp(plan) -> int:
    """The context-parallel degree: with ``cp`` a rank's ``batch`` holds ``T/cp`` tokens of each sequence, and
    the cp ranks of one data slice hold the rest of them (they share no token)."""
    return plan.mesh.axis_size("cp") if "cp" in plan.mesh.axis_names else 1


def forecast(plan: "Plan", network: Union[str, dict, Network], compute: Union[None, str, float, dict, ComputeModel] = None,
             *, batch: tuple[int, int], rank: int = 0, scalar_all_reduces: int = 0) -> Forecast:
    """Predicted step time of ``rank`` running ``plan`` on ``network``, per-rank ``batch = (B, T)``.

    ``compute``: a preset name, achievable TFLOP/s, a dict, a JSON file or a :class:`ComputeModel`
    (default: the network's ``device``). ``scalar_all_reduces``: blocking all-reduces of one
    number over every rank after backward (``sp.clip_grad_norm_`` issues one; a logged mean loss another).

    >>> f = forecast(plan, "h100-8x-ib400", batch=(1, 4096))
    >>> f.step_s, f.exposed_s, f.mfu
    """
    net = resolve_network(network)
    batch = _batch(batch)
    rank = check_rank(plan.mesh, rank)
    check_fits(net, plan.mesh)
    cm = compute_model(net.device if compute is None else compute)
    times, notes, parts = _unit_times(plan, cm, batch)
    opt_s, opt_note = _optimizer_s(plan, cm, rank)
    notes += [opt_note] if opt_note else []

    walk = _Walk(plan, net, rank, times, *_in_module_calls(plan, notes))
    walk.program()
    if not isinstance(scalar_all_reduces, int) or scalar_all_reduces < 0:
        raise ForecastError(f"scalar_all_reduces must be a non-negative integer; got {scalar_all_reduces!r}")
    for _ in range(scalar_all_reduces):
        walk.issue("all_reduce", "scalar", "", tuple(plan.mesh.axis_names), 8, "compute", -1)
    walk.items.append(Run(Work("optimizer step", "", "optimizer", opt_s)))

    tl = simulate(walk.items, overlap=net.overlap)
    spans = {c.id: c for c in tl.comms}
    collectives = tuple(CollectiveForecast(**r, issued_s=spans[k].issued_s, start_s=spans[k].start_s,
                                           end_s=spans[k].end_s) for k, r in enumerate(walk.records))
    sent = _sent(plan, collectives)
    phase_s = {"forward": 0.0, "backward": 0.0}
    for s in tl.compute:
        if s.kind == "compute" and s.phase in phase_s:
            phase_s[s.phase] += s.end_s - s.start_s
    places = walk.places
    ordered = [places[a] for a in sorted(places, key=lambda a: [plan.mesh.axis_names.index(x) for x in a])]
    if plan.offload:
        notes.append(_host_step_note(plan, tl.step_s))
    return Forecast(
        network=net, compute=cm, batch=batch, rank=rank, mesh=plan.mesh, strategy=str(plan.strategy),
        prefetch=plan.prefetch, fingerprint=plan.fingerprint(), step_s=tl.step_s, forward_s=phase_s["forward"],
        backward_s=phase_s["backward"], optimizer_s=opt_s, exposed_s=tl.exposed_s,
        tokens_per_step=batch[0] * batch[1] * plan.data_size * _cp(plan), flops_per_step=model_flops(plan, batch),
        collectives=collectives, spans=tl.compute, placements=tuple(ordered), bytes=tuple(sent.items()),
        notes=tuple(notes), matmul_s=parts.get("matmul_s"), memory_s=parts.get("memory_s"),
        copies_s=parts.get("copies_s"), memory_bytes=parts.get("memory_bytes"), traffic=parts.get("traffic", "measured"))


def _in_module_calls(plan: "Plan", notes: list[str]) -> tuple[list, dict[tuple[str, str], list]]:
    """The collectives that run inside a unit's compute: the tensor-parallel activation ones, and the
    context- and expert-parallel ones of the schedule ({(unit, phase): [(op, what)]}); ``notes`` gains a
    line for each kind a plan without ``trace=`` cannot forecast."""
    tp_calls = activation_collectives(plan)
    if TPX.of(plan).axes and TPX.of(plan).activations is None:
        notes.append("tensor-parallel activations not forecast: plan with trace= example inputs (CLI: --trace-tokens)")

    # [Note: context- and expert-parallel collectives (K/V all-gathers and their gradients' reduce-scatters,
    # token all-to-alls) come from the schedule's in-module ops; like tensor-parallel ones they block the
    # compute that needs them, so each is issued after its unit's compute of the pass, on the compute stream]
    if EPX.of(plan).modules and EPX.of(plan).calls is None:
        notes.append("expert all-to-alls not forecast: plan with trace= example inputs (CLI: --trace-tokens)")
    if "cp" in plan.mesh.axis_names and plan.mesh.axis_size("cp") > 1 and CPX.of(plan).calls is None:
        notes.append("context-parallel K/V all-gathers not forecast: plan with trace= example inputs (CLI: --trace-tokens)")
    tp_paths = {m.path for m in TPX.of(plan).modules}
    other_calls: dict[tuple[str, str], list] = {}
    if CPX.of(plan).calls is not None or EPX.of(plan).calls is not None:
        for op in plan.ops():
            if op.in_module and op.at not in tp_paths and op.is_collective:
                what = "tokens" if op.kind == ALL_TO_ALL else "kv"
                if (what == "tokens" and EPX.of(plan).calls is None) or (what == "kv" and CPX.of(plan).calls is None):
                    continue
                phase = "forward" if op.phase == "forward" else "backward"
                other_calls.setdefault((op.unit, phase), []).append((op, what))
    return tp_calls, other_calls


class _Walk:
    """``plan.program`` walked into timeline items: ``items`` (issues, waits, compute runs, in order),
    ``records`` (one per collective issued; its index is the simulator's id) and ``places`` (where each
    group of axes sits on the network, for ``rank``)."""

    def __init__(self, plan: "Plan", net: Network, rank: int, times: dict[str, tuple[float, float]], tp_calls,
                 other_calls: dict[tuple[str, str], list]):
        self.plan, self.net, self.rank, self.times = plan, net, rank, times
        self.tp_calls, self.other_calls = tp_calls, other_calls
        self.places: dict[tuple[str, ...], Placement] = {}
        self.records: list[dict] = []   # per collective, in issue order; index = the simulator's id
        self.items: list[Item] = []

    def where(self, axes: tuple[str, ...]) -> Placement:
        if axes not in self.places:
            self.places[axes] = placement(self.net, self.plan.mesh, self.rank, axes)
        return self.places[axes]

    def issue(self, kind: str, what: str, unit: str, axes: tuple[str, ...], payload: int, stream: str, index: int) -> int:
        w = self.where(axes)
        t: Timing = collective_time(self.net, kind, payload, w)
        n = w.size
        sent = payload * (2 if kind == ALL_REDUCE else 1) * (n - 1) // n
        cid = len(self.records)
        self.records.append(dict(index=index, kind=str(kind), what=str(what), unit=unit, axes=tuple(axes), stream=stream,
                                 link=w.link, group=n, algorithm=t.algorithm, busbw=t.busbw, payload=payload, sent=sent,
                                 latency_s=t.latency_s, transfer_s=t.transfer_s))
        name = f"{kind} {what} {unit}".strip()
        self.items.append(Issue(Comm(cid, name, stream, w.link if t.transfer_s > 0 else None, t.latency_s,
                                     t.transfer_s)))
        return cid

    def run(self, unit: str, phase: str) -> None:
        fwd, bwd = self.times[unit]
        self.items.append(Run(Work(f"{phase} {unit}", unit, phase, fwd if phase == "forward" else bwd)))
        for a in self.tp_calls:  # [Note: activation collectives sit inside the unit's compute; blocking, so after it]
            if a.unit == unit and a.phase == phase:
                self.issue(a.kind, "activations", unit, (a.axis,), a.payload, "compute", -1)
        for op, what in self.other_calls.get((unit, phase), ()):
            self.issue(op.kind, what, unit, tuple(op.axes), op.bytes, "compute", -1)

    def program(self) -> None:
        """Every step of the program in order: its ops (collectives issued, waits), then the compute its
        event starts; a collective left unwaited is waited for at the end of the step."""
        plan = self.plan
        schedule = plan.schedule
        pending: dict[tuple[str, str], list[int]] = {}
        for step in plan.program.canonical():
            if step.event == POST_FORWARD and step.at == ROOT:
                self.run(ROOT, "forward")
            for i in step.ops:
                op = schedule[i]
                if not op.applies():
                    continue
                if op.is_collective:
                    cid = self.issue(op.kind, op.what, op.unit, tuple(op.axes), op.bytes, _stream(op.kind, op.what), i)
                    # (FP8 compute's scales: the unit's wait for its parameters waits for them too)
                    # (partial gradients: the unit's wait for its gradients waits for their sum too)
                    key = PARAMS if op.what == SCALES else GRADS if op.what == PARTIAL_GRADS else op.what
                    pending.setdefault((op.unit, key), []).append(cid)
                elif op.kind == WAIT:
                    ids = tuple(pending.pop((op.unit, op.what), ()))
                    if ids:
                        self.items.append(Wait(ids, f"wait {op.what} {op.unit}".strip()))
            if step.event == PRE_FORWARD and step.at != ROOT:
                self.run(step.at, "forward")
            elif step.event == BEGIN_BACKWARD:
                self.run(ROOT, "backward")
            elif step.event == PRE_BACKWARD:
                self.run(step.at, "backward")
        leftover = [cid for ids in pending.values() for cid in ids]
        if leftover:  # a schedule edited to leave a collective unwaited: the step still ends with it
            self.items.append(Wait(tuple(leftover), "end of step"))


def _sent(plan: "Plan", collectives) -> dict[str, Optional[int]]:
    """Bytes this rank sends per step, by kind of collective and by compute axis, and their total."""
    sent = {str(ALL_GATHER): 0, "reduce_scatter": 0, str(ALL_REDUCE): 0}
    for c in collectives:
        if c.index >= 0:
            sent[c.kind] += c.sent
    sent["total"] = sum(sent.values())
    if any(b.amax_bytes for b in plan.buffers):  # (already in all_reduce and the total, as plan.comm_bytes() has it)
        sent["fp8_amax"] = sum(c.sent for c in collectives if c.what == SCALES)
    if TPX.of(plan).axes:
        sent["tensor_parallel"] = None if TPX.of(plan).activations is None else sum(c.sent for c in collectives
                                                                               if c.what == "activations")
        if sent["tensor_parallel"] is not None:
            sent["total"] += sent["tensor_parallel"]
    if EPX.of(plan).modules:
        sent["expert_parallel"] = None if EPX.of(plan).calls is None else sum(c.sent for c in collectives
                                                                             if c.what == "tokens")
        if sent["expert_parallel"] is not None:
            sent["total"] += sent["expert_parallel"]
    if "cp" in plan.mesh.axis_names:
        sent["context_parallel"] = None if CPX.of(plan).calls is None else sum(c.sent for c in collectives
                                                                               if c.what == "kv")
        if sent["context_parallel"] is not None:
            sent["total"] += sent["context_parallel"]
    return sent


def _host_step_note(plan: "Plan", step_s: float) -> str:
    """[Note: the host step's bound] (planner/offload.py): under CPU offload the step is at least the host step."""
    host_s = plan.host_step_s(HOST_GBPS)
    bound = "host-bound: the step takes at least the host step" if host_s > step_s else \
        "the overlap can hide it (backward and the next forward)"
    return (f"CPU offload: host step ~{1e3 * host_s:.1f} ms at {HOST_GBPS:g} GB/s of host memory bandwidth "
            f"(benchmarks/host_adamw.py measures yours) against a device step of {1e3 * step_s:.1f} ms: "
            f"{bound}; not included in step_s")
