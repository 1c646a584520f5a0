"""Low-precision parameter gathers: the formats, their wire layout, and which parameters use them.

Pure (no torch): the planner reads it; :mod:`shardplan.runtime.quantize` holds the kernels.

A quantized gather sends, per rank, the buffer's flat shard (``S`` elements of the master dtype) as
``S`` one-byte codes plus one fp32 scale per block of :data:`BLOCK` elements of the flat shard
(absmax scaling: ``scale = absmax / QMAX[fmt]``), so one rank's wire segment is
``S + 4 * ceil(S / BLOCK)`` bytes and the gathered wire ``group_size`` times that.

>>> wire_shard_bytes(1000)          # 1000 codes + 4 blocks of 256 elements -> 4 fp32 scales
1016
>>> gather_of(None, [("layers.0.w", 2, True, True)])
{'layers.0.w': ''}
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

from .errors import PlanError

INT8, FLOAT8 = "int8", "float8_e4m3fn"
FORMATS = (INT8, FLOAT8)
# [Note: FP8 compute's gathers] (sp.plan(..., fp8="torchao"), planner/float8.py) send float8_e4m3fn codes of the
# torchao Float8Linear weights with one scale per parameter (448 / its absmax over the whole weight, one all-reduce
# of the buffer's absmaxes before the gather), no block scales: the gathered codes are the weights torchao's matmul
# reads, never dequantized. Not a gather_dtype= choice: the planner gives it to the float8 Linears' weights.
FLOAT8_TW = "float8_tensorwise"
AMAX_BYTES = 4  # one fp32 absmax per parameter of such a buffer
BLOCK = 256  # elements of the flat shard per fp32 scale
SCALE_BYTES = 4
QMAX = {INT8: 127.0, FLOAT8: 448.0}  # the largest code magnitude: absmax maps to it
# [Note: relative error bounds per element, as a fraction of its block's absmax] int8 rounds to the nearest
# of 2*127+1 levels: |x - dq(q(x))| <= absmax / 127 / 2. float8_e4m3fn has 3 mantissa bits: relative error
# <= 2**-4 of |x / scale| for normal values, and subnormals (|x / scale| < 2**-6) are spaced 2**-9 apart:
# |x - dq(q(x))| <= max(|x| * 2**-4, scale * 2**-10).
_ALIASES = {"fp8": FLOAT8, "float8": FLOAT8, "e4m3": FLOAT8, "float8_e4m3": FLOAT8}


def scale_count(shard_numel: int) -> int:
    return -(-shard_numel // BLOCK)


def wire_shard_bytes(shard_numel: int, fmt: str = "") -> int:
    """Bytes one rank sends in a quantized gather of a buffer with ``shard_numel`` elements per rank."""
    if fmt == FLOAT8_TW:
        return shard_numel  # codes only: the scales come from the absmax all-reduce
    return shard_numel + SCALE_BYTES * scale_count(shard_numel)


def format_name(value) -> str:
    """``None``/``""`` -> ``""`` (no quantized gather); a format name (or alias) -> its name."""
    if value is None or value == "":
        return ""
    name = str(value).replace("torch.", "")
    name = _ALIASES.get(name, name)
    if name not in FORMATS:
        raise PlanError(f"gather_dtype must be None, {FORMATS[0]!r} or {FORMATS[1]!r} (or a list of (regex, one of "
                        f"those) pairs); got {value!r}")
    return name


def as_option(gather_dtype):
    """The ``gather_dtype=`` option normalised: ``""`` (off), a format name (global), or a tuple of
    ``(regex, format or "")`` pairs (per rule, first match wins)."""
    if gather_dtype is None or isinstance(gather_dtype, str) or not isinstance(gather_dtype, (list, tuple)):
        return format_name(gather_dtype)
    return rule_pairs(gather_dtype, "gather_dtype", "(regex, dtype)", "[(r'.*norm.*', None), (r'.*', 'int8')]",
                      format_name)


def rule_pairs(items, option: str, pair: str, example: str, value, valid=lambda v: True) -> tuple:
    """``((regex, value(v)), ...)`` of a per-rule option (``gather_dtype=[...]``, ``fp8=[...]``), each regex
    compiled to check it; a :class:`PlanError` naming the rule and the option's shape otherwise."""
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str) and valid(item[1])):
            raise PlanError(f"{option} rule #{i} {item!r} is not a {pair} pair; e.g. {option}={example}")
        try:
            re.compile(item[0])
        except re.error as exc:
            raise PlanError(f"{option} rule #{i}: invalid regex {item[0]!r}: {exc}") from None
        out.append((item[0], value(item[1])))
    return tuple(out)


def gather_of(option, params: Iterable[tuple[str, int, bool, bool]]) -> dict[str, str]:
    """The gather format of each parameter, from ``(name, ndim, floating, requires_grad)``.

    A global format applies to floating trainable parameters of two or more dimensions (weight
    matrices and embeddings; norms and biases keep their dtype). Per-rule pairs apply to the floating
    trainable parameters their regex fullmatches, whatever their rank; unmatched ones keep their dtype.
    Integer and frozen parameters are never quantized.
    """
    option = as_option(option)
    out = {}
    for name, ndim, floating, trainable in params:
        fmt = ""
        if floating and trainable and option:
            if isinstance(option, str):
                fmt = option if ndim >= 2 else ""
            else:
                fmt = next((f for pattern, f in option if re.fullmatch(pattern, name)), "")
        out[name] = fmt
    return out


REDUCE_FORMATS = (INT8,)


def reduce_format(name) -> str:
    """``reduce_dtype=`` as a quantized reduction format ("" for a float dtype, handled as before)."""
    return name if name in REDUCE_FORMATS else ""


def refuse_reduce(level: int, offload, compute_axes, expert: bool) -> None:
    """The quantized gradient reduction replaces a reduce-scatter over the data axes; the rest is refused."""
    if level < 2:
        raise PlanError("reduce_dtype='int8' (quantized gradient reduction) needs strategy='optim_grads' or "
                        "'optim_grads_params': it replaces the reduce-scatter, which lower strategies do not run")
    if offload or compute_axes or expert:
        raise PlanError("reduce_dtype='int8' is not supported with CPU offload, tensor or expert parallelism yet; "
                        "use reduce_dtype='float32' or 'bfloat16' there")


def refuse(level: int, offload, compute_axes, expert: bool, used: Optional[str]) -> None:
    """Quantized gathers are ZeRO-3 on data axes only (see docs/low_precision.md); others are refused."""
    if not used:
        return
    if level < 3:
        raise PlanError(f"gather_dtype={used!r} needs strategy='optim_grads_params' (ZeRO-3: parameters are gathered "
                        f"every step); lower strategies keep the parameters whole, so there is no gather to quantize")
    if offload:
        raise PlanError(f"gather_dtype={used!r} is not supported with offload={offload!r} yet; drop one of the two")
    if compute_axes or expert:
        raise PlanError(f"gather_dtype={used!r} is not supported with tensor or expert parallelism yet; give "
                        f"gather_dtype=None, or plan without compute_axes/expert axes")
