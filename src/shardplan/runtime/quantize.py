"""Block-quantized gathers: the kernels (see :mod:`shardplan.lowp` for the formats and the wire layout).

One rank's wire segment is a uint8 tensor: ``S`` one-byte codes (int8 or float8_e4m3fn, sent as bytes:
gloo has no float8) followed by ``ceil(S / BLOCK)`` fp32 scales. Quantizing reads the master shard in
fp32; dequantizing writes the compute dtype.
"""

from __future__ import annotations

import torch

from .. import lowp

_CODE = {lowp.INT8: torch.int8, lowp.FLOAT8: getattr(torch, "float8_e4m3fn", None)}


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (1-D, fp32) as (blocks, BLOCK), zero-padded at the end."""
    n = x.numel()
    nb = lowp.scale_count(n)
    if nb * lowp.BLOCK != n:
        x = torch.nn.functional.pad(x, (0, nb * lowp.BLOCK - n))
    return x.view(nb, lowp.BLOCK)


def quantize_into(shard: torch.Tensor, fmt: str, out: torch.Tensor) -> None:
    """Write ``shard``'s (1-D, any floating dtype) codes and block scales into ``out`` (uint8, its wire segment).

    [Note: non-finite values] are not checked here: a NaN or inf makes its block's absmax (so its scale)
    non-finite, and the scales travel to every rank, which checks them after the gather
    (:func:`bad_blocks`): every rank raises together, naming the parameter, and none hangs."""
    S = shard.numel()
    nb = lowp.scale_count(S)
    x = _blocks(shard.detach().float())
    scale = x.abs().amax(dim=1, keepdim=True) / lowp.QMAX[fmt]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: codes 0, scale 0
    y = x / safe
    if fmt == lowp.INT8:
        codes = y.round_().clamp_(-127, 127).to(torch.int8)
    else:
        codes = y.clamp_(-448.0, 448.0).to(_CODE[fmt])
    out[:S].copy_(codes.view(-1)[:S].view(torch.uint8))
    out[S:S + 4 * nb].copy_(scale.view(-1).view(torch.uint8))  # as bytes: S need not be a multiple of 4


def dequantize_into(wire: torch.Tensor, fmt: str, S: int, segments: int, out: torch.Tensor) -> None:
    """``segments`` wire segments (uint8) -> ``out[:segments * S]`` (the compute dtype), in segment order."""
    nb = lowp.scale_count(S)
    seg = wire.view(segments, S + 4 * nb)
    codes = seg[:, :S].contiguous().view(_CODE[fmt]).float()
    scales = seg[:, S:].reshape(-1).clone().view(torch.float32).view(segments, nb)  # (segments, nb)
    if nb * lowp.BLOCK != S:
        codes = torch.nn.functional.pad(codes, (0, nb * lowp.BLOCK - S))
    values = codes.view(segments, nb, lowp.BLOCK) * scales.unsqueeze(-1)
    out[:segments * S].view(segments, S).copy_(values.view(segments, nb * lowp.BLOCK)[:, :S])


def bad_blocks(wire: torch.Tensor, S: int, segments: int) -> list[tuple[int, int]]:
    """(segment, element offset in its shard) of the first non-finite block of each segment that has one."""
    nb = lowp.scale_count(S)
    scales = wire.view(segments, S + 4 * nb)[:, S:].reshape(-1).clone().view(torch.float32).view(segments, nb)
    ok = torch.isfinite(scales)
    if bool(ok.all()):
        return []
    return [(int(s), int(k) * lowp.BLOCK) for s, k in (~ok).nonzero().tolist()[:1]]


def round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` (1-D) quantized and dequantized to fp32, as one rank's gather would (tests, docs)."""
    S = x.numel()
    wire = torch.empty(lowp.wire_shard_bytes(S), dtype=torch.uint8)
    quantize_into(x, fmt, wire)
    out = torch.empty(S, dtype=torch.float32)
    dequantize_into(wire, fmt, S, 1, out)
    return out
