"""Tensor-parallel execution of a plan's compute axes, with ``torch.distributed.tensor``.

The plan decides everything (:mod:`shardplan.planner.tensor_parallel`): which modules run which style
over which axis. Here each such module's full parameters become DTensors over the executor's own
gathered storage (so FSDP gathers, frees and gradient reductions are untouched and gradients still
accumulate straight into the flat buffers), and each module gets two thin hooks that give its input
and output the placements of its style. Every activation collective runs as the plan's op through the
executor's handler (``run_in_module``): a forward one is DTensor's redistribution of the output; a backward
one (an input's gradient: the all-reduce of a column-parallel module's partial sums, the all-gather of a split
input) is shardplan's own, through collectives.py, in the backward of the function that made the input a
DTensor (:class:`_StyleInput`); DTensor's autograd moves nothing in backward.
"""

from __future__ import annotations

import os
import weakref
from typing import Callable

import torch
import torch.nn as nn

from ..planner.tensor_parallel import EMBEDDING, TPModule, of as tp_of, reads_shared_input
from ..errors import PlanWarning
from ..planner.ops import Op
from ..errors import RuntimeShardingError
from . import collectives as C
from .axis_ops import BACKWARD, AxisOps


def _dt():
    from torch.distributed.tensor import DTensor, Replicate, Shard
    return DTensor, Replicate, Shard


def active_modules(plan) -> list[TPModule]:
    """The tensor-parallel modules that need DTensor: a compute axis of one rank shards nothing, so its
    modules run as plain modules, as a shard group of one is a local copy (DTensor's dispatch costs ~1 ms
    per module and step on a 1B model: docs/performance.md). ``SHARDPLAN_SINGLETON_GROUPS=1`` runs them
    through DTensor anyway, so one GPU exercises the path many take."""
    force = os.environ.get("SHARDPLAN_SINGLETON_GROUPS") == "1"
    return [m for m in tp_of(plan).modules if force or plan.mesh.axis_size(m.axis) > 1]


def full_device_mesh(plan, device: torch.device):
    """One ``DeviceMesh`` over the plan's whole mesh, dimensions named like its axes (every rank builds
    it: it creates process groups; a rehearsal's names are tagged: ``collectives.mesh_dim_names``)."""
    from torch.distributed.device_mesh import DeviceMesh
    shape = [s for _, s in plan.mesh.axes]
    return DeviceMesh(device.type, torch.arange(plan.mesh.size).view(shape),
                      mesh_dim_names=C.mesh_dim_names(plan.mesh.axis_names))


def device_meshes(plan, device: torch.device) -> dict:
    """:func:`full_device_mesh` sliced per compute axis (keyed by the plan's axis names)."""
    full = full_device_mesh(plan, device)
    names = dict(zip(plan.mesh.axis_names, full.mesh_dim_names))
    return {a: full[names[a]] for a in tp_of(plan).axes}


def param_wrappers(plan, meshes: dict) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """For every parameter a tensor-parallel module owns: how its tensor-parallel-local tensor becomes the
    DTensor the module computes with (``Shard(dim)`` over its compute axis, or ``Replicate()``)."""
    DTensor, Replicate, Shard = _dt()
    owned: dict[str, str] = {}
    for m in active_modules(plan):
        prefix = f"{m.path}." if m.path else ""
        for p in plan.params:
            for name in (p.name,) + p.aliases:
                if name.startswith(prefix) and "." not in name[len(prefix):]:
                    owned[p.name] = m.axis
    out = {}
    for name, axis in owned.items():
        p = plan.param(name)
        placement = Shard(p.tp_dim) if p.tp_axis else Replicate()
        mesh = meshes[axis]
        out[name] = lambda t, _m=mesh, _pl=placement: DTensor.from_local(t, _m, [_pl], run_check=False)
    return out


