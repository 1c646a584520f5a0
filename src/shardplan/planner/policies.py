"""``shardplan.plan``'s options grouped by feature, as FSDP2 groups its ``MixedPrecisionPolicy`` and
``OffloadPolicy``: :class:`Precision` (dtypes, quantized gathers, FP8 compute), :class:`Offload` (CPU offload),
:class:`Schedule` (prefetch, order, resharding after forward) and :class:`Layout` (shard layout, unit merging).

Each is a frozen value that checks its own fields when it is made (a :class:`~shardplan.errors.PlanError`
naming the field and the fix), so a bad option fails where it is written. ``shardplan.plan`` takes them beside
its flat keywords, which keep working and mean the same (``compute_dtype=`` is ``Precision(compute_dtype=)``):

>>> plan = sp.plan(model, rules, sp.Mesh(dp=8),
...                precision=sp.Precision(compute_dtype="bfloat16", reduce_dtype="float32"),
...                offload=sp.Offload("optimizer", fraction="auto", device_memory=80 * 2**30),
...                schedule=sp.Schedule(prefetch=2), layout=sp.Layout("chunked"))
>>> plan.policies.offload.fraction        # the number "auto" chose

A plan gives back the policies that rebuild it (:attr:`shardplan.Plan.policies`, a :class:`Policies`).
[Note: a field at its default says nothing: a flat keyword may fill a field its policy leaves at the
default (``schedule=sp.Schedule(order="dynamic"), prefetch=2``), and one field set both ways is refused
(options.py: :func:`~shardplan.planner.options.merge`)]
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence, Union

from .. import lowp
from ..dtypes import dtype_name, is_floating, itemsize
from ..errors import PlanError
from . import float8 as F8
from . import offload as OFF
from .kinds import LayoutChoice, Order, choose
from .kinds import Offload as OffloadMode

DtypeLike = Any  # a torch.dtype or its name ("bfloat16", "bf16"): the planner does not import torch
RulePairs = Sequence[tuple[str, Optional[str]]]  # ((regex, value or None), ...): first match wins


def _frozen(value):
    """Lists of rule pairs as tuples (a policy is frozen: the caller's list may change after)."""
    if isinstance(value, list):
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return value


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


@dataclass(frozen=True)
class Precision:
    """The dtypes a step computes, reduces and gathers in (FSDP2's ``MixedPrecisionPolicy``, and shardplan's
    low-precision options): ``plan(precision=...)``.

    ``compute_dtype``: the dtype parameters are gathered and computed in (FSDP2's ``param_dtype``; ``None``: their
    own); ``reduce_dtype``: the gradient reduction's (``None``: the compute dtype; ``"int8"``: a block-quantized
    reduction summed in fp32); ``gather_dtype``: ``"int8"`` or ``"float8_e4m3fn"`` all-gathers block-quantized
    shards (ZeRO-3), or ``[(regex, dtype or None), ...]`` per parameter; ``fp8``: ``"torchao"`` runs the units'
    ``nn.Linear``\\ s in float8, or ``[(module regex, "torchao" or None), ...]``; ``fp8_gather``: their weights are
    gathered as float8 codes (``False``: in the compute dtype). Dtypes are kept by name.

    >>> Precision(compute_dtype="bf16", reduce_dtype="float32")
    Precision(compute_dtype='bfloat16', reduce_dtype='float32', gather_dtype=None, fp8=None, fp8_gather=True)
    """

    compute_dtype: Optional[DtypeLike] = None
    reduce_dtype: Optional[DtypeLike] = None
    gather_dtype: Union[None, str, RulePairs] = None
    fp8: Union[None, str, RulePairs] = None
    fp8_gather: bool = True

    def __post_init__(self) -> None:
        compute, reduce = dtype_name(self.compute_dtype), dtype_name(self.reduce_dtype)
        check_dtypes(compute, reduce, lowp.reduce_format(reduce))
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "reduce_dtype", reduce)
        object.__setattr__(self, "gather_dtype", _frozen(self.gather_dtype))
        object.__setattr__(self, "fp8", _frozen(self.fp8))
        lowp.as_option(self.gather_dtype)
        F8.as_option(self.fp8)


