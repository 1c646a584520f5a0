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
    ``reset_parameters()``. The caller copies its shards out and drops the full tensors.
    """
    seen: set[int] = set()
    for m in owners:
        if id(m) in seen:
            continue
        seen.add(id(m))
        m.to_empty(device=device, recurse=False)
        with torch.no_grad():
            if init_fn is not None:
                init_fn(m)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
            else:
                exc = RuntimeShardingError(
                    f"module {type(m).__name__} owns parameters {[n for n in names]} built on the meta device but has no "
                    f"reset_parameters(); pass shard(..., init_fn=fn) to initialise them")
                exc.uninitialised = (type(m).__name__, list(names))  # (the fully_shard face names its own fix)
                raise exc
    return {n: params_of[n]() for n in names}
