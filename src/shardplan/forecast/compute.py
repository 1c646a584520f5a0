"""How long compute takes: an achievable FLOP rate (presets with their sources), or times measured per unit.

>>> compute_model("h100-sxm-bf16").tflops                   # achievable dense BF16 rate, TFLOP/s
>>> ComputeModel(tflops=400.0, peak_tflops=989.4)           # your own rate
>>> ComputeModel(units=(("<root>", 0.002, 0.004), ("layers.0", 0.010, 0.020)), optimizer_s=0.003, batch=(4, 64))

A measured model (``units``: forward and backward seconds per unit, e.g. from a run at world 1) is used
as is for the batch it was measured at; units it does not list fall back to FLOPs at ``tflops``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from ..errors import ForecastError


@dataclass(frozen=True)
class ComputeModel:
    """Compute time per rank. ``tflops``: the achievable rate for the model's matmul FLOPs (TFLOP/s);
    ``peak_tflops``: the datasheet peak, for MFU; ``memory_gbs``: achievable memory bandwidth (GB/s), for
    the optimizer step when it is not measured; ``backward_factor``: backward time over forward time (2 for
    plain training, about 3 with full activation checkpointing); ``units``: measured ``(unit, forward_s,
    backward_s)``; ``optimizer_s``: the measured optimizer step (clip, step, zero_grad); ``batch``: the
    per-rank ``(B, T)`` the measurements were taken at."""

    name: str = "custom"
    tflops: Optional[float] = None
    peak_tflops: Optional[float] = None
    memory_gbs: Optional[float] = None
    backward_factor: float = 2.0
    units: tuple[tuple[str, float, float], ...] = ()
    optimizer_s: Optional[float] = None
    batch: Optional[tuple[int, int]] = None
    source: str = ""

    def __post_init__(self):
        for f in ("tflops", "peak_tflops", "memory_gbs", "optimizer_s"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0
                                  or (v == 0 and f != "optimizer_s")):
                raise ForecastError(f"compute model {self.name!r}: {f} must be a positive number; got {v!r}")
        if not self.backward_factor > 0:
            raise ForecastError(f"compute model {self.name!r}: backward_factor must be positive; got {self.backward_factor!r}")
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
# 989.4 TFLOP/s, H200 SXM 989.4 (the same GH100 compute), A100 SXM 312. Achievable rates are what a whole
# eager PyTorch transformer step gets on the model's matmul FLOPs (the MFU numerator), not a GEMM peak:
# A100: torchtitan's FSDP runs of Llama 3 8B on 64 A100s report 56.8-58.2% MFU (docs/performance.md of
# torchtitan), 0.57 x 312 = 178 TFLOP/s. H100/H200: measured on one H200 here
# (benchmarks/forecast_gpu.py: a Llama-3-8B-shaped block, batch 2 x 8192, bf16, forward + backward) -
# see docs/forecast.md; the H100 SXM preset takes the same rate (same SMs and clocks; less memory bandwidth,
# which matters for the non-matmul ops). Memory: datasheet HBM bandwidth x 0.8.]
PRESETS: dict[str, ComputeModel] = {
    "h100-sxm-bf16": ComputeModel("h100-sxm-bf16", tflops=520.0, peak_tflops=989.4, memory_gbs=2680.0,
                                  source="H100 SXM, BF16: peak 989.4 TFLOP/s (datasheet); achievable taken from one "
                                         "H200 measurement of a Llama-3-8B block (docs/forecast.md); HBM 3.35 TB/s x 0.8"),
    "h200-sxm-bf16": ComputeModel("h200-sxm-bf16", tflops=520.0, peak_tflops=989.4, memory_gbs=3840.0,
                                  source="H200 SXM, BF16: peak 989.4 TFLOP/s (datasheet); achievable measured on one "
                                         "H200, a Llama-3-8B block (docs/forecast.md); HBM 4.8 TB/s x 0.8"),
    "a100-sxm-bf16": ComputeModel("a100-sxm-bf16", tflops=178.0, peak_tflops=312.0, memory_gbs=1630.0,
                                  source="A100 SXM 80GB, BF16: peak 312 TFLOP/s (datasheet); achievable 57% of it "
                                         "(torchtitan, Llama 3 8B FSDP on 64 A100s); HBM 2.04 TB/s x 0.8"),
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
        if text in PRESETS:
            return PRESETS[text]
        if os.path.exists(text):
            try:
                with open(text) as f:
                    d = json.load(f)
            except (OSError, ValueError) as exc:
                raise ForecastError(f"compute file {text}: not readable JSON ({exc})") from None
            return ComputeModel.from_dict(d.get("compute", d) if isinstance(d, Mapping) else d)
        raise ForecastError(f"unknown compute model {text!r}: use a preset ({', '.join(PRESETS)}), a number "
                            f"(achievable TFLOP/s), a dict or a JSON file")
    if spec is None:
        raise ForecastError("no compute model: the network names no device; pass compute= a preset "
                            f"({', '.join(PRESETS)}), an achievable TFLOP/s number, or measured unit times")
    raise ForecastError(f"compute must be a preset name, a number, a dict, a JSON file or a ComputeModel; "
                        f"got {type(spec).__name__}")
