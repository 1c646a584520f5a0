"""The plan: a frozen, printable, serialisable description of how a model is sharded and synced.

>>> plan = shardplan.plan(model, rules, Mesh(dp=8), units=[r"layers\\.\\d+"], compute_dtype=torch.bfloat16)
>>> print(plan); plan.memory(); plan.local_slices("layers.0.attention.wq.weight", rank=3)
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional, Sequence

from . import layout as L
from .dtypes import dtype_name, is_floating, itemsize
from .errors import MeshError, PlanError, PlanWarning
from .mesh import Mesh
from .rules import as_rules, match_leaves
from .schedule import (ALL_GATHER, ALL_REDUCE, BACKWARD, FREE, REDUCE_SCATTER, STRATEGIES, Op, UnitComm,
                       build_schedule)
from .spec import P
from .units import ROOT, assign_units, collect_leaves, trace_order

FORMAT_VERSION = 1


def strategy_level(strategy) -> int:
    """0..3 from a strategy name or number (ZeRO level)."""
    if isinstance(strategy, int) and not isinstance(strategy, bool) and 0 <= strategy <= 3:
        return strategy
    if strategy in STRATEGIES:
        return STRATEGIES.index(strategy)
    raise PlanError(f"unknown strategy {strategy!r}; use one of {STRATEGIES} or 0..3")


@dataclass(frozen=True)
class ParamPlan:
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

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1


@dataclass(frozen=True)
class BufferPlan:
    """One flat buffer of a unit: parameters of one dtype sharded over the same axes."""

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

    @property
    def gathered_numel(self) -> int:
        return self.shard_numel * self.group_size if self.layout != L.REPLICATED else self.shard_numel

    @property
    def padding(self) -> int:
        return self.gathered_numel - self.numel

    @property
    def copy_out(self) -> bool:
        return self.layout == L.INTERLEAVED


@dataclass(frozen=True)
class UnitPlan:
    name: str
    buffers: tuple[int, ...]
    reshard_after_forward: bool
    modules: tuple[str, ...] = ()  # module paths it covers, when neighbours were merged (else just `name`)

    @property
    def module_paths(self) -> tuple[str, ...]:
        return self.modules or (("",) if self.name == ROOT else (self.name,))


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank. ``peak`` = persistent state + the largest transient total in the schedule."""

    params: int
    grads: int
    optimizer: int
    gathered_peak: int
    peak: int

    @property
    def persistent(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class Plan:
    mesh: Mesh
    strategy: str
    compute_dtype: Optional[str]
    reduce_dtype: Optional[str]
    prefetch: int
    reshard_after_forward: bool
    optimizer_states: int
    params: tuple[ParamPlan, ...]
    buffers: tuple[BufferPlan, ...]
    units: tuple[UnitPlan, ...]
    schedule: tuple[Op, ...]
    warnings: tuple[str, ...] = field(default=())

    # -- lookups -----------------------------------------------------------------------------------
    @cached_property
    def _by_name(self) -> dict[str, ParamPlan]:
        out = {p.name: p for p in self.params}
        for p in self.params:
            for a in p.aliases:
                out[a] = p
        return out

    @property
    def level(self) -> int:
        return strategy_level(self.strategy)

    def param(self, name: str) -> ParamPlan:
        try:
            return self._by_name[name]
        except KeyError:
            raise PlanError(f"the plan has no parameter {name!r}; it has e.g. {[p.name for p in self.params[:5]]}") from None

    def unit(self, name: str) -> UnitPlan:
        for u in self.units:
            if u.name == name:
                return u
        raise PlanError(f"the plan has no unit {name!r}; units: {[u.name for u in self.units]}")

    def segment(self, buffer: BufferPlan, rank: int) -> int:
        """Index of ``rank``'s segment in ``buffer``'s gathered layout (its rank in the shard group)."""
        return self.mesh.axis_index(rank, buffer.axes) if buffer.layout != L.REPLICATED else 0

    # -- per-rank geometry ---------------------------------------------------------------------------
    def local_slices(self, name: str, rank: int) -> Optional[tuple[slice, ...]]:
        """Global index box of parameter ``name`` that ``rank`` owns (``None`` if it owns nothing).

        Under ``optim``/``optim_grads`` this is the shard whose optimizer state the rank owns; under
        ``no_shard`` every rank owns the whole tensor.
        """
        p = self.param(name)
        b = self.buffers[p.buffer]
        full = tuple(slice(0, d) for d in p.shape)
        if b.layout == L.REPLICATED or p.numel == 0:
            return full
        if b.layout == L.CONTIGUOUS:
            r0, r1 = L.contiguous_rows(p.offset, p.numel, p.row, b.shard_numel, self.segment(b, rank))
            return None if r1 <= r0 else (slice(r0, r1),) + full[1:]
        box = []
        for d, size in enumerate(p.shape):
            axes = p.spec.dim_axes(d)
            parts = self.mesh.axis_size(axes) if axes else 1
            s, e = L.chunk_range(size, parts, self.mesh.axis_index(rank, axes)) if axes else (0, size)
            if e <= s:
                return None
            box.append(slice(s, e))
        return tuple(box)

    def local_shape(self, name: str, rank: int) -> tuple[int, ...]:
        box = self.local_slices(name, rank)
        p = self.param(name)
        if box is None:
            return (0,) + tuple(p.shape[1:]) if p.shape else (0,)
        return tuple(s.stop - s.start for s in box)

    def local_offset(self, name: str, rank: int) -> int:
        """Offset of ``rank``'s piece of ``name`` inside its own shard of the buffer (elements)."""
        p = self.param(name)
        b = self.buffers[p.buffer]
        if b.layout == L.CONTIGUOUS:
            seg = self.segment(b, rank)
            return max(p.offset, seg * b.shard_numel) - seg * b.shard_numel
        return p.offset

    # -- accounting ----------------------------------------------------------------------------------
    def _buffer_bytes(self, b: BufferPlan) -> dict[str, Any]:
        it, ct, rt = itemsize(b.dtype), itemsize(b.compute_dtype), itemsize(b.reduce_dtype)
        lvl = self.level
        shard, full = b.shard_numel * it, b.gathered_numel * ct
        alias = b.compute_dtype == b.dtype and (b.layout == L.REPLICATED or lvl in (0, 1, 2))
        full_persistent = lvl in (0, 1, 2) or alias
        params = full if alias else shard + (full if full_persistent else 0)
        gathered = 0 if full_persistent else full
        grads = grad_transient = reduce_copy = local_grad = full_grad_kept = 0
        if b.requires_grad:
            # the local .grads are views of the flat gradient itself: replicated buffers, and under
            # ZeRO-0/1 a shard group of one rank (its reduction is the identity), when no cast is needed
            grad_alias = (b.layout == L.REPLICATED or (b.group_size == 1 and lvl in (0, 1))) and \
                b.compute_dtype == b.dtype == b.reduce_dtype
            full_grad = b.gathered_numel * ct
            reduce_copy = b.gathered_numel * rt if b.reduce_dtype != b.compute_dtype else 0
            if grad_alias:
                grads = full_grad_kept = full_grad
            else:
                local_grad = b.shard_numel * it  # the local .grads: created by the reduction, kept to zero_grad
                full_grad_kept = full_grad if lvl in (0, 1) else 0
                grads = local_grad + full_grad_kept
                grad_transient = 0 if lvl in (0, 1) else full_grad
        send = b.shard_numel * ct if (b.layout != L.REPLICATED and gathered and ct != it) else 0
        reduce_out = b.shard_numel * rt if (b.requires_grad and b.layout != L.REPLICATED and rt != it) else 0
        if b.layout == L.INTERLEAVED and gathered:  # packed all-gather output besides the param-layout copy
            gathered += b.numel * ct
        return dict(params=params, gathered=gathered, grads=grads, grad_transient=grad_transient,
                    reduce_copy=reduce_copy, send=send, reduce_out=reduce_out, local_grad=local_grad,
                    full_grad_kept=full_grad_kept)

    def memory(self, rank: int = 0) -> Memory:
        """Planned bytes on ``rank``: params, grads and optimizer state, and the peak over the schedule."""
        per = [self._buffer_bytes(b) for b in self.buffers]
        params = sum(x["params"] for x in per)
        grads = sum(x["grads"] for x in per)
        optimizer = 0
        if self.optimizer_states:
            for p in self.params:
                if p.requires_grad:
                    optimizer += math.prod(self.local_shape(p.name, rank)) * 4 * self.optimizer_states
        # Walk the schedule as the runtime executes it: a unit's flat gradient comes alive when its
        # backward starts and is released when the *next* reduction is issued (one reduction in
        # flight); the cast copy for the reduction and its output live while it runs.
        live: dict[tuple[str, int], int] = {}
        deferred: list[tuple[str, int]] = []
        peak_transient = gathered_peak = 0
        in_backward = False

        def bump(extra: int = 0):
            nonlocal peak_transient, gathered_peak
            peak_transient = max(peak_transient, sum(live.values()) + extra)
            gathered_peak = max(gathered_peak, sum(v for (k, _), v in live.items() if k == "param"))

        for op in self.schedule:
            if op.phase == BACKWARD and not in_backward:
                in_backward = True
                for u in self.units:  # the root's gradients accumulate from the start of backward
                    if u.name == ROOT:
                        for i in u.buffers:
                            if per[i]["grad_transient"]:
                                live[("grad", i)] = per[i]["grad_transient"]
            if op.kind == ALL_GATHER:
                for i in op.buffers:
                    if per[i]["gathered"]:
                        live[("param", i)] = per[i]["gathered"]
                        live[("send", i)] = per[i]["send"]
                bump()
                for i in op.buffers:
                    live.pop(("send", i), None)
            elif op.kind in (REDUCE_SCATTER, ALL_REDUCE):
                for i in op.buffers:
                    if per[i]["grad_transient"]:
                        live[("grad", i)] = per[i]["grad_transient"]
                bump()
                for i in op.buffers:
                    if per[i]["local_grad"]:
                        live[("lgrad", i)] = per[i]["local_grad"]
                for key in deferred:
                    live.pop(key, None)
                deferred.clear()
                if op.kind == REDUCE_SCATTER:
                    bump(sum(per[i]["reduce_copy"] + per[i]["reduce_out"] for i in op.buffers))
            elif op.kind == FREE:
                for i in op.buffers:
                    if op.what == "grads":
                        deferred.append(("grad", i))
                    else:
                        live.pop(("param", i), None)
            bump()
        for i, x in enumerate(per):  # gradients of buffers no reduction touched (none in a full step)
            if x["local_grad"] and ("lgrad", i) not in live:
                peak_transient = max(peak_transient, sum(live.values()) + x["local_grad"])
        base = params + optimizer + sum(x["full_grad_kept"] for x in per)
        return Memory(params, grads, optimizer, gathered_peak, max(base + peak_transient, params + grads + optimizer))

    def comm_bytes(self, rank: int = 0) -> dict[str, int]:
        """Bytes each rank sends per training step, by op kind (ring algorithms: (n-1)/n of the payload)."""
        out = {ALL_GATHER: 0, REDUCE_SCATTER: 0, ALL_REDUCE: 0}
        for op in self.schedule:
            if op.kind == FREE:
                continue
            n = self.mesh.axis_size(op.axes) if op.axes else 1
            factor = 2 if op.kind == ALL_REDUCE else 1
            out[op.kind] += op.bytes * factor * (n - 1) // n
        out["total"] = sum(out.values())
        return out

    def max_gathered_units(self) -> int:
        """Most units whose parameters are gathered at once while walking the schedule."""
        live, most = set(), 0
        for op in self.schedule:
            if op.kind == ALL_GATHER and op.phase != "step":
                live.add(op.unit)
            elif op.kind == FREE and op.what == "params":
                live.discard(op.unit)
            most = max(most, len(live))
        return most

    @property
    def padding(self) -> int:
        """Padded elements summed over buffers (per rank group)."""
        return sum(b.padding for b in self.buffers)

    def to_chrome_trace(self, path: str, *, gbps: float = 100.0) -> None:
        """Write the planned schedule as a Chrome/Perfetto trace (open in ui.perfetto.dev).

        One track per collective kind; each op's length is its payload at ``gbps`` GB/s, laid end to
        end per track in schedule order. A picture of the plan's order and sizes, not a measurement.
        """
        tracks = {ALL_GATHER: 1, REDUCE_SCATTER: 2, ALL_REDUCE: 3, FREE: 4}
        clock = {t: 0.0 for t in tracks.values()}
        start = 0.0
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": kind}}
                  for kind, tid in tracks.items()]
        for i, op in enumerate(self.schedule):
            tid = tracks[op.kind]
            dur = max(op.bytes / (gbps * 1e3), 1.0)  # microseconds
            ts = max(clock[tid], start)
            events.append({"name": f"{op.kind} {op.unit}", "cat": op.phase, "ph": "X", "pid": 0, "tid": tid,
                           "ts": ts, "dur": dur, "args": {"index": i, "unit": op.unit, "phase": op.phase,
                                                          "bytes": op.bytes, "axes": list(op.axes),
                                                          "prefetch": op.prefetch, "what": op.what}})
            clock[tid] = ts + dur
            start = ts + (0.0 if op.prefetch else 0.5)
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

    # -- serialisation -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "mesh": self.mesh.to_dict(),
            "strategy": self.strategy,
            "compute_dtype": self.compute_dtype,
            "reduce_dtype": self.reduce_dtype,
            "prefetch": self.prefetch,
            "reshard_after_forward": self.reshard_after_forward,
            "optimizer_states": self.optimizer_states,
            "params": [dict(name=p.name, shape=list(p.shape), dtype=p.dtype, spec=p.spec.to_list(), rule=p.rule,
                            unit=p.unit, buffer=p.buffer, offset=p.offset, requires_grad=p.requires_grad,
                            aliases=list(p.aliases)) for p in self.params],
            "buffers": [dict(index=b.index, unit=b.unit, dtype=b.dtype, compute_dtype=b.compute_dtype,
                             reduce_dtype=b.reduce_dtype, layout=b.layout, axes=list(b.axes),
                             replica_axes=list(b.replica_axes), group_size=b.group_size, shard_numel=b.shard_numel,
                             numel=b.numel, params=list(b.params), requires_grad=b.requires_grad) for b in self.buffers],
            "units": [dict(name=u.name, buffers=list(u.buffers), reshard_after_forward=u.reshard_after_forward,
                           modules=list(u.modules)) for u in self.units],
            "schedule": [dict(kind=o.kind, unit=o.unit, phase=o.phase, buffers=list(o.buffers), axes=list(o.axes),
                              bytes=o.bytes, prefetch=o.prefetch, what=o.what) for o in self.schedule],
            "warnings": list(self.warnings),
        }

    def to_json(self, indent: Optional[int] = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        if d.get("format") != FORMAT_VERSION:
            raise PlanError(f"plan JSON has format {d.get('format')!r}; this shardplan reads format {FORMAT_VERSION}")
        return cls(
            mesh=Mesh(**d["mesh"]), strategy=d["strategy"], compute_dtype=d["compute_dtype"],
            reduce_dtype=d["reduce_dtype"], prefetch=d["prefetch"], reshard_after_forward=d["reshard_after_forward"],
            optimizer_states=d["optimizer_states"],
            params=tuple(ParamPlan(p["name"], tuple(p["shape"]), p["dtype"], P.from_list(p["spec"]), p["rule"], p["unit"],
                                   p["buffer"], p["offset"], p["requires_grad"], tuple(p["aliases"])) for p in d["params"]),
            buffers=tuple(BufferPlan(b["index"], b["unit"], b["dtype"], b["compute_dtype"], b["reduce_dtype"], b["layout"],
                                     tuple(b["axes"]), tuple(b["replica_axes"]), b["group_size"], b["shard_numel"],
                                     b["numel"], tuple(b["params"]), b["requires_grad"]) for b in d["buffers"]),
            units=tuple(UnitPlan(u["name"], tuple(u["buffers"]), u["reshard_after_forward"], tuple(u.get("modules", ())))
                        for u in d["units"]),
            schedule=tuple(Op(o["kind"], o["unit"], o["phase"], tuple(o["buffers"]), tuple(o["axes"]), o["bytes"],
                              o["prefetch"], o["what"]) for o in d["schedule"]),
            warnings=tuple(d["warnings"]),
        )

    def fingerprint(self) -> str:
        """A short hash of the plan's JSON: equal on every process that built the same plan."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def __str__(self) -> str:
        from .report import render
        return render(self)

    def __repr__(self) -> str:
        return (f"Plan({self.mesh!r}, strategy={self.strategy!r}, params={len(self.params)}, units={len(self.units)}, "
                f"buffers={len(self.buffers)}, ops={len(self.schedule)}, fingerprint={self.fingerprint()!r})")


# -- building a plan ----------------------------------------------------------------------------

def _placement_kind(spec: P, mesh: Mesh, level: int) -> tuple[str, tuple[str, ...]]:
    if level == 0 or not spec.axes:
        return L.REPLICATED, ()
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    axes = tuple(sorted(spec.axes, key=order.__getitem__))
    if spec.sharded_dims == (0,) and spec.dim_axes(0) == axes:
        return L.CONTIGUOUS, axes
    return L.INTERLEAVED, axes


def _interleaved(members, mesh: Mesh, A: int) -> L.Placement:
    chunks = []
    for info, spec in members:
        parts = [mesh.axis_size(spec.dim_axes(d)) if spec.dim_axes(d) else 1 for d in range(len(info.shape))]
        chunks.append(math.prod(L.chunk_shape(info.shape, parts)))
    return L.place_interleaved(chunks, A)


def _layout_unit(members, mesh: Mesh, level: int, compute: Optional[str], reduce: Optional[str]):
    """Group a unit's (info, spec) pairs into buffers; yields (key, layout, placement, members)."""
    groups: dict[tuple, list] = {}
    for info, spec in members:
        kind, axes = _placement_kind(spec, mesh, level)
        key = (dtype_name(info.dtype), info.requires_grad, axes, kind)
        groups.setdefault(key, []).append((info, spec))
    # a contiguous group whose padding is too high joins the interleaved group of its key
    out: dict[tuple, tuple[L.Placement, list]] = {}
    for key, mem in groups.items():
        dtype, rg, axes, kind = key
        cdt = compute if compute and is_floating(dtype) else dtype
        A = L.align_elems(itemsize(dtype), itemsize(cdt))
        W = mesh.axis_size(axes) if axes else 1
        if kind == L.REPLICATED:
            out[key] = (L.place_replicated([math.prod(i.shape) for i, _ in mem], A), mem)
            continue
        if kind == L.CONTIGUOUS:
            items = tuple((math.prod(i.shape), math.prod(i.shape[1:])) for i, _ in mem)
            cont = L.place_contiguous(items, W, A)
            inter = _interleaved(mem, mesh, A)
            total = sum(n for n, _ in items)
            if cont is not None and cont.shard_numel * W - total <= max(2 * (inter.shard_numel * W - total), total // 100):
                out[key] = (cont, mem)
                continue
        ikey = (dtype, rg, axes, L.INTERLEAVED)
        merged = out.pop(ikey, (None, []))[1] + mem
        out[ikey] = (_interleaved(merged, mesh, A), merged)
    return out


def _merge_small_units(order: list[str], members: dict, min_bytes: int):
    """Merge consecutive units smaller than ``min_bytes`` (the last group may stay smaller)."""
    if min_bytes <= 0 or len(order) < 2:
        return order, members, {}
    size = {u: sum(math.prod(i.shape) * i.dtype.itemsize for i, _ in members[u]) for u in order}
    groups, current, acc = [], [], 0
    for u in order:
        current.append(u)
        acc += size[u]
        if acc >= min_bytes:
            groups.append(current)
            current, acc = [], 0
    if current:
        groups.append(current)
    new_order, new_members, covers = [], {ROOT: members[ROOT]}, {}
    for g in groups:
        name = g[0] if len(g) == 1 else f"{g[0]}..{g[-1]}"
        new_order.append(name)
        new_members[name] = [m for u in g for m in members[u]]
        if len(g) > 1:
            covers[name] = tuple(g)
    return new_order, new_members, covers


def plan(model_or_tree, rules, mesh: Mesh, *, strategy="optim_grads_params", units: Sequence[str] = (),
         compute_dtype=None, reduce_dtype=None, prefetch: int = 1, reshard_after_forward: bool = True,
         trace=None, optimizer_states: int = 2, world_size: Optional[int] = None, min_unit_bytes: int = 0) -> Plan:
    """Compile rules, a mesh and options into a :class:`Plan`. Pure: no process group, no GPU.

    >>> plan = shardplan.plan(model, rules, Mesh(dp=8), units=[r"layers\\.\\d+"], compute_dtype=torch.bfloat16)

    ``min_unit_bytes`` merges neighbouring units (in forward order) until each holds at least that many
    parameter bytes: one collective per direction for several tiny blocks.
    """
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be a shardplan.Mesh, e.g. Mesh(dp=8); got {type(mesh).__name__}")
    if world_size is not None and world_size != mesh.size:
        raise MeshError(f"mesh {mesh!r} has {mesh.size} ranks but the world size is {world_size}; "
                        f"make the axis sizes multiply to {world_size}")
    level = strategy_level(strategy)
    if not isinstance(prefetch, int) or prefetch < 0:
        raise PlanError(f"prefetch must be a non-negative integer (units gathered ahead); got {prefetch!r}")
    compute, reduce = dtype_name(compute_dtype), dtype_name(reduce_dtype)
    rules = as_rules(rules)
    infos, leaves, candidates, module = collect_leaves(model_or_tree)
    if not infos:
        raise PlanError("the model has no parameters to plan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        matched = match_leaves(rules, [i.name for i in infos], leaves, mesh=mesh)
        owner, order, notes = assign_units(infos, candidates, tuple(units))
        if trace is not None:
            if module is None:
                raise PlanError("trace= needs an nn.Module; a plain pytree has no forward to trace")
            order = trace_order(module, order, trace)
    for w in caught:
        warnings.warn(w.message, w.category, stacklevel=2)
    notes += [str(w.message) for w in caught]

    members: dict[str, list] = {u: [] for u in [ROOT] + order}
    rule_of: dict[str, str] = {}
    for info, (spec, rule) in zip(infos, matched):
        members[owner[info.name]].append((info, spec))
        rule_of[info.name] = rule.describe()
    order, members, covers = _merge_small_units(order, members, min_unit_bytes)
    unit_order = [ROOT] + order

    params: dict[str, ParamPlan] = {}
    buffers: list[BufferPlan] = []
    unit_plans: list[UnitPlan] = []
    comms: list[UnitComm] = []
    last = order[-1] if order else None
    for uname in unit_order:
        if not members[uname]:
            continue
        idxs = []
        gather, reduce_, allred = [], [], []
        for (dtype, rg, axes, _), (placement, mem) in _layout_unit(members[uname], mesh, level, compute, reduce).items():
            cdt = compute if compute and is_floating(dtype) else dtype
            rdt = reduce if reduce and is_floating(dtype) else cdt
            replica = tuple(a for a in mesh.axis_names if a not in axes)
            idx = len(buffers)
            b = BufferPlan(idx, uname, dtype, cdt, rdt, placement.layout, axes, replica,
                           mesh.axis_size(axes) if axes else 1, placement.shard_numel,
                           sum(math.prod(i.shape) for i, _ in mem), tuple(i.name for i, _ in mem), rg)
            buffers.append(b)
            idxs.append(idx)
            for (info, spec), off in zip(mem, placement.offsets):
                params[info.name] = ParamPlan(info.name, info.shape, dtype, spec if level else P(), rule_of[info.name],
                                              uname, idx, off, info.requires_grad, info.aliases)
            if b.layout != L.REPLICATED:
                gather.append((idx, axes, b.gathered_numel * itemsize(cdt)))
            if rg:
                if b.layout != L.REPLICATED:
                    reduce_.append((idx, axes, b.gathered_numel * itemsize(rdt)))
                many_replicas = mesh.axis_size(replica) > 1 if replica else False
                if many_replicas:  # a group of one has nothing to all-reduce
                    n = b.shard_numel if b.layout != L.REPLICATED else b.gathered_numel
                    allred.append((idx, replica, n * itemsize(rdt)))
        raf = reshard_after_forward and uname != ROOT and uname != last
        unit_plans.append(UnitPlan(uname, tuple(idxs), raf, covers.get(uname, ())))
        comms.append(UnitComm(uname, tuple(gather), tuple(reduce_), tuple(allred), raf, uname == ROOT))
    schedule = build_schedule(comms, level, prefetch)
    result = Plan(mesh, STRATEGIES[level], compute, reduce, prefetch, reshard_after_forward, optimizer_states,
                  tuple(params[i.name] for i in infos), tuple(buffers), tuple(unit_plans), schedule, ())
    from .report import plan_warnings
    object.__setattr__(result, "warnings", tuple(notes) + plan_warnings(result))
    return result
