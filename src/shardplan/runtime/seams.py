"""Where a sharded module meets ordinary torch calls: ``torch.compile``'s wrapper, and ``.to()``/``.half()``/
``.cuda()`` after :func:`shardplan.shard` (which would detach the local shards from the runtime's buffers)."""

from __future__ import annotations

import types
from typing import Optional

import torch
import torch.nn as nn

from ..errors import RuntimeShardingError
from .dtensor_params import plain

FIX = ("set compute_dtype= (and reduce_dtype=) in shardplan.plan(...) for mixed precision, or call .to()/.half()/"
       ".cuda() on the module before planning and sharding it")


def unwrap_compiled(module):
    """The module ``torch.compile(module)`` wraps (its ``OptimizedModule._orig_mod``), else ``module``."""
    while isinstance(module, nn.Module) and "_orig_mod" in module._modules \
            and type(module).__name__ == "OptimizedModule":
        module = module._modules["_orig_mod"]
    return module


def _changes(fn, t: torch.Tensor) -> Optional[str]:
    """How ``fn`` (a module ``_apply`` function) would change ``t``, probed on an empty tensor like it;
    ``None`` when it returns the tensor itself (``.to()`` of its own dtype and device)."""
    probe = torch.empty(0, dtype=t.dtype, device=t.device)
    try:
        out = fn(probe)
    except Exception:  # noqa: BLE001 - a function that cannot run on a probe: let _apply decide
        return None
    if out is probe or not isinstance(out, torch.Tensor):
        return None
    if out.dtype != t.dtype:
        return f"dtype {t.dtype} -> {out.dtype}"
    if out.device != t.device:
        return f"device {t.device} -> {out.device}"
    return "new storage, as .to_empty() gives"


def _guarded_apply(self, fn, recurse: bool = True):
    """``nn.Module._apply`` that refuses to convert the parameters of a sharded module."""
    for name, p in self.named_parameters():
        change = _changes(fn, p)
        if change:
            fix = FIX if "to_empty" not in change else (
                "drop that call: shard() already gave meta parameters storage and initialised them "
                "(shardplan.shard(..., init_fn=...), else each module's reset_parameters()). With fully_shard, "
                "call model.to_empty(device=...) right after the fully_shard calls, before the model's first use "
                "(forward, parameters(), state_dict()), then the model's own init (torchtitan's order)")
            raise RuntimeShardingError(
                f"this module is sharded: converting its parameters ({name!r}: {change}) would detach them from "
                f"shardplan's shard buffers and break training; {fix}")
    return type(self)._apply(self, fn, recurse)


def guard_apply(module: nn.Module) -> None:
    """Make ``.to()``, ``.half()``, ``.float()``, ``.cuda()`` ... on ``module`` raise when they would change a
    parameter's dtype or device (a call that changes nothing, e.g. ``.to(its device)``, still runs).

    [Note: an instance attribute, not a class swap: ``type(module)`` stays the user's class (a drop-in face
    may have swapped it already). ``nn.Module.to`` calls ``self._apply``, which finds it first.]"""
    module.__dict__["_apply"] = types.MethodType(_guarded_apply, module)


def replaced_local(buffers) -> Optional[str]:
    """Why the next forward would not see a local parameter's values (its tensor was replaced, so it no
    longer lives in the shard the runtime gathers from), or ``None``. Checked once per step and before each
    replay of a captured step (one address read per parameter, in one list: ~0.1 us each): ``p.data = new``
    after ``shard()`` otherwise trains on the old values, silently. A tensor at the very address of its piece
    reads the same memory, so the address is the test."""
    for b in buffers:
        shard = b.shard
        if shard is None or getattr(b, "tw", None):
            continue
        checks = b.__dict__.get("_address_checks")
        if checks is None:  # members holding elements: plain ones (their parameter objects), DTensor ones, and
            isz = shard.element_size()  # the byte offsets of their pieces in the shard, in that order
            held = [m for m in b.members if m.local is not None and plain(m.local).numel()]
            held = [m for m in held if m.dspec is None] + [m for m in held if m.dspec is not None]
            n = sum(m.dspec is None for m in held)
            checks = b.__dict__["_address_checks"] = (held, [m.local for m in held[:n]], n,
                                                      [m.shard.start * isz for m in held])
        held, params, n, offsets = checks
        base = shard.data_ptr()
        # (a DTensor parameter's local tensor is read afresh: dtensor_params)
        now = [t.data_ptr() - base for t in params] + [m.local._local_tensor.data_ptr() - base for m in held[n:]]
        if now != offsets:
            m = next(m for m, a, off in zip(held, now, offsets) if a != off)
            return (f"parameter {m.info.name!r} is no longer this rank's shard that shardplan gathers from: its "
                    f"tensor was replaced after shardplan.shard (`p.data = new`, or a .to()/.half()/.cuda() on a "
                    f"child module), so the next forward would use its old values. Write parameters in place "
                    f"(`p.copy_(new)` or `p.data.copy_(new)` under torch.no_grad()); for dtypes, {FIX}")
    return None


def detached_local(buffer) -> Optional[str]:
    """Why a local parameter of ``buffer`` (a BufferState) no longer lives in its shard, or ``None``: the
    cheap diagnosis when handing out its gradient failed (a child module's ``.to()`` after sharding)."""
    shard = buffer.shard
    for m in buffer.members:
        lp, info, off = plain(m.local), m.info, m.shard.start
        moved = lp.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr() \
            or lp.storage_offset() != shard.storage_offset() + off
        if lp.dtype != shard.dtype or lp.device != shard.device or moved:
            return (f"parameter {info.name!r} is {lp.dtype} on {lp.device} and no longer the shard shardplan keeps "
                    f"({buffer.shard.dtype} on {buffer.shard.device}): a .to()/.half()/.cuda() after shardplan.shard "
                    f"replaced it; {FIX}")
    return None
