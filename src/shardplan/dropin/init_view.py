"""FSDP2's (torchtitan's) meta start-up under ``fully_shard``: ``to_empty(device=...)`` gives the shards storage,
uninitialised, and the modules hold DTensor views of them (the init view) until the first use, so that the
model's own init writes them as it writes FSDP2's."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import ShardingError
from ..runtime.dtensor_params import plain
from ..runtime.identity import _REPLACED
from ..runtime.startup import device_for
from .marks import _INIT_VIEWS, _MARK


def _leave_uninitialised(module: nn.Module) -> None:
    """``init_fn`` of ``to_empty``'s compile: storage only, as ``to_empty`` gives; the model's init follows."""


def _check_empty_device(root: nn.Module, device: torch.device) -> None:
    if not dist.is_initialized():
        return  # shard() raises naming the process group
    have = device_for(root, dist.get_backend())[0]
    if have.type != device.type or (device.index is not None and device.index != have.index):
        raise ShardingError(f"fully_shard: to_empty(device={str(device)!r}), but this rank's shards live on {have} "
                            f"(the process group's backend {dist.get_backend()!r} and the current device decide it); "
                            f"pass device={str(have)!r}")


def _empty_buffers(root: nn.Module, device: torch.device) -> None:
    """Buffers still on the meta device get storage, as ``to_empty`` gives them (the model's init fills them)."""
    for m in root.modules():
        for k, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[k] = torch.empty_like(b, device=device)


# [Note: the init view]
# FSDP2's parameters are DTensors, and a model's own init (torchtitan's init_weights, nn.init.*, a module's
# reset_parameters) runs on them: shapes read as global (fan-in and fan-out as for the whole weight), random
# ops through DTensor's RNG (on a GPU each shard draws its own part of one stream, not the same numbers on every
# rank). From to_empty until the model's first use (forward, parameters(), state_dict(), ...) the modules hold
# such DTensors, views of this rank's shards (the placements model.state_dict() gives), so that init writes
# the shards exactly as it writes FSDP2's; the first use puts the local shards back. A DTensor an optimizer
# was built on would train nothing: identity.check_optimizer refuses it at step().


def _open_init_view(root: nn.Module, eng) -> None:
    hooks = eng.state_dict_hooks
    if hooks.bad is not None:  # (never with fully_shard's chunked layout)
        return
    made = {}
    for name, lp in eng.local_params().items():
        if getattr(eng, "dtensor_params", False):  # the parameters are DTensors already: the view is themselves
            made[id(lp)] = lp
            continue
        dt = nn.Parameter(hooks.value(name, lp), requires_grad=lp.requires_grad)
        dt.__dict__[_REPLACED] = name
        made[id(lp)] = dt
    views = []
    for slots in eng.face.slots.values():
        for m, attr, lp, _ in slots:
            m._parameters[attr] = made[id(lp)]
            views.append((m, attr, made[id(lp)], lp))
    root.__dict__[_MARK]["init_views"] = views
    _INIT_VIEWS[0] += 1


def _close_init_view(root: nn.Module) -> None:
    views = root.__dict__[_MARK].pop("init_views")
    _INIT_VIEWS[0] -= 1
    bad = [(m, attr) for m, attr, dt, lp in views if m._parameters.get(attr) is not dt
           or (plain(lp).numel() and dt._local_tensor.data_ptr() != plain(lp).data_ptr())]
    for m, attr, _, lp in views:
        m._parameters[attr] = lp
    if bad:
        path = {id(m): n for n, m in root.named_modules()}
        where = [f"{path.get(id(m), type(m).__name__)}.{attr}".lstrip(".") for m, attr in bad]
        raise ShardingError(f"fully_shard: parameter(s) {where[:3]} were replaced between to_empty() and the "
                            f"model's first use (an assignment module.weight = ..., or p.data = ...), so the "
                            f"shards kept their uninitialised values. Initialise parameters in place (nn.init.*, "
                            f"or p.copy_(value) under torch.no_grad()), as under FSDP2")
