"""Faces: how one executor meets the code it serves. The executor decides *when* (the plan's ops);
a face decides *where*: how a unit's gathered parameters reach the compute (``bind``/``unbind``) and
where its reduced gradient goes (``deliver``).

* :class:`ModuleFace` (``shard``): the modules hold local-shard ``nn.Parameter``\\ s between steps and
  the full parameters while a unit computes; reduced gradients become the local shards' ``.grad``.
* :class:`TreeFace` (``functional_call``): the caller's local pytree goes in, an autograd function per
  unit produces the full parameters from it (its backward is the unit's gradient), and reduced
  gradients come back as tensors shaped like the local shards.
"""

from __future__ import annotations

import time
import weakref
from typing import Optional, Protocol, runtime_checkable

import torch
import torch.nn as nn

from ..errors import RuntimeShardingError
from .buffers import BufferState
from .storage import alias
from .unit import UnitRuntime


@runtime_checkable
class Face(Protocol):
    """What the executor asks of the code it serves (the faces below implement it)."""

    stale_after_sync: bool  # an optimizer steps the shards in place after a synchronising backward

    def bind(self, u: UnitRuntime) -> None: ...                  # full parameters reach the compute
    def unbind(self, u: UnitRuntime) -> None: ...                # the local shards are back
    def gather_input(self, b: BufferState, collective: bool,                         # what the all-gather sends
                     out: Optional[torch.Tensor] = None) -> torch.Tensor: ...       # (into ``out`` if it moves nothing)
    def reduce_output(self, b: BufferState) -> torch.Tensor: ...                    # where a reduce-scatter writes
    def local_reduce_output(self, b: BufferState) -> Optional[torch.Tensor]: ...    # ... one that moves nothing
    def land(self, b: BufferState, window: int) -> None: ...     # the unit's gradients into its flat gradient
    def deliver(self, b: BufferState, result: torch.Tensor) -> None: ...            # the reduced local gradient
    def unused(self, indices: list[int]) -> None: ...            # parameters no rank used this window
    def window_ended(self) -> None: ...
    def backward_begins(self) -> None: ...                       # the first event of a backward pass
    def shard_version(self) -> int: ...                          # changes when the shards were written
    def local_params(self) -> dict: ...                          # plan name -> this rank's shard


