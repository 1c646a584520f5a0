"""Methods other than ``forward`` that gather like it: FSDP2's ``register_fsdp_forward_method``, and torch's own
function routed to shardplan's for a shardplan module (see [Note: torch's register_fsdp_forward_method])."""

from __future__ import annotations

import torch.nn as nn

from ..runtime.api import engine_of
from .compile import _ensure_compiled
from .fsdp2 import ShardPlanModule
from .marks import _MARK, _check_sync_flags


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """FSDP2's ``register_fsdp_forward_method``: ``module.<method_name>(...)`` gathers and frees like
    ``module(...)`` (shardplan's forward hooks of ``module`` run around it), for methods such as ``generate``
    that call ``self.forward`` directly. A module ``fully_shard`` was not called on: nothing to do, as in torch.

    >>> fully_shard(model); register_fsdp_forward_method(model, "generate")

    torch's own function does the same for a shardplan module once shardplan is imported (it would do nothing,
    and ``generate`` would compute with the local shards)."""
    if not isinstance(module, ShardPlanModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    orig = getattr(module, method_name)

    def wrapped(self, *args, **kwargs):
        _ensure_compiled(self)
        root = self.__dict__[_MARK].get("root") or self
        if root is self:
            _check_sync_flags(self)
        ids = {h.id for h in engine_of(root).handles}
        pre = [(k, h) for k, h in self._forward_pre_hooks.items() if k in ids]
        post = [h for k, h in self._forward_hooks.items() if k in ids]
        for k, hook in pre:
            if k in self._forward_pre_hooks_with_kwargs:
                res = hook(self, args, kwargs)
                if res is not None:
                    args, kwargs = res
            else:
                res = hook(self, args)
                if res is not None:
                    args = res if isinstance(res, tuple) else (res,)
        out = orig(*args, **kwargs)
        for hook in post:
            res = hook(self, args, out)
            if res is not None:
                out = res
        return out

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def _route_torch_register() -> None:
    """[Note: torch's register_fsdp_forward_method] It returns at once for a module that is not torch's
    ``FSDPModule``, so on a shardplan module the method would run with the local shards (a shape error, or
    silently wrong numbers for a method that only reduces a parameter). Its code is swapped for a call of
    shardplan's, which hands any other module back to torch's original: names bound before shardplan was
    imported are covered too."""
    try:
        from torch.distributed.fsdp._fully_shard import _fully_shard as T
    except ImportError:  # pragma: no cover
        return
    fn = getattr(T, "register_fsdp_forward_method", None)
    if fn is None or "_shardplan_register" in fn.__globals__ or fn.__code__.co_freevars or fn.__code__.co_argcount != 2:
        return
    import types
    original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)

    def route(module, method_name):
        if isinstance(module, ShardPlanModule):
            return register_fsdp_forward_method(module, method_name)
        return original(module, method_name)

    fn.__globals__["_shardplan_register"] = route  # where the swapped code looks it up (its defining module)

    def routed(module, method_name):  # the code torch's function now runs, in torch's module
        return _shardplan_register(module, method_name)  # noqa: F821 - a global of torch's module

    fn.__code__ = routed.__code__


_route_torch_register()
