"""``rehearse(network=...)``: the rehearsal's steps under the emulated network (runtime/emulated.py), and what
the network cost them: step time, tokens/s and MFU, the communication compute waited for (in total and per op
kind), the overlap, and a Chrome trace of one step (docs/rehearse.md#under-a-network).

How exposure is measured: the same steps run in passes, in one process on one model: with the network's time
(the steps shown), with it switched off (:func:`shardplan.runtime.emulated.timed_kinds` ``()``: every op
completes at once, with the same outputs and the same host work), and, eagerly, with only one op kind timed.
``exposed_s`` is the median step with the network minus the median without; ``exposed_by_kind[k]`` the median
step with only ``k`` timed minus the median without. Both are differences of measured medians (so they carry
the steps' noise; a negative one is reported as 0); the modelled times come from the ledger.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..step_call import scalar_of
from ..errors import RehearsalError, ShardingError
from ..forecast.network import Network, network as _network
from ..metrics import flops_per_token, peak_tflops
from ..runtime import emulated_time as ET
from .result import NetworkTiming
from .timing import Clock, UnitTimer


def check(plan, network, trace: Optional[str]) -> Optional[Network]:
    """The network a rehearsal runs under (``None``: none), or :class:`RehearsalError` naming the fix."""
    if network is None:
        if trace is not None:
            raise RehearsalError("rehearse(trace=...) writes a step under an emulated network; give network= too "
                                 "(e.g. network='h100-8x-ib400'), or trace a plan's schedule with plan.to_chrome_trace")
        return None
    tp = plan.axis("tp")
    if tp is not None and tp.modules:
        raise RehearsalError("rehearse(network=...) cannot time a tensor-parallel plan: DTensor's collectives "
                             "(torch's functional collectives) do not reach the emulated backend; rehearse it "
                             "without network=, or time its data axes with a plan without tp")
    try:
        return _network(network)
    except ShardingError as exc:
        raise RehearsalError(f"rehearse(network={network!r}): {exc}") from None


class Under:
    """A rehearsal under ``net``: this rank's FLOPs and tokens per step, and how to time its steps."""

    def __init__(self, net: Network, model_fn: Callable[[], nn.Module], batch: tuple[int, int], plan,
                 trace: Optional[str]):
        share = plan.data_size / plan.mesh.size
        self.net, self.trace, self.led = net, trace, ET.ledger()
        self.flops = flops_per_step(model_fn, batch, share)
        self.tokens = batch[0] * batch[1] * share

    def eager(self, run, opt, steps: int, call: Callable[[int], tuple], entries: dict) -> NetworkTiming:
        """After the eager steps (the ledger counted them): the baseline and per-kind passes, the trace."""
        led = ET.ledger()
        passes = Passes(eager_step(run.model, opt, call, run.device), steps)
        out = timing(self.net.to_dict(), list(run.step_s), led, steps, self.flops, self.tokens, run.device,
                     passes.run, True, False, self.trace)
        if self.trace:
            write_trace(self.trace, run.model, opt, entries, call, run.device, self.net.name)
        return out

    def ledger_of_step(self, k: int, batch_fn: Callable[[int], tuple]) -> Callable[[int], tuple]:
        """``batch_fn``, counting the ledger over step ``k`` alone (a captured rehearsal's last eager step)."""
        def wrapped(i: int) -> tuple:
            if i == k:
                ET.reset_ledger()
            elif i == k + 1:
                self.led = ET.ledger()
            return batch_fn(i)
        return wrapped

    def captured(self, run, step_s: list, rerun: Callable[[], tuple]) -> NetworkTiming:
        """The replays' figures; the baseline is a second capture, replayed with the network switched off."""
        def passes(kind_sets: list) -> list:
            out = []
            for kinds in kind_sets:
                with ET.timed_kinds(kinds):
                    out.append(list(rerun()))
            return out
        return timing(self.net.to_dict(), step_s, self.led, 1, self.flops, self.tokens, run.device, passes, False,
                      True, None)


def flops_per_step(model_fn: Callable[[], nn.Module], batch: tuple[int, int], data_share: float) -> float:
    """This rank's training FLOPs per step (:func:`shardplan.metrics.flops_per_token` of the unsharded model,
    built again on meta, times its tokens; ``data_share``: the fraction of a step's tokens this rank computes
    on, ``data_size / world``, below 1 where a compute axis splits the work)."""
    with torch.device("meta"):
        model = model_fn()
    cfg = getattr(model, "config", None)
    layers = next((getattr(cfg, a) for a in ("layers", "num_hidden_layers", "n_layer") if isinstance(getattr(cfg, a, None), int)), 0)
    dim = next((getattr(cfg, a) for a in ("dim", "hidden_size", "n_embd") if isinstance(getattr(cfg, a, None), int)), 0)
    b, t = batch
    return flops_per_token(model, seq=t, layers=layers, dim=dim) * b * t * data_share


def _median(xs) -> float:
    return statistics.median(xs) if xs else 0.0


class Passes:
    """The passes of one rehearsal under a network: ``step(i)`` runs one training step and returns its time."""

    def __init__(self, step: Callable[[int], float], n: int):
        self.step, self.n, self.i = step, n, 0

    def run(self, kind_sets: list) -> list[list[float]]:
        """``n`` steps for each of ``kind_sets`` (``None``: every kind timed, ``()``: none, else those kinds),
        interleaved (one step of each set in turn, so that a drift of the machine's speed falls on every
        pass alike); each pass's step times."""
        out: list[list[float]] = [[] for _ in kind_sets]
        for _ in range(self.n):
            for j, kinds in enumerate(kind_sets):
                with ET.timed_kinds(kinds):
                    out[j].append(self.step(self.i))
                self.i += 1
        return out


