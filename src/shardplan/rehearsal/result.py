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
               "ONE RANK ONLY: collectives were local stand-ins (no communication, no waiting for other ranks); "
               "the loss is not meaningful and is not shown",
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
                       f"replay {_ms(self.host_s_per_unit)}; median replay {_ms(self.median_step_s)} (compute only: no "
                       f"communication)")
        else:
            out.append(f"optimizer step {_ms(self.optimizer_s)}; host time in shardplan's hooks "
                       f"{_ms(self.host_s_per_unit)} per unit per step; median step {_ms(self.median_step_s)} (after the "
                       f"first; compute only: no communication)")
        if self.notes:
            out.append("")
            out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)