class _SharedInputs:
    """Replicated inputs already wrapped for a column-parallel module in this forward: the siblings the
    plan says read one input (``TPModule.shares_with``: wq, wk, wv; w1, w3) get the same DTensor when
    they do read the same tensor, so autograd sums their partial input gradients and :class:`_StyleInput`
    all-reduces the sum once (the plan's one ``module_backward`` op) instead of once per module.

    [Note: the cache holds the DTensor strongly (nothing else keeps the wrapper alive between two
    sibling calls), so it must let go: an entry is dropped when the last sibling the plan lists after
    its wrapper has read it; a group keeps at most one entry (a new wrap replaces the old one, as when a
    sibling reads another input than planned); and entries of another graph task (the forward's, once a
    checkpoint recompute in backward wraps afresh) are dropped at the next wrap. At most one entry per
    group outlives its readers, until the root's next forward clears all.]"""

    def __init__(self):
        self.entries: dict = {}   # group -> (key, x weakref, DTensor, x version, readers left)

    def clear(self, *_):
        self.entries.clear()

    def get(self, group: str, x: torch.Tensor, mesh, make, after: int):
        """(the DTensor for ``x``, whether it was wrapped here); ``after``: the group's readers the plan
        lists after this module."""
        task = torch._C._current_graph_task_id()
        key = (id(x), id(mesh), task)
        hit = self.entries.get(group)
        if hit is not None and hit[0] == key and hit[1]() is x and hit[3] == x._version:
            hit[4] -= 1
            if hit[4] <= 0:
                del self.entries[group]
            return hit[2], False
        if self.entries and any(e[0][2] != task for e in self.entries.values()):
            self.entries = {g: e for g, e in self.entries.items() if e[0][2] == task}
        dt = make()
        if after > 0:
            self.entries[group] = [key, weakref.ref(x), dt, x._version, after]
        else:
            self.entries.pop(group, None)
        return dt, True


class _Ops:
    """The plan's activation ops of each module (:class:`AxisOps` by (path, phase)), and the executor that runs
    them (``exe``: ``None`` when no executor records them)."""

    def __init__(self, plan, exe):
        self.exe = exe
        self.axis = AxisOps.of(plan, exe, lambda o: True, per_key=1)
        self.warned: set = set()

    def expect(self, op):
        """The executor that will run ``op`` (a ``module_backward`` op) in this backward, told to wait for it
        before the unit's post_backward step (``expect_activation``); ``None`` where it runs no such op."""
        exe = self.exe
        if op is None or exe is None or op.unit not in exe.units:
            return None
        exe.expect_activation(op.unit)
        return weakref.ref(exe)  # weak: the autograd graph lives in C++, out of the collector's sight


def _group_of(mesh) -> C.Group:
    """The process group of a one-dimensional ``DeviceMesh`` (a compute axis), as collectives.py takes it: the
    group DTensor's forward redistributions run on, so both directions keep one order on one communicator."""
    return C.Group(mesh.get_group(), mesh.size(), mesh.get_local_rank())


def _to_placement(g, target, group: C.Group) -> torch.Tensor:
    """A DTensor gradient over one compute axis as the local tensor of placement ``target`` (``Replicate()`` or
    ``Shard(d)``: how the module's input arrived), through collectives.py: partial sums all-reduced, a split
    all-gathered along its dimension; nothing where it has that placement already."""
    DTensor, Replicate, Shard = _dt()
    if not isinstance(g, DTensor):  # (a plain gradient: already the input's own)
        return g
    local = g.to_local()
    (pl,) = g.placements
    if isinstance(target, Shard) and target.dim < 0:  # (DTensor keeps a shard's dimension non-negative)
        target = Shard(target.dim % local.ndim)
    if pl == target:
        return local
    if pl.is_partial():
        out = local.clone(memory_format=torch.contiguous_format)  # a fresh tensor: the collective writes it
        op = getattr(pl, "reduce_op", "sum")
        if op not in ("sum", "avg"):
            raise RuntimeShardingError(f"a tensor-parallel module's input gradient arrived as Partial({op!r}) over "
                                       f"its compute axis: only sums and averages of partial gradients are reduced; "
                                       f"keep such a reduction out of tensor-parallel modules")
        (C.all_reduce_sum if op == "sum" else C.all_reduce)(out, group, async_op=False)
        local = out
    elif isinstance(pl, Shard):
        d = pl.dim % local.ndim
        part = local.contiguous()
        rows = part.new_empty((group.size * part.shape[0],) + tuple(part.shape[1:]))
        C.all_gather_rows(rows, part, group)
        local = rows.view((group.size,) + tuple(part.shape)).movedim(0, d).flatten(d, d + 1)
    if isinstance(target, Shard):  # replicated now: this rank's block (a split costs nothing)
        d = target.dim
        w = local.shape[d] // group.size
        local = local.narrow(d, group.rank * w, w).contiguous()
    return local


