"""dtype names <-> torch dtypes, so plans serialise without torch objects in them. torch is imported on
first use: ``import shardplan`` and the CLI's argument parsing start without it."""

from __future__ import annotations

import sys
import warnings

from .errors import PlanError


def import_torch():
    """``torch``, imported quietly: torch warns at import when NumPy is absent, and shardplan never uses NumPy."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch
    return torch


_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
            "fp64": "float64", "double": "float64"}


def dtype_name(dtype) -> str | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype, dtype)
        to_torch(name)
        return name
    torch = import_torch()
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    raise PlanError(f"{dtype!r} is not a dtype; use e.g. torch.bfloat16 or 'bf16'")


def to_torch(name: str) -> "torch.dtype":  # noqa: F821
    torch = import_torch()
    d = getattr(torch, _ALIASES.get(name, name), None)
    if not isinstance(d, torch.dtype):
        raise PlanError(f"unknown dtype {name!r}; use e.g. 'float32', 'bfloat16', 'float16'")
    return d


def itemsize(name: str) -> int:
    return to_torch(name).itemsize


def is_floating(name: str) -> bool:
    return to_torch(name).is_floating_point
