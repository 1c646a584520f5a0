"""Meta-device start-up: materialise one unit at a time and keep only this rank's shards."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from ..errors import RuntimeShardingError


def materialize_unit(owners: list[nn.Module], names: list[str], params_of: dict, init_fn: Optional[Callable],
                     device: torch.device) -> dict[str, torch.Tensor]:
    """Give the modules that own ``names`` real storage on ``device``, initialise them, return the tensors.

    ``init_fn(module)`` runs once per owning module if given; otherwise the module's own
    ``reset_parameters()`` (a module without one is refused before anything is materialised, naming its
    parameters). ``owners[i]`` owns ``names[i]``. The caller copies its shards out and drops the full tensors.
    """
    seen: set[int] = set()
    if init_fn is None:  # refuse before materialising anything: the first module that cannot be initialised
        for m in owners:
            if not callable(getattr(m, "reset_parameters", None)):
                own = [n for n, o in zip(names, owners) if o is m]
                exc = RuntimeShardingError(
                    f"parameters {own} were built on the meta device and their module ({type(m).__name__}) has no "
                    f"reset_parameters() to initialise them. Fix: pass shardplan.shard(..., init_fn=fn), fn(module) "
                    f"initialising one module's own parameters in place (a Hugging Face model: "
                    f"init_fn=model._init_weights), give {type(m).__name__} a reset_parameters(), or build the model "
                    f"off the meta device")
                exc.uninitialised = (type(m).__name__, own)  # (the fully_shard face names its own fix)
                raise exc
    for m in owners:
        if id(m) in seen:
            continue
        seen.add(id(m))
        m.to_empty(device=device, recurse=False)
        with torch.no_grad():
            if init_fn is not None:
                init_fn(m)
            else:
                m.reset_parameters()
    return {n: params_of[n]() for n in names}
