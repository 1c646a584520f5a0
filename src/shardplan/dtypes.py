"""dtype names <-> torch dtypes, so plans serialise without torch objects in them."""

from __future__ import annotations

import torch

from .errors import PlanError

_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
            "fp64": "float64", "double": "float64"}


def dtype_name(dtype) -> str | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype, dtype)
        to_torch(name)
        return name
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    raise PlanError(f"{dtype!r} is not a dtype; use e.g. torch.bfloat16 or 'bf16'")


def to_torch(name: str) -> torch.dtype:
    d = getattr(torch, _ALIASES.get(name, name), None)
    if not isinstance(d, torch.dtype):
        raise PlanError(f"unknown dtype {name!r}; use e.g. 'float32', 'bfloat16', 'float16'")
    return d


def itemsize(name: str) -> int:
    return to_torch(name).itemsize


def is_floating(name: str) -> bool:
    return to_torch(name).is_floating_point
