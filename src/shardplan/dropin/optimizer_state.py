"""Optimizers over a ``fully_shard`` model give their states as FSDP2's DTensors (``state_dict()``) and take them
back (``load_state_dict``): a step pre-hook installs it on each such optimizer at its first step."""

from __future__ import annotations

import torch

from ..errors import ShardingError
from ..runtime import state_dict as SD


_WATCHING = [False]


def _watch_optimizers() -> None:
    if not _WATCHING[0]:
        from torch.optim import optimizer as O
        handle = O.register_optimizer_step_pre_hook(_dtensor_optimizer_state)
        hooks = getattr(O, "_global_optimizer_pre_hooks", None)
        if hasattr(hooks, "move_to_end"):  # before shardplan's check of the states' shapes (runtime/identity.py)
            hooks.move_to_end(handle.id, last=False)
        _WATCHING[0] = True


def _dtensor_optimizer_state(opt: torch.optim.Optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook (once per optimizer): one that steps a ``fully_shard`` model's parameters gives
    its states as DTensors from ``state_dict()`` and takes them back in ``load_state_dict``, as FSDP2's does.

    [Note: FSDP2's optimizer states are DTensors] Without this an optimizer's moments are this rank's shards
    as plain tensors under the parameters' names: ``get_optimizer_state_dict(full_state_dict=True)`` would
    return one rank's shard as the "full" state, and ``dcp.save`` would keep one rank's copy for every rank
    (plain tensors are taken as replicated): silently wrong. Installed at the first step, which
    ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` run on an optimizer without state."""
    if "_shardplan_dtensor_state" in opt.__dict__:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    engines = {id(e): e for e in (getattr(p, "_shardplan_engine", lambda: None)() for p in params) if e is not None}
    ours = [e for e in engines.values() if getattr(e, "fsdp2_optimizer_state", False)]
    opt.__dict__["_shardplan_dtensor_state"] = False
    if not ours or any(getattr(e, "dtensor_params", False) for e in ours):
        return  # (DTensor parameters: torch's optimizer keeps DTensor states, as over FSDP2's; nothing to install)
    if len(engines) > 1 or any(getattr(p, "_shardplan_engine", None) is None for p in params):
        def refuse(*_):  # training is right; only its state dict could not be: refuse that, not the step
            raise ShardingError("optimizer.state_dict() / load_state_dict(): this optimizer holds parameters of a "
                                "shardplan fully_shard model and other parameters (or another model's); their states "
                                "cannot be given as FSDP2's DTensors. Build one optimizer per fully_shard model, on "
                                "model.parameters()")
        opt.register_state_dict_pre_hook(refuse)
        opt.register_load_state_dict_pre_hook(refuse)
        return
    SD.install_optimizer(opt, ours[0])  # (states loaded before it, DTensors included, become this rank's pieces)
    opt.__dict__["_shardplan_dtensor_state"] = True
