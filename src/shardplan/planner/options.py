"""The planner's options, checked once: :func:`check` turns ``shardplan.plan``'s keywords into one frozen
:class:`Options` (names resolved, dtypes named, axes checked against the mesh), or raises naming the option and
the fix. The passes (``passes.py``) read only this value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from .. import lowp
from ..dtypes import dtype_name, is_floating, itemsize
from ..errors import MeshError, PlanError
from ..mesh import Mesh
from . import expert_parallel as EP
from . import float8 as F8
from . import offload as OFF
from . import tensor_parallel as tp
from .kinds import LayoutChoice, Offload as OffloadMode, Order, choose, strategy_level


@dataclass(frozen=True)
class Options:
    """``shardplan.plan``'s options after :func:`check`: the strategy as its level, enums for the string
    options, dtype names, the compute and expert axes as tuples of mesh axes."""
    level: int
    offload: Optional[OffloadMode]
    offload_fraction: Union[float, str]
    device_memory: Optional[float]
    prefetch: int
    order: Order
    layout: LayoutChoice
    min_unit_bytes: Optional[int]
    compute: Optional[str]
    reduce: Optional[str]
    reduce_quant: str
    compute_axes: tuple
    expert_axes: tuple
    gather_option: Any
    fp8_option: Any
    fp8_gather: bool
    styles: Optional[Sequence[tuple[str, str]]]
    reshard_after_forward: Union[bool, Mapping[str, bool]]
    optimizer_states: int


DtypeLike = Any  # a torch.dtype or its name ("bfloat16", "bf16"): the planner does not import torch


def check_dtypes(compute: Optional[str], reduce: Optional[str], reduce_quant: str) -> None:
    # [Note: quantized reduction] reduce_dtype='int8': the buffers reduce into fp32; the plan keeps the option's name
    for what, name in (("compute_dtype", compute), ("reduce_dtype", reduce)):
        if name is not None and not is_floating(name) and not (what == "reduce_dtype" and reduce_quant):
            # a cast to an integer type would zero the numbers
            hint = (" or 'int8' (a quantized reduction); quantized gathers: gather_dtype='int8'"
                    if what == "reduce_dtype" else "")
            raise PlanError(f"{what}={name!r} is not a floating dtype; use e.g. 'bfloat16' or 'float32'{hint}")
        if name is not None and not (what == "reduce_dtype" and reduce_quant) and itemsize(name) < 2:
            # [Note: sub-16-bit floats] a float8 reduction would sum float8 values on the wire (gloo and NCCL have no
            # float8 sum: the first backward fails on every rank), and float8 compute needs scaled matmuls
            hint = ("a quantized reduction: reduce_dtype='int8' (block-scaled, summed in fp32), or 'bfloat16'"
                    if what == "reduce_dtype" else
                    "FP8 compute: fp8='torchao' (float8 matmuls with scales); float8 gathers: "
                    "gather_dtype='float8_e4m3fn'; or compute_dtype='bfloat16'")
            raise PlanError(f"{what}={name!r} is not supported: shardplan has no {name} "
                            f"{'gradient reduction' if what == 'reduce_dtype' else 'compute'} "
                            f"(docs/low_precision.md, 'Not yet'); use {hint}")


def _frozen(value):
    """Lists of rule pairs as tuples (the caller's list may change after)."""
    if isinstance(value, list):
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return value


def _schedule(prefetch, order, min_unit_bytes, layout) -> tuple:
    """``prefetch``, ``order``, ``min_unit_bytes`` and ``layout`` checked: (prefetch, Order, min_unit_bytes, LayoutChoice)."""
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise PlanError(f"prefetch must be a non-negative integer (units gathered ahead); got {prefetch!r}")
    m = min_unit_bytes
    if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 0):
        raise PlanError(f"min_unit_bytes must be None (chosen for you) or a non-negative number of bytes; got {m!r}")
    return prefetch, choose(Order, order, "order"), m, choose(LayoutChoice, layout, "layout")


def check(mesh: Mesh, *, world_size, strategy, compute_axes, expert_axes, styles, optimizer_states, compute_dtype,
          reduce_dtype, gather_dtype, fp8, fp8_gather, offload, offload_fraction, device_memory, prefetch, order,
          reshard_after_forward, layout, min_unit_bytes) -> Options:
    """Every option checked, in order (the first bad one raises): the mesh, the strategy, the dtypes, offload, the
    schedule and layout, the axes."""
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be a shardplan.Mesh, e.g. Mesh(dp=8); got {type(mesh).__name__}")
    if world_size is not None and world_size != mesh.size:
        raise MeshError(f"mesh {mesh!r} has {mesh.size} ranks but the world size is {world_size}; "
                        f"make the axis sizes multiply to {world_size}")
    level = strategy_level(strategy)
    compute, reduce = dtype_name(compute_dtype), dtype_name(reduce_dtype)
    reduce_quant = lowp.reduce_format(reduce)
    check_dtypes(compute, reduce, reduce_quant)
    gather_dtype, fp8 = _frozen(gather_dtype), _frozen(fp8)
    offload, offload_fraction = OFF.check(offload, offload_fraction, level, device_memory)
    prefetch, order, min_unit_bytes, layout = _schedule(prefetch, order, min_unit_bytes, layout)
    compute_axes = tp.as_compute_axes(compute_axes, mesh)
    gather_option = lowp.as_option(gather_dtype)
    fp8_option = F8.as_option(fp8)
    expert_axes = EP.as_expert_axes(expert_axes, mesh, compute_axes)
    if reduce_quant:
        lowp.refuse_reduce(level, offload, compute_axes, bool(expert_axes))
    return Options(level=level, offload=offload, offload_fraction=offload_fraction,
                   device_memory=device_memory if offload else None, prefetch=prefetch, order=order,
                   layout=layout, min_unit_bytes=min_unit_bytes, compute=compute, reduce=reduce,
                   reduce_quant=reduce_quant, compute_axes=compute_axes, expert_axes=expert_axes,
                   gather_option=gather_option, fp8_option=fp8_option, fp8_gather=fp8_gather, styles=styles,
                   reshard_after_forward=reshard_after_forward, optimizer_states=optimizer_states)
