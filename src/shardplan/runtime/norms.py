"""Gradient norms over every rank: ``shardplan.clip_grad_norm_``'s, and torch's own ``clip_grad_norm_`` /
``get_total_norm`` over a sharded model's local gradients, through torch's extension point for tensor types.

[Note: torch's clip_grad_norm_ on local shards] A sharded model's parameters are this rank's shards as plain
tensors, not FSDP2's DTensors, so torch's ``clip_grad_norm_(model.parameters(), ...)`` (and torchtitan's
``get_total_norm(grads)``) would return this rank's norm and clip each rank's shards by a different factor:
silently wrong. Instead the runtime hands each local shard its gradient as a :class:`ShardGrad`, a view of the
reduced gradient (no copy) whose ``__torch_function__`` answers the two norm operations torch's function runs
as DTensor's ``Partial`` placement does: ``torch.linalg.vector_norm`` of a gradient (or ``torch._foreach_norm``
of several) is a :class:`PartialNorm`, this rank's part of the norm; ``torch.stack`` of such parts is one too,
and ``torch.linalg.vector_norm`` of it sums the parts over every rank (one all-reduce, each element counted once
however many ranks hold it) into the global norm, a plain tensor. Every other operation passes through as on a
plain tensor (``torch._C.DisableTorchFunctionSubclass``); any other operation on a ``PartialNorm`` reduces it
first (a collective, as with a DTensor: every rank must call it). Nothing of torch's is replaced, so a name
bound before ``shard()`` (``from torch.nn.utils import get_total_norm``) answers alike.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import RuntimeShardingError
from ..planner import geometry as G
from . import collectives as C

_MIX = ("torch.nn.utils.clip_grad_norm_ / get_total_norm: the gradients given mix local shards of a shardplan-sharded "
        "model with other tensors (or with another sharded model's); their norm would be neither this rank's nor the "
        "global one. Clip each sharded model on its own: shardplan.clip_grad_norm_(model, max_norm) or "
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)")


def _plain(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


class ShardGrad(torch.Tensor):
    """A local shard's ``.grad``: a plain tensor in every way but the norm (module docstring). ``_shardplan_norm``
    is ``(engine reference, parameter name)``."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.linalg.vector_norm:
            return _grad_norm(func, args, kwargs or {})
        if func is torch._foreach_norm:
            tensors, rest = args[0], args[1:]
            return [_grad_norm(torch.linalg.vector_norm, (t,) + rest, kwargs or {}) for t in tensors]
        if func is torch._amp_foreach_non_finite_check_and_unscale_:
            return _found_inf(func, args, kwargs or {})
        return _plain(func, args, kwargs)


def wrap(exe, g: torch.Tensor, name: str) -> ShardGrad:
    """``g`` (a local gradient view) as the :class:`ShardGrad` of parameter ``name`` of ``exe`` (same memory)."""
    out = g.as_subclass(ShardGrad)
    out.__dict__["_shardplan_norm"] = (weakref.ref(exe), name)
    return out


def _found_inf(func, args, kwargs):
    """torch.amp.GradScaler's non-finite check over local shards: this rank's check, then the maximum of
    ``found_inf`` over every rank of each sharded model the gradients belong to.

    [Note: an overflow in one rank's shard] GradScaler skips the step and halves its scale where ``found_inf``
    is set. Checked on this rank's shards alone, the rank holding an overflow would skip while the others
    stepped, and the ranks' scales would part: every later reduction would sum gradients scaled differently,
    silently. DTensor makes FSDP2's check global the same way (its ``found_inf`` is a ``Partial("max")``)."""
    grads = args[0] if args else kwargs["self"]
    found = args[1] if len(args) > 1 else kwargs["found_inf"]
    _plain(func, args, kwargs)
    exes: dict = {}
    for g in grads:
        owner = g.__dict__.get("_shardplan_norm") if isinstance(g, ShardGrad) else None
        exe = owner[0]() if owner is not None else None
        if exe is not None:
            exes.setdefault(id(exe), exe)
    for exe in exes.values():  # (in the gradients' order: the same on every rank)
        if getattr(exe, "offload", None) is not None:
            raise RuntimeShardingError("torch.amp.GradScaler on a model whose optimizer is offloaded: the host copies "
                                       "of the gradients are what the optimizer steps, unchecked and still scaled; "
                                       "train this model in bfloat16 (compute_dtype=torch.bfloat16) without a scaler")
        with torch._C.DisableTorchFunctionSubclass():
            C.all_reduce(found, exe.groups.world, async_op=False, op=dist.ReduceOp.MAX)