class _StyleInput(torch.autograd.Function):
    """A tensor-parallel module's input (a plain tensor) as the DTensor its style computes with: replicated, sharded
    (a row-parallel layer's input arrives as this rank's block), or split here (``rowwise_split``: this rank's slice
    of a replicated input, no communication). Backward: the DTensor gradient back to the plain gradient of the input
    as it arrived (:func:`_to_placement`), the collective
    (the all-reduce of a column-parallel module's partial input gradients, the all-gather of a split's) issued by
    shardplan through collectives.py and run as the plan's ``module_backward`` op by the executor's handler
    (``run_in_module``), not by DTensor's autograd: what backward runs is the plan's op by construction.

    [Note: the forward makes the DTensor with autograd off (inside this function), so ``from_local`` and the split
    record no backward of their own: this node is the only one between the DTensor and the plain input, and its
    backward is the only place the input's gradient is reduced. ``exe``: a weak reference to the executor told to
    expect ``op`` (``None``: an untracked call, e.g. a recompute whose graph backward never runs, or no recording:
    the collective runs as is)]"""

    @staticmethod
    def forward(ctx, x, mesh, arrives, split, group, op, exe):
        DTensor, Replicate, Shard = _dt()
        ctx.group, ctx.op, ctx.exe = group, op, exe
        ctx.target = Replicate() if split else arrives[0]  # the gradient leaves as the input arrived
        ctx.set_materialize_grads(False)
        if split:  # a replicated input to a row-parallel layer: each rank keeps its slice
            w = x.shape[-1] // group.size
            mine = x.detach().narrow(-1, group.rank * w, w).contiguous()
            return DTensor.from_local(mine, mesh, [Shard(-1)], run_check=False)
        return DTensor.from_local(x.detach(), mesh, arrives, run_check=False)

    @staticmethod
    @torch.autograd.function.once_differentiable  # (the collective is not differentiable: a double backward raises)
    def backward(ctx, g):
        if g is None:
            return (None,) * 7
        e = ctx.exe() if ctx.exe is not None else None
        if e is None:
            return (_to_placement(g, ctx.target, ctx.group),) + (None,) * 6
        out = e.run_in_module(ctx.op, lambda: _to_placement(g, ctx.target, ctx.group))
        e.on_activation(ctx.op.unit)
        return (out,) + (None,) * 6


def install_styles(module: nn.Module, plan, meshes: dict, exe=None) -> list:
    """Register each tensor-parallel module's input and output hooks; returns their handles. ``exe``: the
    executor whose recording (``record_ops``) the modules' activation ops join."""
    shared = _SharedInputs()
    ops = _Ops(plan, exe)
    handles = [module.register_forward_pre_hook(shared.clear)]
    mods = dict(module.named_modules())
    if any(not m.after for m in tp_of(plan).modules):
        import warnings
        warnings.warn("this plan's tensor-parallel modules carry no placement (a plan saved by an older shardplan): "
                      "its schedule lists none of their collectives and column-parallel siblings each all-reduce "
                      "their input's gradient. Plan again from the model to get both", PlanWarning, stacklevel=3)
    members: dict[str, list[str]] = {}  # a shared input's readers, in plan order
    for m in tp_of(plan).modules:
        members.setdefault(m.shares_with or m.path, []).append(m.path)
    for m in active_modules(plan):  # the plan's placed modules
        mod = mods[m.path]
        group = members[m.shares_with or m.path]
        handles.append(mod.register_forward_pre_hook(
            _input_hook(m, meshes[m.axis], shared, ops, len(group) - 1 - group.index(m.path))))
        handles.append(mod.register_forward_hook(_output_hook(m, meshes[m.axis], ops)))
    return handles


