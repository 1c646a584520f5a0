"""The plan's plain frozen values: parameters, buffers, units, pieces, memory (the schedule's: ``ops.py``). No behaviour beyond
properties of one value; everything that reads several lives in the function modules (``geometry``,
``schedule``, ``accounting``, ...) and :class:`shardplan.planner.Plan` ties them together.

>>> p = plan.param("layers.0.attention.wq.weight")      # a ParamPlan
>>> p.global_shape, p.compute                             # e.g. (64, 64), Compute(dim=0, axis='tp', size=2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .. import layout as L
from .. import lowp
from ..dtypes import itemsize
from ..activations import ActivationPoint, Activations  # noqa: F401  (the plan stores them)
from ..spec import P
from ..units import ROOT

Box = tuple[slice, ...]


# -- parameters ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Compute:
    """How a compute (tensor-parallel) axis shards one parameter: ``dim`` over ``axis`` (``size`` ranks)."""

    dim: int
    axis: str
    size: int


def storage_spec(spec: P, compute_axes) -> P:
    """``spec`` without its compute axes: how the tensor-parallel-local tensor is stored.

    >>> storage_spec(P(("tp", "dp")), ("tp",))
    P('dp')
    """
    return P(*(tuple(a for a in spec.dim_axes(d) if a not in compute_axes) or None for d in range(len(spec))))


@dataclass(frozen=True)
class ParamPlan:
    """One parameter: its (tensor-parallel-local) shape and dtype, spec, unit, and place in its buffer.

    ``compute``: the dimension a compute axis keeps sharded while computing (``None``: replicated compute);
    ``shape`` is then what one tensor-parallel rank computes with (global dim / ``compute.size``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    spec: P
    rule: str
    unit: str
    buffer: int
    offset: int  # contiguous: offset in the gathered buffer; interleaved: offset in every segment; replicated: in buffer
    requires_grad: bool
    aliases: tuple[str, ...] = ()
    compute: Optional[Compute] = None

    # [Note: the sentinel readers of before ``compute`` existed (-1 / "" / 1 for none); kept read-only so the
    # runtime and the JSON format read them unchanged]
    @property
    def tp_dim(self) -> int:
        return self.compute.dim if self.compute else -1

    @property
    def tp_axis(self) -> str:
        return self.compute.axis if self.compute else ""

    @property
    def tp_size(self) -> int:
        return self.compute.size if self.compute else 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The whole tensor's shape (``shape`` is what one tensor-parallel rank computes with)."""
        c = self.compute
        if c is None:
            return self.shape
        return tuple(s * c.size if d == c.dim else s for d, s in enumerate(self.shape))

    @property
    def storage_spec(self) -> P:
        """The spec over the storage (data) axes: how the tensor-parallel-local tensor is sharded."""
        return storage_spec(self.spec, (self.compute.axis,)) if self.compute else self.spec

    @property
    def row(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1


@dataclass(frozen=True, kw_only=True)
class Piece:
    """Rank ``rank``'s piece of parameter ``param``: the box of the whole tensor it holds, and where.

    >>> plan.piece("layers.0.w", rank=1)     # e.g. Piece(param='layers.0.w', box=(slice(64, 128), slice(0, 256)), ...)
    """

    param: str                     # plan name
    index: int                     # position in plan.params
    buffer: int                    # plan.buffers index
    rank: int
    box: Optional[Box]             # global box; None: holds nothing
    storage_box: Optional[Box]     # box in the tensor-parallel-local tensor
    shard_offset: int              # where the piece starts in the rank's flat shard of the buffer
    shape: tuple[int, ...]         # the piece's shape
    full_offset: int               # where the whole (TP-local) parameter starts in the gathered parameter layout

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# -- buffers and units -----------------------------------------------------------------------------

@dataclass(frozen=True)
class BufferPlan:
    """One flat buffer of a unit: parameters of one dtype sharded over the same axes.

    The facts below the layout are decided once, by the planner, and read by the runtime and by
    :meth:`Plan.memory` alike: ``alias`` (the full buffer and the local shard share storage),
    ``persistent`` (the full buffer is kept between steps), ``grad_alias`` (the local shards' gradients
    are views of the unsharded gradient) and ``keeps_grads`` (the unsharded gradient is kept after its
    reduction, ZeRO-0/1).
    """

    index: int
    unit: str
    dtype: str
    compute_dtype: str
    reduce_dtype: str
    layout: str
    axes: tuple[str, ...]          # shard axes (all-gather / reduce-scatter group), mesh order
    replica_axes: tuple[str, ...]  # gradients all-reduced over these
    group_size: int
    shard_numel: int               # S: elements each rank stores
    numel: int                     # elements of real data
    params: tuple[str, ...]
    requires_grad: bool
    alias: bool = False
    persistent: bool = True
    grad_alias: bool = False
    keeps_grads: bool = True
    offload: str = ""  # "" (all on the device), "optimizer" or "params": what of it lives in host memory
    gather_dtype: str = ""  # "" (gathered in the compute dtype), "int8" or "float8_e4m3fn" (see shardplan.lowp)
    reduce_quant: str = ""  # "int8": gradients quantized per block, all-to-all, summed in fp32 (reduce_dtype float32)
    # compute axes its gradients are partial sums over (replicated parameters that read tensor-parallel-sharded
    # activations, a per-head q_norm: each rank's covers its own heads): summed over them before the reduction
    partial_axes: tuple[str, ...] = ()

    @property
    def sharded(self) -> bool:
        return self.layout != L.REPLICATED

    @property
    def wire_shard_bytes(self) -> int:
        """Bytes one rank sends in this buffer's quantized gather: codes and fp32 block scales (0: not quantized)."""
        return lowp.wire_shard_bytes(self.shard_numel, self.gather_dtype) if self.gather_dtype else 0

    @property
    def scale_bytes(self) -> int:
        """Bytes of fp32 scales one rank sends in its quantized gather (0: not quantized, or FP8 compute's
        tensorwise gather, whose scales come from the absmax all-reduce: :attr:`amax_bytes`)."""
        if not self.gather_dtype or self.tensorwise:
            return 0
        return lowp.SCALE_BYTES * lowp.scale_count(self.shard_numel)

    @property
    def tensorwise(self) -> bool:
        """FP8 compute's gather (planner/float8.py): float8 codes, bound as torchao float8 weights, no dequantize."""
        return self.gather_dtype == lowp.FLOAT8_TW

    @property
    def amax_bytes(self) -> int:
        """The all-reduce (max) before each tensorwise gather: one fp32 absmax per parameter (0: none)."""
        return lowp.AMAX_BYTES * len(self.params) if self.tensorwise and self.sharded and self.group_size > 1 else 0

    @property
    def gathered_itemsize(self) -> int:
        """Bytes per element of the gathered parameters: the compute dtype's, or 1 (float8 codes, tensorwise)."""
        return 1 if self.tensorwise else self.compute_itemsize

    @property
    def gather_bytes(self) -> int:
        """The payload of this buffer's all-gather on one rank (gathered size): the quantized wire, or the full
        buffer in the compute dtype."""
        if self.gather_dtype:
            return self.wire_shard_bytes * (self.group_size if self.sharded else 1)
        return self.gathered_numel * self.compute_itemsize

    @property
    def reduce_bytes(self) -> int:
        """The payload of this buffer's reduce-scatter on one rank: the quantized segments (an all-to-all of
        ``group_size`` wire segments), or the gathered buffer in the reduce dtype."""
        if self.reduce_quant:
            return lowp.wire_shard_bytes(self.shard_numel) * self.group_size
        return self.gathered_numel * self.reduce_itemsize

    @property
    def gathered_numel(self) -> int:
        return self.shard_numel * self.group_size if self.sharded else self.shard_numel

    @property
    def reduced_numel(self) -> int:
        """Elements of the gradient each rank holds after the reduce-scatter (all of it if replicated)."""
        return self.shard_numel if self.sharded else self.gathered_numel

    @property
    def grad_numel(self) -> int:
        """Elements of the unsharded gradient (parameter layout for copy-out buffers)."""
        return self.numel if self.copy_out else self.gathered_numel

    @property
    def padding(self) -> int:
        return self.gathered_numel - self.numel

    @property
    def copy_out(self) -> bool:
        return self.layout == L.INTERLEAVED

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def compute_itemsize(self) -> int:
        return itemsize(self.compute_dtype)

    @property
    def reduce_itemsize(self) -> int:
        return itemsize(self.reduce_dtype)

    # [Note: gradients land in the reduce dtype] autograd forms a unit's gradients in the compute dtype (bf16);
    # where they are reduced in a wider dtype (fp32), they land in an unsharded gradient of that dtype, cast
    # in the landing's one pass (``_chunk_cat``, FSDP2's copy-in does the same), and that gradient is the
    # reduction's input: no compute-dtype copy and no separate cast pass over it (on one H100, the cast
    # alone was 3 ms of the 1B's 128 ms step). Not where the unsharded gradient is kept between steps
    # (ZeRO-0/1: twice its memory), packed (copy-out) or quantized (their own passes).
    @property
    def lands_in_reduce_dtype(self) -> bool:
        """The unsharded gradient is kept in the reduce dtype (see the note above), not the compute dtype."""
        return (self.requires_grad and self.reduce_itemsize > self.compute_itemsize and not self.keeps_grads
                and not self.copy_out and not self.reduce_quant)

    @property
    def flat_itemsize(self) -> int:
        """Bytes per element of the unsharded gradient."""
        return self.reduce_itemsize if self.lands_in_reduce_dtype else self.compute_itemsize


def buffer_facts(layout: str, level: int, group_size: int, dtype: str, compute: str, reduce: str) -> dict[str, bool]:
    """The storage facts of a buffer (see :class:`BufferPlan`); the single place they are decided."""
    replicated = layout == L.REPLICATED
    alias = layout != L.INTERLEAVED and compute == dtype and (replicated or level <= 2)
    return dict(alias=alias, persistent=level <= 2 or alias,
                grad_alias=(replicated or (group_size == 1 and level <= 1)) and compute == dtype == reduce,
                keeps_grads=level <= 1)


@dataclass(frozen=True)
class UnitPlan:
    name: str
    buffers: tuple[int, ...]
    reshard_after_forward: bool
    modules: tuple[str, ...] = ()  # module paths it covers, when neighbours were merged (else just `name`)
    parent: str = ROOT             # the unit whose module encloses this one's (nested units)

    @property
    def module_paths(self) -> tuple[str, ...]:
        return self.modules or (("",) if self.name == ROOT else (self.name,))


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank. ``peak`` = the most the schedule holds at once on the device (optimizer state
    included); ``host`` / ``host_peak``: host memory of CPU offload (master shards, gradient shards and
    optimizer state of the offloaded buffers, and their step counts; every host tensor is kept for the whole run,
    so the two agree: what a CPU run allocates); ``host_pinned``: what a CUDA run allocates for the same
    tensors, whose pinned slabs are rounded up to powers of two (``shardplan.planner.offload.slab_layout``)."""

    params: int
    grads: int
    optimizer: int
    gathered_peak: int
    peak: int
    host: int = 0
    host_peak: int = 0
    host_pinned: int = 0
    # [Note: activations] With a traced plan (``trace=``), ``peak`` includes the activations the traced
    # step keeps (``activations``: their bytes at the peak; ``recompute``: with every unit checkpointed)
    # and ``states_peak`` is the model states' own peak (what the runtime's own accounting measures).
    # Without a trace ``activations`` is None and ``peak == states_peak``.
    activations: Optional[int] = None
    recompute: bool = False
    states_peak: Optional[int] = None

    @property
    def persistent(self) -> int:
        return self.params + self.grads + self.optimizer