def _grad_norm(func, args, kwargs):
    g = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    owner = g.__dict__.get("_shardplan_norm") if isinstance(g, ShardGrad) else None
    if owner is None or dim is not None:  # a norm along dims stays this rank's (as the pieces it computes over)
        return _plain(func, args, kwargs)
    # a rank holding none of the parameter: its part is 0 (torch has no inf norm of an empty tensor)
    local = _plain(func, args, kwargs) if g.numel() else \
        torch.zeros((), dtype=kwargs.get("dtype") or g.dtype, device=g.device)
    exe = owner[0]()
    if exe is None:
        return local
    ord_ = float(ord_)
    if getattr(exe, "offload", None) is not None:
        raise RuntimeShardingError("torch.nn.utils.clip_grad_norm_ on a model whose optimizer is offloaded: the host "
                                   "copies of the gradients must be scaled too; use shardplan.clip_grad_norm_(model, "
                                   "max_norm)")
    if not (ord_ > 0):  # -inf, 0 and negative orders have no sum of powers over the ranks' pieces
        raise RuntimeShardingError(f"torch.nn.utils.clip_grad_norm_ / get_total_norm over a sharded model's gradients: "
                                   f"norm_type={ord_} is not supported; use a positive order or inf")
    return PartialNorm.make(local, exe, (owner[1],), ord_)


class PartialNorm(torch.Tensor):
    """This rank's part of a norm over sharded gradients (DTensor's ``Partial`` placement, for norms): its values
    are this rank's norms; ``_shardplan_partial`` is ``(engine, parameter names, order)``."""

    @staticmethod
    def make(local: torch.Tensor, exe, names: tuple, ord_: float) -> "PartialNorm":
        out = local.as_subclass(PartialNorm)
        out.__dict__["_shardplan_partial"] = (exe, names, ord_)
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to or func is torch.Tensor.detach:  # torch's moves to the first device
            me = args[0]
            return PartialNorm.make(_plain(func, args, kwargs), *me.__dict__["_shardplan_partial"])
        if func is torch.stack:
            return _stack(args, kwargs)
        if func is torch.linalg.vector_norm and isinstance(args[0], PartialNorm):
            return _total(args[0], args[1] if len(args) > 1 else kwargs.get("ord", 2), args[2:], kwargs)
        if func is torch.Tensor.__repr__:
            me = args[0]
            return f"PartialNorm(local={_plain(func, args, kwargs)}, order={me.__dict__['_shardplan_partial'][2]})"
        # anything else: the global per-element norms first, as DTensor redistributes a Partial to Replicate
        return _plain(func, tuple(_reduce(a) if isinstance(a, PartialNorm) else a for a in args), kwargs)


def _stack(args, kwargs):
    tensors = list(args[0])
    parts = [t for t in tensors if isinstance(t, PartialNorm)]
    infos = [t.__dict__["_shardplan_partial"] for t in parts]
    if len(parts) != len(tensors) or len({id(i[0]) for i in infos}) > 1 or len({i[2] for i in infos}) > 1:
        raise RuntimeShardingError(_MIX)
    local = _plain(torch.stack, args, kwargs)
    exe, _, ord_ = infos[0]
    return PartialNorm.make(local, exe, tuple(n for i in infos for n in i[1]), ord_)


def _total(pn: PartialNorm, ord_, rest, kwargs) -> torch.Tensor:
    """``vector_norm`` of stacked parts: the global norm (one all-reduce over every rank)."""
    exe, names, have = pn.__dict__["_shardplan_partial"]
    if float(ord_) != have or rest or kwargs.get("dim") is not None:
        raise RuntimeShardingError(f"the norm of gradient norms of order {have} taken with order {ord_} (or along "
                                   f"dims): torch.nn.utils.get_total_norm takes one order; pass one norm_type")
    with torch._C.DisableTorchFunctionSubclass():
        local = pn.as_subclass(torch.Tensor)
        total = combine(exe, local, names, have)
    return total.to(local.dtype)


