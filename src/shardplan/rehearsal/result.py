"""What a rehearsal measured, beside what the plan says: a frozen record, its table and its JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional
from ..planner.render import fmt_bytes


def _gib(n: Optional[float]) -> str:
    return "-" if n is None else fmt_bytes(n)


def _ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.2f} ms"


@dataclass(frozen=True)
class UnitTime:
    """One unit's compute on this rank, median over the measured steps: its forward (from the hook that
    starts it to the one that ends it) and its backward (its outputs' gradient in, its inputs' out). The
    root unit holds what runs outside every other unit (embeddings, head, loss)."""

    unit: str
    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class NetworkTiming:
    """A rehearsal's steps under an emulated network (``rehearse(network=...)``): EMULATED, not measured on
    several GPUs. The network is a model (``network``, its dict), this rank's compute and memory are real.

    ``step_s``: the median step with the network (measured: a pass of its own, interleaved step by step with
    the others; a captured step: its replays); ``baseline_step_s``: the median of the same steps with the
    network's time switched off (measured, same process); ``exposed_s``: their difference, the time
    compute waited on communication (derived); ``exposed_by_kind``: per op kind, the median step with only that
    kind timed minus the baseline (derived; empty for a captured step); ``modelled_s``, ``ops``, ``bytes``: per
    step and op kind, from the ledger (the model's times, summed as if serial); ``waited_s``: host time blocked
    in ``Work.wait()`` per step and kind until the op's modelled end (measured on a CPU's comm threads, their
    own wake-up delays left out; 0 on CUDA); ``overlap``: ``1 - exposed / modelled``. ``flops_per_step`` and ``mfu``: this rank's training FLOPs
    (6 x Linear weights per token plus attention, ``sp.metrics.flops_per_token``) over the step and the
    device's bf16 peak (``None`` on a CPU or an unknown device).

    >>> r = sp.rehearse(model_fn, plan, batch=(2, 64), network="h100-8x-ib400")
    >>> r.network.exposed_s, r.network.overlap, r.network.tokens_per_s_per_gpu
    """

    network: dict
    step_s: float
    baseline_step_s: float
    exposed_s: float
    exposed_by_kind: dict
    modelled_s: dict
    ops: dict
    bytes: dict
    waited_s: dict
    tokens_per_s_per_gpu: float
    flops_per_step: float
    peak_tflops: Optional[float]
    mfu: Optional[float]
    baseline_steps: tuple = ()
    captured: bool = False
    trace: Optional[str] = None

    @property
    def modelled_total_s(self) -> float:
        return sum(self.modelled_s.values())

    @property
    def overlap(self) -> Optional[float]:
        """The share of the modelled communication hidden behind compute (``None``: no communication)."""
        total = self.modelled_total_s
        return None if total <= 0 else min(max(1.0 - self.exposed_s / total, 0.0), 1.0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["baseline_steps"] = list(self.baseline_steps)
        d["overlap"], d["modelled_total_s"], d["emulated"] = self.overlap, self.modelled_total_s, True
        return d

    def lines(self) -> list[str]:
        name = self.network.get("name", "?")
        mfu = "n/a (no peak for this device)" if self.mfu is None else f"{100 * self.mfu:.1f}%"
        overlap = "-" if self.overlap is None else f"{100 * self.overlap:.1f}%"
        out = [f"EMULATED network {name!r} (a model: {self.network.get('source') or 'see its dict in the JSON'}); "
               f"nothing here ran on several GPUs",
               f"step {_ms(self.step_s)} with the network, {_ms(self.baseline_step_s)} without it (same steps, "
               f"network time switched off); {self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; MFU {mfu}",
               f"exposed communication {_ms(self.exposed_s)} per step (the difference); modelled communication "
               f"{_ms(self.modelled_total_s)} per step; overlap {overlap}; medians of {len(self.baseline_steps)} steps per pass",
               f"{'kind':<16} {'ops/step':>9} {'bytes/step':>12} {'modelled':>11} {'exposed':>11} {'host waited':>12}"]
        for k in sorted(self.modelled_s):
            exp = _ms(self.exposed_by_kind[k]) if k in self.exposed_by_kind else "-"
            out.append(f"{k:<16} {self.ops.get(k, 0):>9.1f} {_gib(self.bytes.get(k, 0)):>12} {_ms(self.modelled_s[k]):>11} "
                       f"{exp:>11} {_ms(self.waited_s.get(k, 0.0)):>12}")
        if self.captured:
            out.append("captured step: exposure from the replays with and without the network (two captures); "
                       "not per kind")
        if self.trace:
            out.append(f"Chrome trace of one step (emulated): {self.trace}")
        return out


@dataclass(frozen=True)
class Rehearsal:
    """One rank of an N-rank plan, run for real on this machine with every collective a local stand-in.

    The figures are for ``rank`` only: its compute, its memory, its host overhead; collectives took no time
    (they run on no network), and the loss is not a training loss (the other ranks' contributions are
    missing). ``measured_peak``: the device's peak allocated bytes per step (CUDA), or ``None`` where it is
    not measured (CPU: ``states_peak_measured``, the bytes the runtime held for parameters and gradients,
    is compared with the plan instead). ``planned_peak``: ``plan.memory(rank, recompute=checkpoint).peak``,
    activations included when the plan was traced (``planned_activations``).

    >>> r = sp.rehearse(gpt.tiny, plan, rank=3, batch=(2, 32), steps=2)
    >>> r.step_s, r.measured_peak, r.planned_peak; print(r); r.to_json()
    """

    rank: int
    world: int
    mesh: str
    device: str
    batch: tuple[int, int]
    checkpoint: bool
    plan_fingerprint: str
    step_s: tuple[float, ...]
    measured_peak: Optional[int]
    measured_peaks: tuple[int, ...]
    peak_source: str
    planned_peak: int
    planned_states_peak: int
    planned_activations: Optional[int]
    activation_inputs: str
    states_peak_measured: Optional[int]
    states_peak_planned: int
    units: tuple[UnitTime, ...]
    host_s_per_unit: float
    optimizer_s: float
    notes: tuple[str, ...] = field(default=())
    # bytes the CUDA libraries held for their workspaces after the steps (cuBLAS keeps one per thread and
    # stream: the forward's and autograd's backward thread), measured by releasing them; they are in the
    # measured peak and not in the plan. ``None``: not measured (CPU)
    library_workspace: Optional[int] = None
    # host memory (RSS, Linux): the most the process held during start-up and the steps above what it held
    # before the model was built (``host_baseline``); ``None``: not measured. On a CPU the device is the host,
    # so it compares with ``planned_peak``; on a GPU it shows that the host never held the model
    host_peak: Optional[int] = None
    host_baseline: Optional[int] = None
    # the steps shown are replays of the captured step (``rehearse(capture=True)``): no per-unit times
    captured: bool = False
    # under an emulated network (``rehearse(network=...)``): the steps were timed with its collectives
    network: Optional[NetworkTiming] = None

    @property
    def median_step_s(self) -> float:
        # step 0 warms up (a captured rehearsal's steps are all replays)
        s = sorted(self.step_s[1:] if len(self.step_s) > 1 and not self.captured else self.step_s)
        return s[len(s) // 2]

    @property
    def peak_ratio(self) -> Optional[float]:
        """Measured over planned peak (``None`` where not measured)."""
        return None if self.measured_peak is None else self.measured_peak / self.planned_peak

    @property
    def peak_ratio_with_workspace(self) -> Optional[float]:
        """Measured peak over the planned one plus the libraries' workspaces (``None`` where not measured)."""
        if self.measured_peak is None or self.library_workspace is None:
            return None
        return self.measured_peak / (self.planned_peak + self.library_workspace)

    def compute_model(self) -> dict[str, Any]:
        """The measured unit times as a compute model's fields (``shardplan.forecast.ComputeModel.from_dict``):
        ``shardplan forecast --compute REHEARSAL.json`` reads them."""
        return {"name": f"rehearsal rank {self.rank} of {self.mesh} on {self.device}",
                "units": [[u.unit, u.forward_s, u.backward_s] for u in self.units],
                "optimizer_s": self.optimizer_s, "batch": list(self.batch),
                "source": f"shardplan rehearse: rank {self.rank} of {self.mesh}, batch {self.batch[0]}x{self.batch[1]}, "
                          f"{len(self.step_s)} steps on {self.device}, plan {self.plan_fingerprint}"}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["units"] = [asdict(u) for u in self.units]
        d["batch"], d["step_s"] = list(self.batch), list(self.step_s)
        d["measured_peaks"], d["notes"] = list(self.measured_peaks), list(self.notes)
        d["peak_ratio"] = self.peak_ratio
        d["peak_ratio_with_workspace"] = self.peak_ratio_with_workspace
        d["median_step_s"] = self.median_step_s
        d["network"] = None if self.network is None else self.network.to_dict()
        d["rehearsal"] = 1  # what `shardplan forecast --compute FILE` looks for
        d["compute"] = self.compute_model()
        return d

    def to_json(self, indent: Optional[int] = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        b, t = self.batch
        out = [f"rehearsal of rank {self.rank} of {self.world} ({self.mesh}) on {self.device}, batch {b}x{t} per rank, "
               f"activation checkpointing {'on' if self.checkpoint else 'off'}"
               f"{', captured step (replays)' if self.captured else ''}; plan {self.plan_fingerprint}",
               ("ONE RANK ONLY: collectives were local stand-ins (no communication, no waiting for other ranks); "
                if self.network is None else
                "ONE RANK ONLY: collectives took an EMULATED network's time (below), never another rank's data; ")
               + "the loss is not meaningful and is not shown",
               "",
               "step  time        peak measured   peak planned"]
        for i, s in enumerate(self.step_s):
            m = self.measured_peaks[i] if i < len(self.measured_peaks) else None
            out.append(f"{i:>4}  {_ms(s):>10}  {_gib(m):>14}   {_gib(self.planned_peak):>12}")
        out.append("")
        acts = ("activations not counted (plan not traced: trace=example inputs / --trace-tokens)"
                if self.planned_activations is None else
                f"activations {_gib(self.planned_activations)} at the peak (traced {self.activation_inputs})")
        out.append(f"planned peak {_gib(self.planned_peak)} (model states alone peak at {_gib(self.planned_states_peak)}; "
                   f"{acts})")
        if self.measured_peak is not None:
            out.append(f"measured peak {_gib(self.measured_peak)} ({self.peak_source}): "
                       f"{100 * (self.peak_ratio - 1):+.1f}% against the plan"
                       + (f", {100 * (self.peak_ratio_with_workspace - 1):+.1f}% against the plan plus the CUDA "
                          f"libraries' workspaces ({_gib(self.library_workspace)}, measured)"
                          if self.peak_ratio_with_workspace is not None else ""))
        else:
            out.append(f"measured peak: not measured ({self.peak_source})")
        if self.host_peak is not None:
            out.append(f"host memory (RSS): peak {_gib(self.host_peak)} above the {_gib(self.host_baseline)} the process "
                       f"held before the model was built" + (" (on a CPU it holds the plan's peak too)"
                                                             if self.measured_peak is None else ""))
        if self.states_peak_measured is not None:
            out.append(f"parameters and gradients held by the runtime: peak {_gib(self.states_peak_measured)}, "
                       f"planned {_gib(self.states_peak_planned)}")
        out.append("")
        if self.units:
            out.append(f"{'unit':<28} {'forward':>10} {'backward':>10}")
        for u in self.units:
            out.append(f"{u.unit:<28} {_ms(u.forward_s):>10} {_ms(u.backward_s):>10}")
        if self.captured:
            out.append(f"per-unit and optimizer times: not measured (one graph); host time in shardplan per unit per "
                       f"replay {_ms(self.host_s_per_unit)}; median replay {_ms(self.median_step_s)} "
                       f"({'with the emulated network' if self.network else 'compute only: no communication'})")
        else:
            out.append(f"optimizer step {_ms(self.optimizer_s)}; host time in shardplan's hooks "
                       f"{_ms(self.host_s_per_unit)} per unit per step; median step {_ms(self.median_step_s)} (after the "
                       f"first; {'with the emulated network' if self.network else 'compute only: no communication'})")
        if self.network is not None:
            out.append("")
            out += self.network.lines()
        if self.notes:
            out.append("")
            out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)