def _input_hook(m: TPModule, mesh, shared: _SharedInputs, ops: _Ops, after: int):
    DTensor, Replicate, Shard = _dt()
    arrives = [Shard(-1)] if m.input_sharded else [Replicate()]
    split = m.style == "rowwise_split" and m.kind != EMBEDDING
    shares = reads_shared_input(m)
    group = m.shares_with or m.path
    bop = ops.axis.op(m.path, BACKWARD)
    tp_group = _group_of(mesh)

    @torch._dynamo.disable
    def hook(_mod, args):
        w = _mod._parameters.get("weight")
        if w is not None and not isinstance(w, DTensor):
            _not_gathered(m, w)
        if not args or not isinstance(args[0], torch.Tensor) or isinstance(args[0], DTensor):
            return None
        x0 = args[0]
        tracked = x0.requires_grad and torch.is_grad_enabled() and ops.exe is not None and \
            torch._C._current_graph_task_id() == -1  # a recompute's graph is not the one backward runs

        def make():
            op = bop if not m.shares_with else _unshared(m, ops)  # a sibling wrapping itself: another input
            exe = ops.expect(op) if tracked else None
            return _StyleInput.apply(x0, mesh, arrives, split, tp_group, op if exe is not None else None, exe)

        x = shared.get(group, x0, mesh, make, after)[0] if shares else make()
        return (x,) + tuple(args[1:])

    return hook


def _unshared(m: TPModule, ops: _Ops):
    """A sibling that reads another input than ``m.shares_with`` (the plan assumed they share one): its
    input gradient is all-reduced on its own, an op the plan does not list. Correct, but say so once."""
    if m.path not in ops.warned:
        ops.warned.add(m.path)
        import warnings
        warnings.warn(f"tensor-parallel module {m.path!r} reads another input than its sibling {m.shares_with!r}, "
                      f"which the plan assumed they share: its input gradient takes an all-reduce of its own, which "
                      f"plan.ops() does not list. Plan with trace=example inputs to know each module's input",
                      PlanWarning, stacklevel=2)
    return Op(kind="all_reduce", unit=m.unit, what="activations", event="module_backward", at=m.path, axes=(m.axis,))


def _not_gathered(m: TPModule, w: torch.Tensor):
    unit = m.unit or "<root>"
    raise RuntimeShardingError(
        f"tensor-parallel module {m.path!r} ({m.kind} {m.style} over {m.axis!r}) was called while it holds its local "
        f"shard (shape {tuple(w.shape)}), not the gathered DTensor its style computes with: it ran outside the forward "
        f"of its unit {unit!r} (the model calls it directly, from outside that unit module's own forward, or after "
        f"the unit was freed). Fix: call it from the forward of {unit!r}, or choose units whose modules the model "
        f"calls (units=[...] naming {m.path!r} or a module whose forward calls it; a container without any forward "
        f"is entered through its submodules), or leave it in the root unit")


def _output_hook(m: TPModule, mesh, ops: _Ops):
    DTensor, Replicate, Shard = _dt()
    leaves = [Shard(-1)] if m.output_sharded else [Replicate()]

    @torch._dynamo.disable
    def hook(_mod, _args, out):
        if not isinstance(out, DTensor):
            return None

        def style_output(out=out):
            if tuple(out.placements) != tuple(leaves):
                out = out.redistribute(mesh, leaves)  # all-reduce of partial sums, or all-gather
            return out
        # [Note: run through the executor whether the collective runs here or ran inside the forward: a module that
        # computes on its output (Gemma3's scaled embedding multiplies the partial sums by a plain tensor) makes
        # DTensor reduce them there, once, and hands the hook a replicated output; the style's op ran all the same.
        # The forward collective is DTensor's redistribute (a vocabulary-parallel embedding's partial sums carry
        # DTensor's mask of the ids outside this rank's rows, applied at that reduction); its backward moves
        # nothing (a replicated gradient of partial sums stays replicated, a gathered one is split locally)]
        out = ops.axis.run(m.path, AxisOps.phase(), 0, style_output)
        return out.to_local()

    return hook