def per_step(led: ET.Ledger, steps: int) -> tuple[dict, dict, dict, dict]:
    """A ledger over ``steps`` steps as (modelled s, ops, bytes, waited s) per step and op kind."""
    k = max(steps, 1)
    items = sorted(led.by_kind.items())
    return ({n: e.modelled_s / k for n, e in items}, {n: e.count / k for n, e in items},
            {n: e.bytes / k for n, e in items}, {n: e.waited_s / k for n, e in items})


def timing(net_dict: dict, step_s: list, led: ET.Ledger, steps: int, flops: float, batch_tokens: float,
           device: torch.device, passes: Callable, by_kind: bool, captured: bool, trace: Optional[str]) -> NetworkTiming:
    """The network's figures. ``led`` is the ledger over ``steps`` steps with the network; ``passes(kind_sets)``
    runs the same steps once per kind set (``None``: the network, ``()``: none, ``(k,)``: only ``k``) and gives
    each set's step times; ``by_kind``: one pass per kind with modelled time besides. ``step_s``: the steps
    with the network measured already (a captured rehearsal's replays: no network pass is run again)."""
    modelled, ops, nbytes, waited = per_step(led, steps)
    kinds = [(k,) for k, sec in modelled.items() if sec > 0] if by_kind else []
    sets = ([] if captured else [None]) + [()] + kinds
    got = passes(sets)
    timed = step_s if captured else got.pop(0)
    base = got.pop(0)
    step, base_s = _median(timed), _median(base)
    exposed_by_kind = {k[0]: max(_median(times) - base_s, 0.0) for k, times in zip(kinds, got)}
    peak = peak_tflops(device) if device.type == "cuda" else None
    return NetworkTiming(
        network=net_dict, step_s=step, baseline_step_s=base_s, exposed_s=max(step - base_s, 0.0),
        exposed_by_kind=exposed_by_kind, modelled_s=modelled, ops=ops, bytes=nbytes, waited_s=waited,
        tokens_per_s_per_gpu=batch_tokens / step if step > 0 else 0.0, flops_per_step=flops, peak_tflops=peak,
        mfu=(flops / step / (peak * 1e12)) if peak and step > 0 else None, baseline_steps=tuple(base),
        captured=captured, trace=trace)


def eager_step(model: nn.Module, opt, call: Callable[[int], tuple], device: torch.device) -> Callable[[int], float]:
    """One training step, timed (CUDA events, or the host clock): forward, backward, the optimizer."""
    def step(i: int) -> float:
        args, kwargs = call(i)
        clock = Clock(device)
        clock.mark("start")
        scalar_of(model(*args, **kwargs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.mark("end")
        return clock.read()["end"]
    return step


def write_trace(path: str, model: nn.Module, opt, entries: dict, call: Callable[[int], tuple], device: torch.device,
                net_name: str) -> None:
    """One step with the network, written to ``path`` as a Chrome trace: on CUDA torch.profiler's (the comm
    streams' copy and sleep kernels beside compute's), on a CPU the step's phases and each unit's forward and
    backward on the compute thread, and each comm thread's ops on a row of its own."""
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile  # torch.profiler loads only for a trace
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            eager_step(model, opt, call, device)(0)
            torch.cuda.synchronize()
        prof.export_chrome_trace(path)
        return
    clock = Clock(device)
    timer = UnitTimer(model, entries, clock)
    try:
        args, kwargs = call(0)
        t0 = time.perf_counter()
        clock.mark("step0")
        loss = scalar_of(model(*args, **kwargs))
        clock.mark("forward1")
        timer.in_backward = True
        loss.backward()
        clock.mark("backward1")
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.mark("step1")
    finally:
        timer.remove()
    marks = clock.read()
    us = 1e6
    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "compute (this rank)"}}]
    phases = [("forward", "step0", "forward1"), ("backward", "forward1", "backward1"), ("optimizer", "backward1", "step1")]
    for name, a, b in phases:
        events.append({"ph": "X", "name": name, "pid": 0, "tid": 0, "ts": marks[a] * us, "dur": (marks[b] - marks[a]) * us})
    for u in entries:
        for what, a, b in (("forward", f"fwd0:{u}", f"fwd1:{u}"), ("backward", f"bwd0:{u}", f"bwd1:{u}")):
            if a in marks and b in marks:
                events.append({"ph": "X", "name": f"{u} {what}", "pid": 0, "tid": 1, "ts": marks[a] * us,
                               "dur": max(marks[b] - marks[a], 0.0) * us})
    events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "units (this rank)"}})
    rows: dict[str, int] = {}
    for s in ET.spans(since=t0):
        tid = rows.setdefault(s.group, 2 + len(rows))
        events.append({"ph": "X", "name": s.kind, "pid": 0, "tid": tid, "ts": (s.start_s - t0) * us,
                       "dur": (s.end_s - s.start_s) * us, "args": {"bytes": s.bytes}})
    for group, tid in rows.items():
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid,
                       "args": {"name": f"comm {group} (emulated: {net_name})"}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"emulated": True, "network": net_name}}, f)


__all__ = ["Under", "check", "Passes", "eager_step", "flops_per_step", "per_step", "timing", "write_trace"]