def _reduce(pn: PartialNorm) -> torch.Tensor:
    """Each element's norm over every rank (a collective)."""
    exe, names, ord_ = pn.__dict__["_shardplan_partial"]
    with torch._C.DisableTorchFunctionSubclass():
        local = pn.as_subclass(torch.Tensor)
        if len(names) != max(local.numel(), 1):
            raise RuntimeShardingError(_MIX)
        dev = exe.device
        if ord_ == math.inf:
            out = local.to(dev, torch.float32).clone()
            C.all_reduce(out, exe.groups.world, async_op=False, op=dist.ReduceOp.MAX)
        else:
            acc = torch.float64 if dev.type == "cpu" else torch.float32
            w = norm_weights(exe, names, acc, dev).view(local.shape)
            out = local.to(dev, acc).pow(ord_) * w
            C.all_reduce(out, exe.groups.world, async_op=False, op=dist.ReduceOp.SUM)
            out = out.pow(1.0 / ord_)
        return out.to(local.dtype)


def combine(exe, norms: torch.Tensor, names: tuple, ord_: float) -> torch.Tensor:
    """The norm over every rank of full gradients whose local pieces have the norms ``norms`` (one per name, a
    1-d tensor): each element counts once, however many ranks hold it. One collective: every rank calls it."""
    dev = exe.device
    if ord_ == math.inf:
        total = norms.to(dev, torch.float32).max() if norms.numel() else torch.zeros((), device=dev)
        C.all_reduce(total, exe.groups.world, async_op=False, op=dist.ReduceOp.MAX)
        return total
    acc = torch.float64 if dev.type == "cpu" else torch.float32
    total = torch.zeros((), dtype=acc, device=dev)
    if norms.numel():
        total = (norms.to(dev, acc).pow(ord_) * norm_weights(exe, names, acc, dev)).sum()
    C.all_reduce(total, exe.groups.world, async_op=False, op=dist.ReduceOp.SUM)
    return total.pow(1.0 / ord_)


def norm_weights(eng, names: tuple, dtype, dev) -> torch.Tensor:
    """``1 / replicas`` per parameter, on the device: made once per group of names (a host-to-device copy per step
    would also stop a captured step, shardplan.capture, which cannot copy from pageable host memory)."""
    cache = eng.__dict__.setdefault("_norm_weights", {})
    key = (names, dtype, dev)
    w = cache.get(key)
    if w is None:
        w = cache[key] = torch.tensor([1.0 / G.replicas(eng.plan, n) for n in names], dtype=dtype, device=dev)
    return w


def global_norm(eng, groups: list, norm_type: float, foreach: Optional[bool] = None) -> torch.Tensor:
    """The norm over every rank of the full gradients whose local pieces are in ``groups`` (lists of
    ``(gradient, parameter name)``, each a buffer's): each element counts once, however many ranks hold it.
    One collective: every rank calls it. (shardplan.clip_grad_norm_'s: plain tensor operations, no dispatch.)"""
    dev, world = eng.device, eng.groups.world
    with torch._C.DisableTorchFunctionSubclass():
        if norm_type == math.inf:
            total = torch.zeros((), device=dev)
            for held in groups:
                norms = torch._foreach_norm([g for g, _ in held], norm_type)
                total = torch.maximum(total, torch.stack([t.float() for t in norms]).max())
            C.all_reduce(total, world, async_op=False, op=dist.ReduceOp.MAX)
            return total
        acc = torch.zeros((), dtype=torch.float64 if dev.type == "cpu" else torch.float32, device=dev)
        for held in groups:
            gs = [g for g, _ in held]
            norms = torch._foreach_norm(gs, norm_type) if foreach is not False else \
                [torch.linalg.vector_norm(g, norm_type) for g in gs]
            # each element is held by `replicas` ranks (copies across data replicas and compute axes that
            # replicate it): count it once
            weights = norm_weights(eng, tuple(n for _, n in held), acc.dtype, dev)
            acc = acc + (torch.stack([t.to(acc.dtype) for t in norms]).pow(norm_type) * weights).sum()
        C.all_reduce(acc, world, async_op=False, op=dist.ReduceOp.SUM)
        return acc.pow(1.0 / norm_type)
