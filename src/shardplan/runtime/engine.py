"""Executes a plan's schedule: module hooks gather, free and reduce units as the plan says."""

from __future__ import annotations

import collections
import contextlib
import os
from datetime import timedelta
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import layout as L
from ..errors import CollectiveError
from ..plan import Plan
from ..schedule import ALL_GATHER, ALL_REDUCE, BACKWARD, FORWARD, FREE, REDUCE_SCATTER, STEP
from ..units import ROOT
from . import collectives as C
from .buffers import BufferState
from .streams import Streams


def _profiling() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


def tensors_in(obj, out=None) -> list[torch.Tensor]:
    """Tensors inside nested tuples, lists, dicts (incl. HF ModelOutput) and dataclasses."""
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            tensors_in(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            tensors_in(x, out)
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            tensors_in(getattr(obj, k, None), out)
    return out


@dataclass
class UnitState:
    name: str
    module: nn.Module
    buffers: list[BufferState]
    reshard_after_forward: bool
    is_root: bool
    slots: list = field(default_factory=list)  # (module, attr, local param, full param)
    modules: list = field(default_factory=list)  # several when the planner merged neighbours
    swapped_in: bool = False
    expected: int = 0
    got: int = 0
    gathered: bool = False
    pending: Optional[tuple] = None
    pre_backward_done: bool = False
    reduced: bool = False

    @property
    def sharded(self) -> list[BufferState]:
        return [b for b in self.buffers if b.sharded]

    @property
    def with_grads(self) -> list[BufferState]:
        return [b for b in self.buffers if b.requires_grad]


@dataclass
class _Inflight:
    unit: UnitState
    buffer: BufferState
    works: list
    event: Any
    result: torch.Tensor
    keep: list


class Engine:
    """The runtime state of one sharded module. Attached as ``module._shardplan``."""

    def __init__(self, module: nn.Module, plan: Plan, rank: int, device: torch.device, groups: dict, timeout_s: float):
        self.module, self.plan, self.rank, self.device = module, plan, rank, device
        self.level = plan.level
        self.groups = groups
        self.timeout_s = timeout_s
        self.streams = Streams(device)
        self.units: list[UnitState] = []
        self.by_name: dict[str, UnitState] = {}
        self.record: Optional[list] = None
        self.sync = True
        self.in_backward = False
        self.callback_queued = False
        self.dirty = True  # ZeRO-1/2: shards changed since the last gather
        self.inflight: collections.deque[_Inflight] = collections.deque()
        self.max_inflight = 1
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.handles: list = []
        self.max_gathered = 0  # most units gathered (or being gathered) at once
        self.n_gathered = 0
        self.track_memory = False
        self.hook_seconds = 0.0  # CPU time spent in the runtime's hooks (benchmarks read it)
        self.forward_next: dict[str, list] = {}
        self.backward_next: dict[str, list] = {}

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _op(self, kind: str, unit: UnitState, phase: str):
        if self.record is not None:
            self.record.append((kind, unit.name, phase))
        if _profiling():
            return torch.profiler.record_function(f"shardplan.{kind} unit={unit.name} phase={phase}")
        return contextlib.nullcontext()

    def _wait(self, work, what: str) -> None:
        try:
            if self.streams.cuda or work is C.DONE:
                work.wait()  # NCCL: the compute stream waits; the process group's own timeout applies
            elif not work.wait(timeout=timedelta(seconds=self.timeout_s)):
                raise TimeoutError(f"no completion within {self.timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - re-raised with the op named
            raise CollectiveError(f"shardplan: {what} failed on rank {self.rank}: {exc}. Every rank must run the "
                                  f"same schedule: check that all ranks called forward/backward") from exc

    def _call(self, fn, what: str, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            raise CollectiveError(f"shardplan: {what} failed on rank {self.rank}: {exc}") from exc

    def _account(self) -> None:
        """Live bytes of every distinct storage the runtime holds (params, gathered, grads, in flight)."""
        if not self.track_memory:  # O(units) per call: only while someone asked for memory figures
            return
        seen: dict[int, int] = {}

        def add(t: Optional[torch.Tensor]) -> None:
            if t is not None:
                st = t.untyped_storage()
                if st.size():
                    seen[st.data_ptr()] = st.size()

        for u in self.units:
            for b in u.buffers:
                add(b.full)
                add(b.out)
                add(b.shard)
                add(b.grad_full)
                for lp in b.local:
                    add(lp.grad)
            if u.pending is not None:
                for t in u.pending[2]:
                    add(t)
        for f in self.inflight:
            for t in f.keep:
                add(t)
        self.live_bytes = sum(seen.values())
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def _account_with(self, prepared, rs_out) -> None:
        if self.track_memory:  # a reduction's cast copy and output are not referenced by a buffer yet
            self.inflight.append(_Inflight(None, None, [], None, None, [g for _, g in prepared] + list(rs_out.values())))
            self._account()
            self.inflight.pop()

    def finalize(self) -> None:
        """Precompute what the hooks look up: the units each one prefetches, forward and backward."""
        k = self.plan.prefetch
        fwd = self.units
        bwd = [v for v in reversed(self.units) if not v.is_root]
        self.forward_next = {u.name: fwd[j + 1:j + 1 + k] for j, u in enumerate(fwd)}
        self.backward_next = {u.name: bwd[j + 1:j + 1 + k] for j, u in enumerate(bwd)}
        self.backward_next[self.units[0].name] = []

    # -- swapping registered parameters ----------------------------------------------------------------
    def swap_in(self, u: UnitState) -> None:
        if u.swapped_in:
            return
        for m, attr, _, fp in u.slots:
            m._parameters[attr] = fp
        u.swapped_in = True

    def swap_out(self, u: UnitState) -> None:
        for m, attr, lp, _ in u.slots:
            m._parameters[attr] = lp
        u.swapped_in = False

    # -- gathering -------------------------------------------------------------------------------------
    def issue_gather(self, u: UnitState, phase: str) -> None:
        if u.gathered or u.pending is not None:
            return
        works, keep = [], []
        if u.sharded:
            with self._op(ALL_GATHER, u, phase):
                for b in u.buffers:
                    b.allocate()
                    if not b.sharded:
                        if not b.alias:
                            with torch.no_grad():
                                b.full.copy_(b.shard)
                        continue
                    group = self.groups[("gather", b.bp.axes)]
                    if group.pg is None:  # a group of one: the gather is the cast, one copy kernel
                        if not b.alias:
                            with torch.no_grad():
                                b.full.copy_(b.shard)
                        continue
                    send = b.shard if b.cdtype == b.dtype else b.shard.to(b.cdtype)
                    if b.alias and not self.streams.cuda:
                        send = send.clone()  # gloo: input must not alias the output
                    keep.append(send)
                    with self.streams.on("gather"):
                        works.append(self._call(C.all_gather, f"all_gather unit={u.name} phase={phase}",
                                                b.full, send, group, async_op=not self.streams.cuda))
            event = self.streams.event("gather")
        else:
            for b in u.buffers:
                b.allocate()
                if not b.alias:
                    with torch.no_grad():
                        b.full.copy_(b.shard)
            event = None
        u.pending = (works, event, keep, phase)
        self._account()
        if u.sharded:
            self.n_gathered += 1
            self.max_gathered = max(self.max_gathered, self.n_gathered)

    def wait_gather(self, u: UnitState) -> None:
        if u.pending is None:
            return
        works, event, keep, phase = u.pending
        for w in works:
            self._wait(w, f"all_gather unit={u.name} phase={phase}")
        self.streams.wait(event)
        for b in u.buffers:
            if b.out is not None:
                b.copy_out()
                b.release_gather_buffer()
        u.pending = None
        u.gathered = True
        self._account()

    def free(self, u: UnitState, phase: str) -> None:
        if not u.gathered and u.pending is None:
            return
        self.wait_gather(u)
        if any(not b.persistent for b in u.buffers):
            if u.sharded:
                with self._op(FREE, u, phase):
                    pass
            for b in u.buffers:
                b.free()
            u.gathered = False
            if u.sharded:
                self.n_gathered -= 1
        self.swap_out(u)

    # -- forward ---------------------------------------------------------------------------------------
    def pre_forward(self, u: UnitState) -> None:
        recomputing = torch._C._current_graph_task_id() != -1
        if self.level == 3 or not u.gathered:
            self.issue_gather(u, BACKWARD if recomputing else FORWARD)
            self.wait_gather(u)
        if self.level == 3 and not recomputing:
            for v in self.forward_next[u.name]:
                self.issue_gather(v, FORWARD)
        self.swap_in(u)

    def post_forward(self, u: UnitState, output, last: bool = True) -> None:
        recomputing = torch._C._current_graph_task_id() != -1
        if torch.is_grad_enabled():
            if not recomputing:
                self._register_pre_backward(u, output)
            if last and self.level == 3 and u.reshard_after_forward and not u.is_root and not recomputing:
                self.free(u, FORWARD)
        elif last and self.level == 3 and not u.is_root:
            self.free(u, FORWARD)

    def root_pre_forward(self, args, kwargs):
        if self.level in (0, 1, 2) and self.dirty:
            for u in self.units:
                self._refresh(u)
            self.dirty = False
        for u in self.units:
            u.pre_backward_done = False
            u.reduced = False
            u.got = 0
        return self._cast_inputs(args, kwargs)

    def _refresh(self, u: UnitState) -> None:
        """ZeRO-1/2 and no_shard: re-gather (or re-cast) full parameters after the optimizer stepped."""
        u.gathered, u.pending = False, None
        phase = STEP
        works, keep = [], []
        if u.sharded:
            with self._op(ALL_GATHER, u, phase):
                for b in u.sharded:
                    send = b.shard if b.cdtype == b.dtype else b.shard.to(b.cdtype)
                    if b.alias and not self.streams.cuda:
                        send = send.clone()
                    keep.append(send)
                    with self.streams.on("gather"):
                        works.append(self._call(C.all_gather, f"all_gather unit={u.name} phase=step", b.full, send,
                                                self.groups[("gather", b.bp.axes)], async_op=not self.streams.cuda))
        for b in u.buffers:
            if not b.sharded and not b.alias:
                with torch.no_grad():
                    b.full.copy_(b.shard)
        u.pending = (works, self.streams.event("gather"), keep, phase)
        self.wait_gather(u)

    def _cast_inputs(self, args, kwargs):
        dt = self.plan.compute_dtype
        if dt is None:
            return args, kwargs
        from ..dtypes import to_torch
        target = to_torch(dt)

        def cast(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != target:
                return x.to(target)
            if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
                return type(x)(cast(y) for y in x)
            if isinstance(x, dict) and type(x) is dict:
                return {k: cast(v) for k, v in x.items()}
            return x

        return cast(args), cast(kwargs)

    def root_post_forward(self, output) -> None:
        root = self.units[0]
        self.post_forward(root, output)
        if not torch.is_grad_enabled():
            for u in self.units:
                if self.level == 3:
                    self.free(u, FORWARD)
                else:
                    self.swap_out(u)

    # -- backward --------------------------------------------------------------------------------------
    def _register_pre_backward(self, u: UnitState, output) -> None:
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(lambda g, _u=u: self._pre_backward_hook(_u, g))

    def _start_backward(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def _pre_backward_hook(self, u: UnitState, grad):
        if not u.pre_backward_done:
            self.pre_backward(u)
        return grad

    def pre_backward(self, u: UnitState) -> None:
        u.pre_backward_done = True
        self._start_backward()
        if self.level == 3 and not u.is_root:
            self.issue_gather(u, BACKWARD)
            self.wait_gather(u)
            for v in self.backward_next[u.name]:
                self.issue_gather(v, BACKWARD)
        self.swap_in(u)
        for b in u.with_grads:
            b.prepare_grads()
        self._account()

    def on_grad(self, u: UnitState) -> None:
        self._start_backward()
        u.got += 1
        if u.got == u.expected:
            self.post_backward(u)

    def post_backward(self, u: UnitState) -> None:
        if u.reduced:
            return
        u.reduced = True
        if self.sync:
            self.reduce(u)
        if self.level == 3 and not u.is_root:
            self.free(u, BACKWARD)

    def reduce(self, u: UnitState) -> None:
        bufs = u.with_grads
        if not bufs:
            return
        shard_axes = [b for b in bufs if b.sharded]
        while len(self.inflight) >= self.max_inflight:
            self._finish(self.inflight.popleft())
        prepared = [(b, b.collect_grads()) for b in bufs]
        rs_out: dict[int, torch.Tensor] = {}
        works: dict[int, list] = {id(b): [] for b in bufs}
        if shard_axes:
            with self._op(REDUCE_SCATTER, u, BACKWARD):
                for b, g in prepared:
                    if b.sharded:
                        group = self.groups[("reduce", b.bp.axes)]
                        if group.pg is None:  # a group of one: the (cast) gradient is the result
                            rs_out[id(b)] = g
                            continue
                        out = torch.empty(b.S, dtype=b.rdtype, device=self.device)
                        rs_out[id(b)] = out
                        with self.streams.on("reduce"):
                            works[id(b)].append(self._call(C.reduce_scatter, f"reduce_scatter unit={u.name} phase=backward",
                                                           out, g, self.groups[("reduce", b.bp.axes)],
                                                           async_op=not self.streams.cuda))
        if any(self.groups[("reduce", b.bp.replica_axes)].size > 1 for b in bufs if b.bp.replica_axes):
            with self._op(ALL_REDUCE, u, BACKWARD):
                for b, g in prepared:
                    if not b.bp.replica_axes:
                        continue
                    group = self.groups[("reduce", b.bp.replica_axes)]
                    target = rs_out.get(id(b), g)
                    if not self.streams.cuda:
                        for w in works[id(b)]:
                            self._wait(w, f"reduce_scatter unit={u.name} phase=backward")
                        works[id(b)] = []
                    with self.streams.on("reduce"):
                        works[id(b)].append(self._call(C.all_reduce, f"all_reduce unit={u.name} phase=backward",
                                                       target, group, async_op=not self.streams.cuda))
        event = self.streams.event("reduce")
        self._account_with(prepared, rs_out)
        for b, g in prepared:
            result = rs_out.get(id(b), g)
            keep = [g, b.grad_full, result]
            self.inflight.append(_Inflight(u, b, works[id(b)], event, result, keep))
        if self.level >= 2 and shard_axes:
            with self._op(FREE, u, BACKWARD):
                pass
        for b in bufs:
            if self.level >= 2 and b.sharded:
                b.drop_full_grads()
            else:
                b.needs_zero = True
        self._account()

    def _finish(self, f: _Inflight) -> None:
        for w in f.works:
            self._wait(w, f"reduce unit={f.unit.name} phase=backward")
        self.streams.wait(f.event)
        b = f.buffer
        if f.result is b.grad_full and b.grad_full is not None:
            b.grad_lent = True  # the local .grads are views of the flat gradient: don't zero it under them
        b.assign_local_grads(f.result)
        f.keep.clear()

    def end_backward(self) -> None:
        try:
            for u in [v for v in reversed(self.units) if not v.is_root] + [self.units[0]]:
                if not u.reduced:  # got no (or not all) gradients: reduce anyway so every rank issues the same ops
                    self.post_backward(u)
            while self.inflight:
                self._finish(self.inflight.popleft())
            if self.level == 3:
                self.free(self.units[0], BACKWARD)
            for u in self.units:
                if self.level == 3:
                    self.free(u, BACKWARD)
                self.swap_out(u)
            if self.sync:
                self.dirty = True
        finally:
            self.in_backward = False
            self.callback_queued = False
            for u in self.units:
                u.pre_backward_done = False
                u.got = 0
            self._account()


def build_groups(plan: Plan, rank: int, backend: str) -> dict:
    """One process group per (purpose, axes); every rank creates every group in the same order."""
    mesh = plan.mesh
    wanted: list[tuple[str, tuple[str, ...]]] = []
    for b in plan.buffers:
        for key in (("gather", b.axes), ("reduce", b.axes), ("reduce", b.replica_axes)):
            if key[1] and key not in wanted:
                wanted.append(key)
    wanted.append(("world", tuple(mesh.axis_names)))
    # SHARDPLAN_SINGLETON_GROUPS=1 makes real process groups of one rank too, so a single GPU runs the
    # same NCCL path as many (tests and traces); otherwise a group of one is a local copy.
    force = os.environ.get("SHARDPLAN_SINGLETON_GROUPS") == "1"
    groups: dict = {}
    for key in wanted:
        axes = key[1]
        size = mesh.axis_size(axes)
        mine = None
        for ranks in mesh.groups(axes):
            pg = dist.new_group(list(ranks), backend=backend) if size > 1 or force else None
            if rank in ranks:
                mine = C.Group(pg, size, ranks.index(rank))
        groups[key] = mine
    groups[("reduce", ())] = C.Group(None, 1, 0)
    groups[("gather", ())] = C.Group(None, 1, 0)
    return groups