class ModuleFace:
    stale_after_sync = True  # the optimizer steps the registered shards in place after a synced backward
    owns_locals = True       # the local parameters are views of the shards: checked before each forward

    def __init__(self, slots: dict[str, list]):
        self.slots = slots  # unit name -> [(module, attribute, local param, full param)]
        self.by_index: dict[int, nn.Parameter] = {}
        self.by_name: dict[str, nn.Parameter] = {}
        self.created: set[int] = set()  # parameters whose local .grad this window created

    def attach(self, units: list[UnitRuntime], plan) -> None:
        self.by_index = {i: lp for u in units for b in u.buffers for i, lp in b.local_grad_by_index().items()}
        self.by_name = {p.name: self.by_index[i] for i, p in enumerate(plan.params)}

    def bind(self, u: UnitRuntime) -> None:
        for m, attr, _, fp in self.slots[u.name]:
            m._parameters[attr] = fp

    def unbind(self, u: UnitRuntime) -> None:
        for m, attr, lp, _ in self.slots[u.name]:
            m._parameters[attr] = lp

    def gather_input(self, b: BufferState, collective: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return b.gather_input(collective, out)

    def reduce_output(self, b: BufferState) -> torch.Tensor:
        return torch.empty(b.S, dtype=b.rdtype, device=b.device)

    def local_reduce_output(self, b: BufferState) -> Optional[torch.Tensor]:
        return None  # the local gradients become views of the (cast) unsharded gradient

    def land(self, b: BufferState, window: int) -> None:
        b.collect_grads(window)  # autograd formed them on the full parameters

    def deliver(self, b: BufferState, result: torch.Tensor) -> None:
        self.created.update(b.assign_local_grads(result))

    def unused(self, indices: list[int]) -> None:
        for i in indices:  # no rank used it: plain PyTorch leaves its gradient None
            if i in self.created:
                self.by_index[i].grad = None

    def window_ended(self) -> None:
        self.created.clear()

    def backward_begins(self) -> None:
        return None  # the module hooks bind a recomputed unit's parameters (they stay registered)

    def shard_version(self) -> int:
        return sum(lp._version for lp in self.by_index.values())

    def local_params(self) -> dict:
        return dict(self.by_name)


class _UnitGather(torch.autograd.Function):
    """Full parameters of one unit as a function of its local shards: the forward returns tensors over
    the unit's gathered storage (own version counters: the re-gather in backward must not look like an
    in-place change); the backward hands the full gradients to the executor, which reduces them, and
    returns the local-shard gradients the reduction will have filled before backward returns."""

    @staticmethod
    def forward(ctx, face, unit, *locals_):
        ctx.face, ctx.unit = face, unit
        return tuple(face.full_tensors(unit))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + tuple(ctx.face.unit_backward(ctx.unit, grads))


class TreeFace:
    """The functional face: see :func:`shardplan.functional_call`."""

    stale_after_sync = False  # new shards arrive as a new tree: load() sees them

    def __init__(self, plan, exe_ref, wrappers: Optional[dict] = None):
        quantized = [b.unit for b in plan.buffers if b.gather_dtype]
        if any(b.tensorwise for b in plan.buffers):
            raise RuntimeShardingError(f"shardplan: the plan gathers the float8 Linears' weights of unit {quantized[0]!r} "
                                       f"as float8 (fp8='torchao'), which the functional face does not support yet; "
                                       f"plan with fp8_gather=False for functional_call (and sp.fp8.convert the "
                                       f"module), or train the module with sp.shard")
        if quantized:
            raise RuntimeShardingError(f"shardplan: the plan quantizes the gathers of unit {quantized[0]!r} "
                                       f"(gather_dtype), which the functional face does not support yet; plan with "
                                       f"gather_dtype=None for functional_call, or train the module with sp.shard")
        self.plan = plan
        self.wrappers = wrappers or {}  # tensor parallelism: name -> full tensor to the DTensor its module uses
        self.exe = exe_ref  # a weak reference: the executor owns the face
        self.leaves: dict[str, torch.Tensor] = {}       # plan name -> the caller's local leaf, this call
        self.slots: dict[str, list] = {}                 # unit -> per parameter, [(module, attribute)] it is bound to
        self.grads: dict[str, torch.Tensor] = {}         # plan name -> reduced local gradient, this backward
        self.dst: dict[int, torch.Tensor] = {}           # buffer -> flat local gradient (param dtype)
        self.versions: dict[str, tuple] = {}
        self.srcs: dict[int, list] = {}    # buffer -> its held leaves, flat, this call (what its gathers send)
        self.dsts: dict[int, list] = {}    # buffer -> slices of its gathered buffer the leaves are copied into
        self.fulls: dict[str, list] = {}   # unit -> its parameters' aliases over the gathered storage (made once)
        self.autograd_grads = True         # this call's local gradients go to autograd too (see load())
        self.originals: list = []          # (module, attribute, the module's own parameter), put back after a call
        self.bound_in_backward = False     # the module holds the call's full parameters for a backward (see below)

    # -- loading the caller's tree ---------------------------------------------------------------------
    def load(self, leaves: dict[str, torch.Tensor], sources: Optional[dict] = None) -> bool:
        """Take this call's local leaves. Returns whether any changed (the executor then re-gathers, as
        after an optimizer step). ``sources``: the caller's own tensors behind ``leaves`` (value_and_grad
        passes detached copies): a leaf is unchanged when its source is the very tensor of the last
        call, at the same version. The all-gather sends straight from the leaves; only buffers whose
        shard is part of the full parameters (ZeRO-1/2 without a cast) take a copy."""
        exe = self.exe()
        # [Note: who reads the local gradients] value_and_grad (it passes ``sources``) reads the reduced
        # gradients from ``self.grads``; a plain functional_call hands them to autograd, as the leaves' gradients
        self.autograd_grads = sources is None
        sources = sources or leaves
        changed = False
        dsts, srcs = [], []
        for u in exe.unit_list:
            for b in u.buffers:
                for m in b.members:
                    src = sources[m.name]
                    seen = self.versions.get(m.name)
                    if seen is not None and seen[0]() is src and seen[1] == src._version:
                        continue
                    self.versions[m.name] = (weakref.ref(src), src._version)
                    changed = True
                    if b.bp.alias and m.held:
                        dsts.append(b.shard[m.shard])
                        srcs.append(leaves[m.name].detach().reshape(-1))
        if dsts:
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)
        self.leaves = leaves
        self.srcs = {}
        return changed

    def gather_input(self, b: BufferState, collective: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if b.bp.alias:
            return b.gather_input(collective, out)
        srcs = self.srcs.get(b.bp.index)
        if srcs is None:  # once per call: a ZeRO-3 unit gathers in forward and again in backward
            with torch.no_grad():  # flat views of the leaves, no autograd record (one op per leaf, not two)
                srcs = self.srcs[b.bp.index] = [self.leaves[m.name].reshape(-1) for m in b.members if m.held]
        if not collective and out is not None:  # a gather that moves nothing: straight into the output
            send = out
            dsts = self.dsts.get(b.bp.index)  # the gathered buffer is one tensor for the runtime's life
            if dsts is None or dsts[0] is not out:
                dsts = self.dsts[b.bp.index] = (out, [out[m.shard] for m in b.members if m.held])
            dsts = dsts[1]
        else:
            send = torch.empty(b.S, dtype=b.cdtype, device=b.device)  # gaps between pieces are never read
            dsts = [send[m.shard] for m in b.members if m.held]
        if dsts:
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)  # the cast to the compute dtype happens in the same pass
        return send

    def _check_no_accumulation(self, u: UnitRuntime) -> None:
        """[Note: local gradients are filled after autograd takes them] The views this backward hands autograd
        are written by the reduction later; autograd adding one into a leaf's existing ``.grad`` would add it
        before that (zeros): a second micro-batch's gradient lost without a word. Raise instead."""
        for b in u.buffers:
            for m in b.members:
                leaf = self.leaves.get(m.name)
                if leaf is not None and leaf.requires_grad and leaf.grad is not None:
                    raise RuntimeShardingError(
                        f"shardplan: the local leaf {m.name!r} already holds a .grad: functional_call's local "
                        f"gradients are filled by the reduction after autograd takes them, so accumulating them into "
                        f".grad over several backward passes would lose every pass but the first. Use "
                        f"torch.autograd.grad(loss, leaves) or shardplan.value_and_grad and add the gradients "
                        f"yourself, or set the leaves' .grad to None before each backward")

    def reduce_output(self, b: BufferState) -> torch.Tensor:
        """The reduce-scatter writes straight into the local gradients the backward handed to autograd."""
        return self._dst(b) if b.rdtype == b.dtype else torch.empty(b.S, dtype=b.rdtype, device=b.device)

    def local_reduce_output(self, b: BufferState) -> Optional[torch.Tensor]:
        return self._dst(b) if b.rdtype == b.dtype else None

    # -- the executor's side --------------------------------------------------------------------------
    def bind(self, u: UnitRuntime) -> None:
        if torch._C._current_graph_task_id() != -1 or u.name not in self.slots:
            return  # in backward the storage is re-gathered under tensors autograd already holds
        names = [m.name for b in u.buffers for m in b.members]
        needs = [self.leaves[n] for n in names if self.leaves[n].requires_grad]
        if needs and torch.is_grad_enabled():
            fulls = _UnitGather.apply(self, u, *needs)
        else:
            fulls = self.full_tensors(u)
        self._place(u, names, fulls)

    def _place(self, u: UnitRuntime, names: list[str], fulls) -> None:
        """Put each full tensor of ``u`` (tensor parallelism: its DTensor) where the modules read it."""
        for name, places, t in zip(names, self.slots[u.name], fulls):
            wrap = self.wrappers.get(name)
            t = wrap(t) if wrap is not None else t  # differentiable: the gradient reaches the unit's backward
            for m, attr in places:
                m._parameters[attr] = t

    def unbind(self, u: UnitRuntime) -> None:
        return None  # the call restores the module's own parameters when it returns

    def backward_begins(self) -> None:
        """[Note: recompute in backward] Activation checkpointing (``torch.utils.checkpoint``, non-reentrant)
        runs a region's forward again inside backward and reads the parameters from the module. The call put
        the module's own parameters back when it returned, so the recompute used those: the module's initial
        weights, a wrong gradient without a word from the second step on. For the backward, the module holds
        the call's full parameters again (handles on the gathered storage, which the executor re-gathers
        before a unit's backward under ZeRO-3) and gets its own back when the backward ends. (Tensor-parallel
        modules' styles are installed for the call only, so a recomputed one still fails, loudly, in torch.)"""
        exe = self.exe()
        if self.bound_in_backward or exe is None or not self.leaves or not self.originals:
            return
        self.bound_in_backward = True
        for u in exe.unit_list:
            if u.name not in self.slots:
                continue
            names = [m.name for b in u.buffers for m in b.members]
            fulls = self.full_tensors(u)
            for name, t in zip(names, fulls):
                # requires_grad as in the forward: the recompute must save the tensors the forward saved
                t.requires_grad_(self.leaves[name].requires_grad)
            self._place(u, names, fulls)
        me = weakref.ref(self)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: me() and me().restore())

    def restore(self) -> None:
        """The module's own parameters back in place (after a call, and after a backward)."""
        for m, attr, p in self.originals:
            m._parameters[attr] = p
        self.bound_in_backward = False

    def full_tensors(self, u: UnitRuntime) -> list[torch.Tensor]:
        """Tensors over the unit's gathered storage, each with a version counter of its own: the re-gather in
        backward must not look like an in-place change, and neither may a module's in-place write to one
        parameter (``nn.Embedding(max_norm=...)``) to its neighbours' saved tensors."""
        made = self.fulls.get(u.name)
        if made is None:  # [Note: aliases made once] creating one is ~6 µs on CPU and several times that on CUDA,
            # per parameter and call; the gathered storage is one tensor for the runtime's life (resized, never
            # replaced), so each parameter's alias is made once and each call gets a detached handle on it: the
            # same storage and the alias's own version counter, which no re-gather into ``b.full`` touches
            made = self.fulls[u.name] = [alias(b.full, m.piece.full_offset, m.fshape) for b in u.buffers
                                         for m in b.members]
        return [t.detach() for t in made]

    def unit_backward(self, u: UnitRuntime, grads) -> list[Optional[torch.Tensor]]:
        """The unit's full gradients arrived (complete: autograd summed every use): land them in the
        unsharded gradient, complete the unit, and return views of the local gradients to be."""
        exe = self.exe()
        t = time.perf_counter()
        exe.begin_backward()
        exe.check_not_reduced(u, [m.name for b in u.buffers for m in b.members])
        if self.autograd_grads:
            self._check_no_accumulation(u)
        grads = iter(grads)  # one per full tensor, in buffer order (frozen parameters too)
        out = []
        for b in u.buffers:
            dst = self._dst(b) if b.requires_grad else None
            arrived = []
            for i, m in enumerate(b.members):
                g = next(grads)
                if g is not None and b.requires_grad:
                    arrived.append((i, g))
                    exe.used[m.index] = 1
                if self.leaves[m.name].requires_grad:  # (value_and_grad reads ``self.grads``: no views for it)
                    out.append(dst.as_strided(m.lshape, m.lstride, m.shard.start)
                               if dst is not None and self.autograd_grads else None)
            if arrived:
                b.land_grads(exe.window, arrived)
        exe.complete(u.name)
        exe.backward_seconds += time.perf_counter() - t
        return out

    def _dst(self, b: BufferState) -> torch.Tensor:
        dst = self.dst.get(b.bp.index)
        if dst is None:
            dst = self.dst[b.bp.index] = torch.zeros(b.S if b.sharded else b.G, dtype=b.dtype, device=b.device)
        return dst

    def land(self, b: BufferState, window: int) -> None:
        return None  # the unit's backward landed them (unit_backward)

    def deliver(self, b: BufferState, result: torch.Tensor) -> None:
        dst = self._dst(b)
        if result.data_ptr() != dst.data_ptr():
            with torch.no_grad():
                dst.copy_(result[:dst.numel()])
        for m in b.members:
            if m.info.requires_grad:
                self.grads[m.name] = dst.as_strided(m.lshape, m.lstride, m.shard.start)
        del self.dst[b.bp.index]  # the next backward gets fresh tensors: these now belong to the caller

    def unused(self, indices: list[int]) -> None:
        return None  # a parameter no rank used gets zeros, not a missing gradient (JAX's convention)

    def window_ended(self) -> None:
        return None

    def shard_version(self) -> int:
        return 0  # staleness comes from load()

    def local_params(self) -> dict:
        return dict(self.leaves)
