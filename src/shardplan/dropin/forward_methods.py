"""Methods other than ``forward`` that gather like it: FSDP2's ``register_fsdp_forward_method``.

A ``fully_shard`` module is an instance of torch's public ``FSDPModule`` (``ShardPlanModule`` subclasses it, as
FSDP2's modules' classes do), so torch's own ``register_fsdp_forward_method`` takes it, and wraps the method in
``module._get_fsdp_state()._pre_forward`` / ``._post_forward``: the module's state is :class:`ForwardState`, which
runs shardplan's forward hooks there. Nothing of torch's is replaced; a name bound before shardplan was imported
is torch's function, and works the same."""

from __future__ import annotations

import torch.nn as nn

from ..runtime.api import engine_of
from .compile import _ensure_compiled
from .marks import _MARK, _check_sync_flags

try:
    from torch.distributed.fsdp import register_fsdp_forward_method as _torch_register
except ImportError:  # pragma: no cover - torch without FSDP2
    _torch_register = None


class ForwardState:
    """What torch's ``register_fsdp_forward_method`` calls on ``module._get_fsdp_state()`` (FSDP2's ``FSDPState``
    hooks of the same names, torch 2.4 through 2.13): the shardplan forward hooks of ``module`` run around the
    method, as around ``module(...)``. One stateless instance serves every module."""

    def _hooks(self, module: nn.Module) -> tuple[list, list]:
        root = module.__dict__[_MARK].get("root") or module
        ids = {h.id for h in engine_of(root).handles}
        pre = [(k, h) for k, h in module._forward_pre_hooks.items() if k in ids]
        post = [h for k, h in module._forward_hooks.items() if k in ids]
        return pre, post

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        _ensure_compiled(module)
        if (module.__dict__[_MARK].get("root") or module) is module:
            _check_sync_flags(module)
        for k, hook in self._hooks(module)[0]:
            if k in module._forward_pre_hooks_with_kwargs:
                res = hook(module, args, kwargs)
                if res is not None:
                    args, kwargs = res
            else:
                res = hook(module, args)
                if res is not None:
                    args = res if isinstance(res, tuple) else (res,)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, out):
        for hook in self._hooks(module)[1]:
            res = hook(module, args, out)
            if res is not None:
                out = res
        return out


FORWARD_STATE = ForwardState()


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """FSDP2's ``register_fsdp_forward_method``: ``module.<method_name>(...)`` gathers and frees like
    ``module(...)`` (shardplan's forward hooks of ``module`` run around it), for methods such as ``generate``
    that call ``self.forward`` directly. A module ``fully_shard`` was not called on: nothing to do, as in torch.

    >>> fully_shard(model); register_fsdp_forward_method(model, "generate")

    It is torch's own function (``torch.distributed.fsdp.register_fsdp_forward_method``), which takes a
    shardplan module as an ``FSDPModule``; either name works."""
    if _torch_register is None:  # pragma: no cover
        raise ImportError("register_fsdp_forward_method needs torch's FSDP2 (torch.distributed.fsdp.FSDPModule)")
    _torch_register(module, method_name)
