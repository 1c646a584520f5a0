"""The planner's options, checked once: :func:`check` turns ``shardplan.plan``'s keywords into one frozen
:class:`Options` (names resolved, dtypes named, axes checked against the mesh), or raises naming the option and
the fix. The passes (``passes.py``) read only this value.

The grouped options (``precision=``, ``offload=``, ``schedule=``, ``layout=``: ``policies.py``) and the flat
keywords they group (:data:`FLAT`) meet in :func:`merge`: one set of policies, each field checked by its own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from .. import lowp
from ..errors import MeshError, PlanError
from ..mesh import Mesh
from . import expert_parallel as EP
from . import float8 as F8
from . import offload as OFF
from . import tensor_parallel as tp
from .kinds import LayoutChoice, Offload as OffloadMode, Order, strategy_level
from .policies import GROUPS, Layout, Offload, Policies, Precision, Schedule


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
    policies: Policies    # the options grouped (what plan() was given, checked)


# the flat keywords of shardplan.plan that a policy groups: keyword -> (the policy's keyword, its field)
FLAT = {"compute_dtype": ("precision", "compute_dtype"), "reduce_dtype": ("precision", "reduce_dtype"),
        "gather_dtype": ("precision", "gather_dtype"), "fp8": ("precision", "fp8"),
        "fp8_gather": ("precision", "fp8_gather"), "offload_fraction": ("offload", "fraction"),
        "device_memory": ("offload", "device_memory"), "prefetch": ("schedule", "prefetch"),
        "order": ("schedule", "order"), "reshard_after_forward": ("schedule", "reshard_after_forward"),
        "min_unit_bytes": ("layout", "min_unit_bytes")}


def _same(a, b) -> bool:
    """``a == b``, but a bool equals only itself (``prefetch=True`` is not ``prefetch=1``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # (a value that does not compare: not the default)
        return False


def _grouped(name: str, policy, cls, flat: dict[str, Any]):
    """``policy`` (a ``cls``) with the fields ``flat`` (flat keyword -> value) sets, or ``cls`` of them
    without one. [Note: a field at its default says nothing (the flat keywords' defaults are the fields');
    a field set both ways is refused, naming both spellings]"""
    values = {FLAT[k][1]: (k, v) for k, v in flat.items()}
    if policy is None:
        return cls(**{f: v for f, (_, v) in values.items()})
    if not isinstance(policy, cls):
        raise PlanError(f"{name} must be a shardplan.{cls.__name__} (e.g. {name}=sp.{cls.__name__}(...)) or left out; "
                        f"got {policy!r}")
    default, changes = cls(), {}
    for f, (keyword, value) in values.items():
        if _same(value, getattr(default, f)):
            continue
        if not _same(getattr(policy, f), getattr(default, f)):
            raise PlanError(f"{keyword}={value!r} and {name}=sp.{cls.__name__}({f}={getattr(policy, f)!r}) both set "
                            f"the {f} of the {name} options; give it once: {keyword}=... or "
                            f"{name}=sp.{cls.__name__}({f}=...)")
        changes[f] = value
    return dataclasses.replace(policy, **changes) if changes else policy


def merge(*, precision=None, offload=None, schedule=None, layout=None, **flat) -> Policies:
    """The policies ``shardplan.plan`` was given, with its flat keywords (``FLAT``; ``offload="optimizer"`` and
    ``layout="chunked"``: the policies' ``what`` and ``kind``) filled in; each field checked by its policy."""
    of = {g: {k: flat.pop(k) for k in list(flat) if FLAT[k][0] == g} for g in GROUPS}
    if isinstance(offload, Offload):
        off = _grouped("offload", offload, Offload, of["offload"])
    elif offload is None or offload == "" or offload is False:  # no offload: the flat options' own errors
        OFF.check(None, of["offload"]["offload_fraction"], None, of["offload"]["device_memory"])
        off = None
    else:
        off = Offload(offload, of["offload"]["offload_fraction"], of["offload"]["device_memory"])
    sched = _grouped("schedule", schedule, Schedule, of["schedule"])
    if isinstance(layout, Layout):
        lay = _grouped("layout", layout, Layout, of["layout"])
    else:
        lay = Layout(layout, of["layout"]["min_unit_bytes"])
    return Policies(precision=_grouped("precision", precision, Precision, of["precision"]), offload=off,
                    schedule=sched, layout=lay)


def check(mesh: Mesh, *, world_size, strategy, compute_axes, expert_axes, styles, optimizer_states,
          **policies) -> Options:
    """Every option checked, in the order ``shardplan.plan`` always checked them (the first bad one raises);
    ``policies``: the keywords of :func:`merge`."""
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be a shardplan.Mesh, e.g. Mesh(dp=8); got {type(mesh).__name__}")
    if world_size is not None and world_size != mesh.size:
        raise MeshError(f"mesh {mesh!r} has {mesh.size} ranks but the world size is {world_size}; "
                        f"make the axis sizes multiply to {world_size}")
    level = strategy_level(strategy)
    pol = merge(**policies)
    pr, off, sched, lay = pol.precision, pol.offload, pol.schedule, pol.layout
    offload, offload_fraction = OFF.check(off.what, off.fraction, level, off.device_memory) if off else (None, 1.0)
    reduce_quant = lowp.reduce_format(pr.reduce_dtype)
    compute_axes = tp.as_compute_axes(compute_axes, mesh)
    gather_option = lowp.as_option(pr.gather_dtype)
    fp8_option = F8.as_option(pr.fp8)
    expert_axes = EP.as_expert_axes(expert_axes, mesh, compute_axes)
    if reduce_quant:
        lowp.refuse_reduce(level, offload, compute_axes, bool(expert_axes))
    return Options(level=level, offload=offload, offload_fraction=offload_fraction,
                   device_memory=off.device_memory if off else None, prefetch=sched.prefetch, order=sched.order,
                   layout=lay.kind, min_unit_bytes=lay.min_unit_bytes, compute=pr.compute_dtype,
                   reduce=pr.reduce_dtype, reduce_quant=reduce_quant, compute_axes=compute_axes,
                   expert_axes=expert_axes, gather_option=gather_option, fp8_option=fp8_option,
                   fp8_gather=pr.fp8_gather, styles=styles, reshard_after_forward=sched.reshard_after_forward,
                   optimizer_states=optimizer_states, policies=pol)