@dataclass(frozen=True)
class Offload:
    """CPU offload (FSDP2's ``CPUOffloadPolicy``, for a share of the state): ``plan(offload=...)``.

    ``what="optimizer"`` keeps the master shards and the optimizer state in host memory and steps them there;
    ``"params"`` (ZeRO-3) also the parameter shards, copied in ahead of each gather. ``fraction``: the share of the
    trainable shard bytes offloaded (``0 < f <= 1``), or ``"auto"``: the smallest share whose device peak fits
    ``device_memory`` (bytes per device). No offload: ``offload=None``. See docs/offload.md.

    >>> Offload("optimizer", fraction=0.5)
    Offload(what='optimizer', fraction=0.5, device_memory=None)
    >>> Offload("params", fraction="auto", device_memory=80 * 2**30).fraction
    'auto'
    """

    what: Union[OffloadMode, str] = OffloadMode.OPTIMIZER
    fraction: Union[float, str] = 1.0
    device_memory: Optional[float] = None

    def __post_init__(self) -> None:
        if self.what is None or self.what == "" or self.what is False:
            raise PlanError("Offload(what=...) names what goes to host memory: 'optimizer' or 'params'; for no "
                            "offload pass offload=None")
        what, fraction = OFF.check(self.what, self.fraction, device_memory=self.device_memory)
        object.__setattr__(self, "what", what)
        object.__setattr__(self, "fraction", fraction)


@dataclass(frozen=True)
class Schedule:
    """How the step's collectives are ordered: ``plan(schedule=...)``.

    ``prefetch``: units gathered ahead, forward and backward; ``order="dynamic"`` keeps units gathered until the
    forward ends, for models that run units in a data-dependent order or more than once (``"static"`` raises
    when a freed unit runs again); ``reshard_after_forward``: free each unit's gathered parameters after its
    forward (``True``, FSDP2's default) or keep them for backward (``False``), or ``{unit: bool}``.

    >>> Schedule(prefetch=2, order="dynamic")
    Schedule(prefetch=2, order='dynamic', reshard_after_forward=True)
    """

    prefetch: int = 1
    order: Union[Order, str] = Order.STATIC
    reshard_after_forward: Union[bool, Mapping[str, bool]] = True

    def __post_init__(self) -> None:
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or self.prefetch < 0:
            raise PlanError(f"prefetch must be a non-negative integer (units gathered ahead); got {self.prefetch!r}")
        object.__setattr__(self, "order", choose(Order, self.order, "order"))


@dataclass(frozen=True)
class Layout:
    """How each unit's parameters are laid out in its flat buffers: ``plan(layout=...)``.

    ``kind="auto"``: whole rows packed contiguously where that costs little padding (no copy-out after each
    gather); ``"chunked"``: every rank holds the ``torch.chunk`` piece of each sharded dimension (FSDP2's and
    DTensor's layout). ``min_unit_bytes`` merges neighbouring units until each holds at least that many parameter
    bytes (``None``: the planner chooses and says why in ``plan.notes``; ``0``: one unit per module).

    >>> Layout("chunked", min_unit_bytes=0)
    Layout(kind='chunked', min_unit_bytes=0)
    """

    kind: Union[LayoutChoice, str] = LayoutChoice.AUTO
    min_unit_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", choose(LayoutChoice, self.kind, "layout"))
        m = self.min_unit_bytes
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 0):
            raise PlanError(f"min_unit_bytes must be None (chosen for you) or a non-negative number of bytes; "
                            f"got {m!r}")


@dataclass(frozen=True)
class Policies:
    """A plan's options grouped (``plan.policies``): the policies that rebuild it, with the numbers the planner
    chose (the offload fraction ``"auto"`` took, the ``min_unit_bytes`` it merged units by).

    >>> sp.plan(model, rules, mesh, units=units, **plan.policies.keywords()).equivalent(plan)
    True
    """

    precision: Precision = field(default_factory=Precision)
    offload: Optional[Offload] = None
    schedule: Schedule = field(default_factory=Schedule)
    layout: Layout = field(default_factory=Layout)

    def keywords(self) -> dict[str, Any]:
        """``shardplan.plan``'s keywords for these policies."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


GROUPS = {"precision": Precision, "offload": Offload, "schedule": Schedule, "layout": Layout}
