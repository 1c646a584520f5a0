"""How long compute takes: an achievable FLOP rate (presets with their sources), or times measured per unit.

>>> compute_model("h100-sxm-bf16").tflops                   # achievable BF16 matmul rate, TFLOP/s
>>> ComputeModel(tflops=400.0, peak_tflops=989.4)           # your own rate
>>> ComputeModel(units=(("<root>", 0.002, 0.004), ("layers.0", 0.010, 0.020)), optimizer_s=0.003, batch=(4, 64))

A measured model (``units``: forward and backward seconds per unit, e.g. from a run at world 1, or the JSON
``shardplan rehearse --out FILE`` writes) is used as is for the batch it was measured at; units it does not
list fall back to FLOPs at ``tflops``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from ..errors import ForecastError
from .sources import preset_or_file


@dataclass(frozen=True)
class ComputeModel:
    """Compute time per rank.

    From FLOPs: a unit's forward + backward takes ``3F / tflops`` for its matmuls (``F``: its forward
    matmul FLOPs, see :mod:`shardplan.forecast.flops`) plus the bytes its other ops move (norms,
    activations, rotary embeddings, residual adds, casts, the loss) at ``elementwise_gbs`` (default
    ``memory_gbs``): counted op by op when the plan was traced with example inputs
    (:func:`shardplan.forecast.traffic.traced_bytes`), else estimated as ``elementwise_bytes x tokens x
    width`` (``width``: the unit's hidden size) plus ``logit_bytes`` per logit of the output head for the
    loss (40 for an fp32 cross-entropy over bf16 logits; 0 leaves it out). The matmuls split 1 :
    ``backward_factor`` between forward and backward (2 for plain training, about 3 with full activation
    checkpointing; traced bytes keep their own split, plus ``backward_factor - 2`` forwards re-run).
    ``copy_traffic``: time the runtime's local parameter and gradient copies and casts (gathers that are
    local or cast, landing gradients, reduce-dtype casts) at ``memory_gbs`` (see
    :mod:`shardplan.forecast.traffic`). ``peak_tflops``: the datasheet peak, for MFU. The optimizer step
    moves ``optimizer_bytes`` per trained local element at ``memory_gbs`` unless ``optimizer_s`` gives it.
    [Note: two bandwidths. ``memory_gbs`` is what large streaming kernels reach (the optimizer's foreach
    ops, whole-buffer copies); ``elementwise_gbs`` what a step's many activation-sized eager kernels
    reach on average (reductions, strided reads, launch gaps included), fitted with ``tflops`` on
    transformer blocks (see the presets).]

    Measured: ``units`` gives ``(unit, forward_s, backward_s)``; ``optimizer_s`` the step after backward
    (clip, step, zero_grad); ``batch`` the per-rank ``(B, T)`` they were measured at.
    """

    name: str = "custom"
    tflops: Optional[float] = None
    peak_tflops: Optional[float] = None
    memory_gbs: Optional[float] = None
    elementwise_gbs: Optional[float] = None
    backward_factor: float = 2.0
    elementwise_bytes: float = 0.0
    optimizer_bytes: float = 80.0
    logit_bytes: float = 0.0
    copy_traffic: bool = False
    units: tuple[tuple[str, float, float], ...] = ()
    optimizer_s: Optional[float] = None
    batch: Optional[tuple[int, int]] = None
    source: str = ""

    def __post_init__(self):
        for f in ("tflops", "peak_tflops", "memory_gbs", "elementwise_gbs", "optimizer_s"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0
                                  or (v == 0 and f != "optimizer_s")):
                raise ForecastError(f"compute model {self.name!r}: {f} must be a positive number; got {v!r}")
        if not self.backward_factor > 0:
            raise ForecastError(f"compute model {self.name!r}: backward_factor must be positive; got {self.backward_factor!r}")
        if not isinstance(self.copy_traffic, bool):
            raise ForecastError(f"compute model {self.name!r}: copy_traffic must be true or false; got {self.copy_traffic!r}")
        for f in ("elementwise_bytes", "optimizer_bytes", "logit_bytes"):
            if not getattr(self, f) >= 0:
                raise ForecastError(f"compute model {self.name!r}: {f} must be non-negative; got {getattr(self, f)!r}")
        object.__setattr__(self, "units", tuple((str(u), float(f), float(b)) for u, f, b in self.units))
        if self.batch is not None:
            object.__setattr__(self, "batch", tuple(int(x) for x in self.batch))

    @property
    def measured(self) -> dict[str, tuple[float, float]]:
        return {u: (f, b) for u, f, b in self.units}

    def with_rate(self, tflops: float) -> "ComputeModel":
        return dataclasses.replace(self, tflops=tflops)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["units"] = [list(u) for u in self.units]
        d["batch"] = None if self.batch is None else list(self.batch)
        return d

    def to_json(self, indent: Optional[int] = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ComputeModel":
        """A compute model from its dict; ``{"base": "h100-sxm-bf16", "tflops": 400}`` overrides a preset."""
        d = dict(d)
        if "rehearsal" in d and "compute" in d:  # a rehearsal's JSON: its measured unit times (shardplan rehearse)
            # [Note: a rehearsal under an emulated network times its units with the network on: each wait on a
            # collective falls between two units' marks, so into the root unit's remainder. Forecast on a
            # network, those waits would be counted twice (measured in the root, simulated again); refused]
            if d.get("network"):
                raise ForecastError(f"compute model: this rehearsal ran under an emulated network "
                                    f"({d['network'].get('network', {}).get('name', '?')}): its unit times include "
                                    f"the waits on collectives, which the forecast would count again; rehearse "
                                    f"without --network (network=) for the compute model")
            d = dict(d["compute"])
        if "base" in d:
            d = {**compute_model(d.pop("base")).to_dict(), **d}
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ForecastError(f"compute model has unknown field(s) {sorted(unknown)}; fields: "
                                f"{[f.name for f in dataclasses.fields(cls)]}")
        if "units" in d:
            d["units"] = tuple(tuple(u) for u in d["units"])
        if d.get("batch") is not None:
            d["batch"] = tuple(d["batch"])
        return cls(**d)


# [Note: sources and choices. Peaks: NVIDIA datasheets, dense (no sparsity) BF16 tensor-core rates: H100 SXM
# 989.4 TFLOP/s, H200 SXM 989.4 (the same GH100 compute), A100 SXM 312. HBM peaks: H100 SXM 3.35 TB/s,
# H200 4.8 TB/s, A100 80GB 2.04 TB/s; memory_gbs (the optimizer, the runtime's copies) is 0.8 of them.
# H100/H200 tflops and elementwise_gbs: one calibration on one H200 (benchmarks/forecast_gpu.py,
# results/forecast_h200_w1.json): one examples/gpt.py block of the 1B, Llama-3-8B and 70B shapes in bf16,
# forward + backward, at 8x1024, 2x8192, 1x4096 and 1x4096 tokens, ran in 5.90, 44.77, 10.65 and 35.51 ms;
# their non-matmul ops move 6.29, 27.38, 6.85 and 13.62 GB (counted on the meta device,
# shardplan.optraffic: 375-408 bytes per token and unit of width). The least-squares fit of
# t = 3F / R + bytes / BW gives R = 764 TFLOP/s for the matmuls (a plain 8192^3 bf16 GEMM runs at 770-800
# there) and BW = 2,767 GB/s (58% of the HBM peak: eager kernels on 16-512 MiB activations, reductions and
# strided reads among them), every block within 4%. With R and BW fixed, the estimate for an untraced plan
# fits elementwise_bytes = 390 (every block within 4%). The H100 SXM preset takes the same matmul rate
# (same SMs and clocks at 700 W) and scales both bandwidths by its HBM (3.35 / 4.8).
# A100: no measurement here; torchtitan's FSDP runs of Llama 3 8B on 64 A100s report 56.8-58.2% MFU
# (torchtitan docs/performance.md), so 0.57 x 312 = 178 TFLOP/s is taken as a whole-step rate (no separate
# elementwise term). optimizer_bytes = 80: torch's foreach AdamW with weight decay passes over fp32
# memory eight times per element (param *= 1 - lr wd: 8 B; exp_avg.lerp_: 12; exp_avg_sq *= b2: 8;
# addcmul_: 12; sqrt: 8; div_: 8; add_ eps: 8; param addcdiv_: 16); a fused AdamW moves about 28.
# logit_bytes = 40 (untraced plans only: a traced one counts the loss's ops) and copy_traffic
# (H100/H200): counted, not fitted (forecast/traffic.py); the 1B step at world 1 forecast 0.90 of the
# measured step without them, the head's fp32 loss and the runtime's casts being what the blocks' fit
# cannot see. The A100 preset is a whole-step rate and leaves them out.]
PRESETS: dict[str, ComputeModel] = {
    "h100-sxm-bf16": ComputeModel("h100-sxm-bf16", tflops=764.0, peak_tflops=989.4, memory_gbs=2680.0,
                                  elementwise_gbs=1930.0, elementwise_bytes=390.0, logit_bytes=40.0,
                                  copy_traffic=True,
                                  source="H100 SXM, BF16: peak 989.4 TFLOP/s (datasheet); matmul rate and elementwise "
                                         "bandwidth fitted on one H200 (same compute; benchmarks/forecast_gpu.py), "
                                         "the bandwidth scaled to H100's HBM; HBM 3.35 TB/s x 0.8"),
    "h200-sxm-bf16": ComputeModel("h200-sxm-bf16", tflops=764.0, peak_tflops=989.4, memory_gbs=3840.0,
                                  elementwise_gbs=2767.0, elementwise_bytes=390.0, logit_bytes=40.0,
                                  copy_traffic=True,
                                  source="H200 SXM, BF16: peak 989.4 TFLOP/s (datasheet); matmul rate and elementwise "
                                         "bandwidth fitted on one H200 (benchmarks/forecast_gpu.py); HBM 4.8 TB/s x 0.8"),
    "a100-sxm-bf16": ComputeModel("a100-sxm-bf16", tflops=178.0, peak_tflops=312.0, memory_gbs=1630.0,
                                  source="A100 SXM 80GB, BF16: peak 312 TFLOP/s (datasheet); a whole-step rate of 57% "
                                         "of it (torchtitan, Llama 3 8B FSDP on 64 A100s); HBM 2.04 TB/s x 0.8"),
}


def compute_model(spec: Union[None, str, float, Mapping[str, Any], ComputeModel, "os.PathLike[str]"]) -> ComputeModel:
    """A :class:`ComputeModel` from a preset name, a number (achievable TFLOP/s), a dict, a JSON file or itself."""
    if isinstance(spec, ComputeModel):
        return spec
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return ComputeModel(tflops=float(spec))
    if isinstance(spec, Mapping):
        return ComputeModel.from_dict(spec)
    if isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        found = preset_or_file(text, PRESETS, 'compute', 'compute')
        if found is not None:
            return found if isinstance(found, ComputeModel) else ComputeModel.from_dict(found)
        raise ForecastError(f"unknown compute model {text!r}: use a preset ({', '.join(PRESETS)}), a number "
                            f"(achievable TFLOP/s), a dict or a JSON file")
    if spec is None:
        raise ForecastError("no compute model: the network names no device; pass compute= a preset "
                            f"({', '.join(PRESETS)}), an achievable TFLOP/s number, or measured unit times "
                            f"(CLI: --compute NAME|FILE or --tflops N)")
    raise ForecastError(f"compute must be a preset name, a number, a dict, a JSON file or a ComputeModel; "
                        f"got {type(spec).__name__}")
