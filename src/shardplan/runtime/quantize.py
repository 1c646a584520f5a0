"""Block-quantized gathers: the kernels (see :mod:`shardplan.lowp` for the formats and the wire layout).

One rank's wire segment is a uint8 tensor: ``S`` one-byte codes (int8 or float8_e4m3fn, sent as bytes:
gloo has no float8) followed by ``ceil(S / BLOCK)`` fp32 scales. Quantizing reads the master shard in
fp32; dequantizing writes the compute dtype.
"""

from __future__ import annotations

import torch

from .. import lowp

_CODE = {lowp.INT8: torch.int8, lowp.FLOAT8: getattr(torch, "float8_e4m3fn", None)}


def _blocks(x: torch.Tensor, segments: int = 1) -> torch.Tensor:
    """``x`` (``segments * S`` elements, fp32) as (segments, blocks, BLOCK), each segment zero-padded at its end."""
    x = x.view(segments, -1)
    S = x.shape[1]
    nb = lowp.scale_count(S)
    if nb * lowp.BLOCK != S:
        x = torch.nn.functional.pad(x, (0, nb * lowp.BLOCK - S))
    return x.reshape(segments, nb, lowp.BLOCK)


def quantize_into(shard: torch.Tensor, fmt: str, out: torch.Tensor, segments: int = 1) -> None:
    """Write ``shard``'s (1-D, any floating dtype; ``segments`` equal segments of it, each quantized on its own)
    codes and block scales into ``out`` (uint8, ``segments`` wire segments).

    [Note: non-finite values] are not checked here: a NaN or inf makes its block's absmax (so its scale)
    non-finite, and the scales travel to every rank, which checks them after the gather
    (:func:`bad_blocks`): every rank raises together, naming the parameter, and none hangs."""
    S = shard.numel() // segments
    nb = lowp.scale_count(S)
    x = _blocks(shard.detach().float(), segments)
    scale = x.abs().amax(dim=2, keepdim=True) / lowp.QMAX[fmt]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: codes 0, scale 0
    y = x / safe
    if fmt == lowp.INT8:
        codes = y.round_().clamp_(-127, 127).to(torch.int8)
    else:
        codes = y.clamp_(-448.0, 448.0).to(_CODE[fmt])
    wire = out.view(segments, S + 4 * nb)
    wire[:, :S].copy_(codes.view(segments, -1)[:, :S].view(torch.uint8))
    # as bytes: S need not be a multiple of 4
    wire[:, S:].copy_(scale.view(segments, nb).contiguous().view(torch.uint8))


def dequantize_into(wire: torch.Tensor, fmt: str, S: int, segments: int, out: torch.Tensor) -> None:
    """``segments`` wire segments (uint8) -> ``out[:segments * S]`` (the compute dtype), in segment order.

    [Note: one pass for int8] codes times scales is written straight into ``out`` (the multiply computes in
    fp32 and casts on the store); float8 codes are widened first (torch does not promote float8)."""
    nb = lowp.scale_count(S)
    full = S // lowp.BLOCK  # whole blocks; a partial last block is done apart
    seg = wire.view(segments, S + 4 * nb)
    codes = seg[:, :S].view(_CODE[fmt])
    if fmt != lowp.INT8:
        codes = codes.float()
    scales = seg[:, S:].reshape(-1).clone().view(torch.float32).view(segments, nb)  # (segments, nb)
    dst = out[:segments * S].view(segments, S)
    if full:
        F = full * lowp.BLOCK
        torch.mul(codes[:, :F].unflatten(1, (full, lowp.BLOCK)), scales[:, :full, None],
                  out=dst[:, :F].unflatten(1, (full, lowp.BLOCK)))
    if full < nb:
        torch.mul(codes[:, full * lowp.BLOCK:], scales[:, full:], out=dst[:, full * lowp.BLOCK:])


def dequantize_mean(wire: torch.Tensor, fmt: str, S: int, segments: int, out: torch.Tensor) -> None:
    """The mean of ``segments`` wire segments (every rank's quantized piece of one gradient segment), summed in
    fp32 into ``out`` (S elements, fp32): a quantized reduce-scatter's second half."""
    tmp = torch.empty(segments * S, dtype=torch.float32, device=out.device)
    dequantize_into(wire, fmt, S, segments, tmp)
    torch.sum(tmp.view(segments, S), dim=0, out=out)
    out.div_(segments)


def bad_blocks(wire: torch.Tensor, S: int, segments: int) -> list[tuple[int, int]]:
    """(segment, element offset in its shard) of the first non-finite block of each segment that has one."""
    nb = lowp.scale_count(S)
    scales = wire.view(segments, S + 4 * nb)[:, S:].reshape(-1).clone().view(torch.float32).view(segments, nb)
    ok = torch.isfinite(scales)
    if bool(ok.all()):
        return []
    return [(int(s), int(k) * lowp.BLOCK) for s, k in (~ok).nonzero().tolist()[:1]]


def first_bad_block(wire: torch.Tensor, S: int, segments: int):
    """``(index, event)``: the flat index (segment * blocks + block) of the first non-finite scale, or -1, in
    host memory once ``event`` completes (``None``: already there). Issues no host synchronisation."""
    nb = lowp.scale_count(S)
    return first_non_finite(wire.view(segments, S + 4 * nb)[:, S:].reshape(-1).clone().view(torch.float32))


def first_non_finite_index(x: torch.Tensor) -> torch.Tensor:
    """The index of the first non-finite element of ``x`` (1-D), or -1, as a 0-d tensor on ``x``'s device."""
    bad = ~torch.isfinite(x)
    ar = torch.arange(bad.numel(), device=bad.device)
    index = torch.where(bad, ar, torch.full_like(ar, bad.numel())).min()
    return torch.where(index == bad.numel(), torch.full_like(index, -1), index)


def first_bad_block_index(wire: torch.Tensor, S: int, segments: int) -> torch.Tensor:
    """:func:`first_bad_block`'s index on the device (a captured step reads it after the replay)."""
    nb = lowp.scale_count(S)
    return first_non_finite_index(wire.view(segments, S + 4 * nb)[:, S:].reshape(-1).clone().view(torch.float32))


def first_non_finite(x: torch.Tensor):
    """``(index, event)``: the index of the first non-finite element of ``x`` (1-D), or -1, in host memory once
    ``event`` completes (``None``: already there). Issues no host synchronisation."""
    index = first_non_finite_index(x)
    if x.device.type != "cuda":
        return index, None
    host = torch.empty((), dtype=index.dtype, pin_memory=True)
    host.copy_(index, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` (1-D) quantized and dequantized to fp32, as one rank's gather would (tests, docs)."""
    S = x.numel()
    wire = torch.empty(lowp.wire_shard_bytes(S), dtype=torch.uint8)
    quantize_into(x, fmt, wire)
    out = torch.empty(S, dtype=torch.float32)
    dequantize_into(wire, fmt, S, 1, out)
    return out
