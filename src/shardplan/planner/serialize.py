"""Plans to and from JSON (format 2: ops carry their trigger and condition; buffers their facts)."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, Optional

from ..errors import PlanError
from ..mesh import Mesh
from ..spec import P
from . import axes as AX
from . import float8 as F8
from . import tensor_parallel as TPX
from .kinds import LayoutChoice, Offload, Order, Strategy, choose
from .validate import normalised
from .ops import Op
from .values import ActivationPoint, Activations, BufferPlan, Compute, ParamPlan, UnitPlan

if TYPE_CHECKING:  # pragma: no cover
    from .facade import Plan

FORMAT_VERSION = 2


def to_dict(plan: "Plan") -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "mesh": _mesh_json(plan.mesh),
        "strategy": plan.strategy,
        "compute_dtype": plan.compute_dtype,
        "reduce_dtype": plan.reduce_dtype,
        "prefetch": plan.prefetch,
        "reshard_after_forward": plan.reshard_after_forward,
        "optimizer_states": plan.optimizer_states,
        "order": plan.order,
        "params": [dict(name=p.name, shape=list(p.shape), dtype=p.dtype, spec=p.spec.to_list(), rule=p.rule,
                        unit=p.unit, buffer=p.buffer, offset=p.offset, requires_grad=p.requires_grad,
                        aliases=list(p.aliases), **({"tp_dim": p.tp_dim, "tp_axis": p.tp_axis, "tp_size": p.tp_size}
                                                   if p.tp_axis else {})) for p in plan.params],
        "buffers": [dict(index=b.index, unit=b.unit, dtype=b.dtype, compute_dtype=b.compute_dtype,
                         reduce_dtype=b.reduce_dtype, layout=b.layout, axes=list(b.axes),
                         replica_axes=list(b.replica_axes), group_size=b.group_size, shard_numel=b.shard_numel,
                         numel=b.numel, params=list(b.params), requires_grad=b.requires_grad, alias=b.alias,
                         persistent=b.persistent, grad_alias=b.grad_alias, keeps_grads=b.keeps_grads,
                         **({"offload": b.offload} if b.offload else {}),
                         **({"gather_dtype": b.gather_dtype} if b.gather_dtype else {}),
                         **({"reduce_quant": b.reduce_quant} if b.reduce_quant else {}),
                         **({"partial_axes": list(b.partial_axes)} if b.partial_axes else {}))
                    for b in plan.buffers],
        "units": [dict(name=u.name, buffers=list(u.buffers), reshard_after_forward=u.reshard_after_forward,
                       modules=list(u.modules), parent=u.parent) for u in plan.units],
        "schedule": [dict(kind=o.kind, unit=o.unit, what=o.what, event=o.event, at=o.at, buffers=list(o.buffers),
                          axes=list(o.axes), bytes=o.bytes, prefetch=o.prefetch, when=o.when) for o in plan.schedule],
        "warnings": list(plan.warnings),
        "notes": list(plan.notes),
        "min_unit_bytes": plan.min_unit_bytes,
        # [Note: only a non-default layout is written, so plans made before the option keep their fingerprints]
        **({"layout": plan.layout} if plan.layout != "auto" else {}),
        **({"offload": plan.offload, "offload_fraction": plan.offload_fraction} if plan.offload else {}),
        **AX.to_dict(plan.axes),  # each compute axis's keys (compute_axes, tp_modules, expert_modules, context_calls, ...)
        **({"fp8_modules": [dataclasses.asdict(m) for m in plan.fp8_modules]} if plan.fp8_modules else {}),
        # [Note: written only for a plan traced with it, so older plans keep their JSON and fingerprints]
        **({"activations": _activations_dict(plan.activations)} if plan.activations is not None else {}),
    }


def _activations_dict(a: Activations) -> dict[str, Any]:
    def point(p: ActivationPoint) -> list:
        return [p.event, p.live, p.peak] + ([] if p.moved is None else [p.moved])
    return {"inputs": a.inputs, "plain": [point(p) for p in a.plain],
            "recompute": [point(p) for p in a.recompute], **({"grads": True} if a.grads else {}),
            **({"tokens": a.tokens} if a.tokens is not None else {})}


def _activations(d: Optional[dict]) -> Optional[Activations]:
    if d is None:
        return None
    return Activations(inputs=d["inputs"], plain=tuple(ActivationPoint(*p) for p in d["plain"]),
                       recompute=tuple(ActivationPoint(*p) for p in d["recompute"]), grads=bool(d.get("grads", False)),
                       tokens=d.get("tokens"))


def _mesh_json(mesh: Mesh):
    """The mesh's axes in order. [Note: JSON is written with sorted keys, so a mesh whose axes are not in
    alphabetical order (``Mesh(dp=2, cp=2)``) is written as ``[[name, size], ...]``: as a dict it would come
    back as ``Mesh(cp=2, dp=2)``, another rank layout. Sorted meshes keep the dict (and their fingerprints).]"""
    names = list(mesh.axis_names)
    return mesh.to_dict() if names == sorted(names) else [[n, s] for n, s in mesh.axes]


def to_json(plan: "Plan", indent: Optional[int] = None) -> str:
    return json.dumps(to_dict(plan), indent=indent, sort_keys=True)


def _param(p: dict) -> ParamPlan:
    tp_keys = ("tp_dim", "tp_axis", "tp_size")
    c = Compute(p["tp_dim"], p["tp_axis"], p["tp_size"]) if p.get("tp_axis") else None
    rest = {k: v for k, v in p.items() if k not in tp_keys}
    return ParamPlan(**{**rest, "shape": tuple(rest["shape"]), "spec": P.from_list(rest["spec"]),
                        "aliases": tuple(rest["aliases"])}, compute=c)


def plan_fields(text: str) -> dict[str, Any]:
    """The keyword arguments of :class:`Plan` that a plan's JSON holds (``Plan(**plan_fields(text))``)."""
    d = json.loads(text)
    if d.get("format") != FORMAT_VERSION:
        raise PlanError(f"plan JSON has format {d.get('format')!r}: written by an older shardplan (before format "
                        f"{FORMAT_VERSION}), which this one does not read; plan the model again with this version and "
                        f"save that plan")
    tup = tuple
    return dict(
        mesh=Mesh(**dict(d["mesh"])), strategy=choose(Strategy, d["strategy"], "strategy"), compute_dtype=d["compute_dtype"],
        reduce_dtype=d["reduce_dtype"], prefetch=d["prefetch"], reshard_after_forward=d["reshard_after_forward"],
        optimizer_states=d["optimizer_states"], order=choose(Order, d["order"], "order"),
        params=tuple(_param(p) for p in d["params"]),
        buffers=tuple(BufferPlan(**{**b, "axes": tup(b["axes"]), "replica_axes": tup(b["replica_axes"]),
                                    "params": tup(b["params"]), "partial_axes": tup(b.get("partial_axes", ()))})
                      for b in d["buffers"]),
        units=tuple(UnitPlan(**{**u, "buffers": tup(u["buffers"]), "modules": tup(u["modules"])}) for u in d["units"]),
        schedule=normalised(Op(**{**o, "buffers": tup(o["buffers"]), "axes": tup(o["axes"])}) for o in d["schedule"]),
        warnings=tuple(d["warnings"]), notes=tuple(d["notes"]), min_unit_bytes=d["min_unit_bytes"],
        axes=AX.from_dict(d),
        layout=choose(LayoutChoice, d.get("layout", "auto"), "layout"),
        offload=choose(Offload, d["offload"], "offload") if d.get("offload") else None,
        offload_fraction=float(d.get("offload_fraction", 1.0)),
        activations=_activations(d.get("activations")),
        fp8_modules=tuple(F8.FP8Module(**m) for m in d.get("fp8_modules", ())),
    )


def core(plan: "Plan") -> dict[str, Any]:
    """``plan``'s JSON without what may differ between equivalent plans: the rules' wording, the notes, the
    warnings (``plan.equivalent``)."""
    d = to_dict(plan)
    for q in d["params"]:
        q.pop("rule")
    d.pop("notes"), d.pop("warnings")
    return d


def summary(plan: "Plan") -> dict[str, Any]:
    """Options and sizes that tell two plans apart at a glance."""
    return {
        "mesh": repr(plan.mesh), "strategy": plan.strategy, "compute_dtype": plan.compute_dtype,
        "reduce_dtype": plan.reduce_dtype, "prefetch": plan.prefetch,
        "reshard_after_forward": plan.reshard_after_forward, "order": plan.order,
        "optimizer_states": plan.optimizer_states, "parameters": len(plan.params),
        "elements": sum(p.numel for p in plan.params), "units": [u.name for u in plan.units],
        "ops": len(plan.schedule), "min_unit_bytes": plan.min_unit_bytes, "compute_axes": list(TPX.of(plan).axes),
        "tp_modules": len(TPX.of(plan).modules), "layout": plan.layout,
        "offload": plan.offload, "offload_fraction": plan.offload_fraction,
    }
