"""The compute axes a plan knows, in order (tensor, expert, context parallelism), and what the planner does
with all of them at once: their in-module ops in the schedule, their share of ``plan.comm_bytes()``, the check
of an activation op, their part of the JSON. Each axis is one module implementing
:class:`~shardplan.planner.axis.ComputeAxis`; a new one joins through :func:`register` (its run-time side through
:func:`shardplan.runtime.axes.register`).

>>> [a.kind for a in registered()]
['tp', 'ep', 'cp']
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

from ..errors import PlanError
from . import context_parallel as CPX
from . import expert_parallel as EP
from . import tensor_parallel as tp
from .axis import ComputeAxis, ModuleOps, Placing, Resolving, with_activation_ops
from .ops import Op
# the expert axis reads), and the notes and comm_bytes keys come in it; ops within a step follow op_order]
_AXES: list[ComputeAxis] = [tp.TensorAxis(), EP.ExpertAxis(), CPX.ContextAxis()]


def registered() -> tuple[ComputeAxis, ...]:
    return tuple(_AXES)


def register(axis: ComputeAxis) -> ComputeAxis:
    """Add ``axis`` after the known ones (every later plan resolves, places and counts it); returns it."""
    if not axis.kind or any(a.kind == axis.kind for a in _AXES):
        raise PlanError(f"compute axis kind {axis.kind!r} is empty or taken; kinds: {[a.kind for a in _AXES]}")
    _AXES.append(axis)
    return axis


def unregister(kind: str) -> None:
    """Remove the axis registered under ``kind`` (a test's fake axis)."""
    _AXES[:] = [a for a in _AXES if a.kind != kind]


def value(values: Sequence[Any], kind: str) -> Any:
    """The value of axis ``kind`` among a plan's ``axes`` (``None``: off in that plan)."""
    return next((v for v in values if v.kind == kind), None)


def resolve(module, infos: Sequence[Any], specs: Sequence[Any], rule_of: Mapping[str, str], opts, mesh, trace):
    """Every axis resolved in order: (compute placement per parameter (``None``: replicated compute), storage
    spec per parameter, the placements whose axis gives them buffers of their own, each axis's value by kind)."""
    compute: dict[str, Any] = {i.name: None for i in infos}
    spec_of: dict[str, Any] = {i.name: s for i, s in zip(infos, specs)}
    by: dict[str, ComputeAxis] = {}       # name -> the axis that placed it
    separate: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for axis in _AXES:
        r = axis.resolve(Resolving(module, [(i, spec_of[i.name], rule_of[i.name]) for i in infos], opts, mesh, trace))
        if r is None:
            continue
        spec_of.update(r.specs)
        for name, c in r.compute.items():
            if c is None:
                continue
            if compute[name] is not None:
                prev = compute[name]
                raise PlanError(f"parameter {name!r} (rule {rule_of[name]}) is {axis.phrase} {c.axis!r} and "
                                f"{by[name].phrase} {prev.axis!r}; one compute axis per parameter: keep "
                                f"{prev.axis!r} out of its spec")
            compute[name], by[name] = c, axis
            if axis.separate_buffers:
                separate[name] = c
        if r.value is not None:
            values[axis.kind] = r.value
    return compute, spec_of, separate, values


def place(ctx: Placing, values: Mapping[str, Any]) -> tuple[dict, list]:
    """Every axis traced and placed in order (each sees the values placed before it): ({kind: value} of the axes
    on in the plan, their notes)."""
    placed: dict[str, Any] = {}
    notes = []
    for axis in _AXES:
        v = axis.place(dataclasses.replace(ctx, placed=dict(placed)), values.get(axis.kind))
        if v is not None:
            placed[axis.kind] = v
            note = axis.note(v, ctx.mesh)
            if note:
                notes.append(note)
    return placed, notes


def module_ops(values: Sequence[Any], mesh) -> tuple[ModuleOps, ...]:
    """Every axis's in-module ops, axes in ``op_order``."""
    by_kind = {v.kind: v for v in values}
    return tuple(o for a in sorted(_AXES, key=lambda a: a.op_order) for o in a.module_ops(by_kind.get(a.kind), mesh))


def with_ops(schedule: Sequence[Op], units, values: Sequence[Any], mesh) -> tuple[Op, ...]:
    """``schedule`` (the units' ops) with the axes' in-module ops placed (:func:`.axis.with_activation_ops`)."""
    return with_activation_ops(schedule, units, module_ops(values, mesh))


def comm_bytes(plan) -> dict:
    """``{key: bytes}`` of every axis for ``plan.comm_bytes()`` (``None``: not estimated)."""
    return {k: b for a in _AXES for k, b in a.comm_bytes(plan, value(plan.axes, a.kind)).items()}


def check_op(plan, op: Op) -> Optional[str]:
    """Why activation op ``op`` is not one of ``plan``'s axes runs (``None``: it is): checked by the first axis
    that claims it, else by the fallback (tensor parallelism)."""
    axis = next((a for a in _AXES if not a.fallback and a.claims(op)), None) or next(a for a in _AXES if a.fallback)
    return axis.check_op(plan, value(plan.axes, axis.kind), op)


def to_dict(values: Sequence[Any]) -> dict:
    return {k: v for a in _AXES for k, v in a.to_dict(value(values, a.kind)).items()}


def from_dict(d: Mapping[str, Any]) -> tuple:
    return tuple(v for a in _AXES for v in [a.from_dict(d)] if v is not None)
