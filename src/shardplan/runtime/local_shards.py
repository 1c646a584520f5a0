"""This rank's shards as the API reads and writes them (the optimizer, checkpoints, ``mark_shards_changed``):
each parameter's local shard, a buffer's flat shard and a parameter's value, which under ``offload="params"``
live in host memory. A mixin of :class:`~shardplan.runtime.executor.Executor`, over its state.
"""

from __future__ import annotations

import torch


class LocalShards:
    """``Executor``'s local shards: ``local_params``, ``shard_of``, ``local_value``, ``mark_shards_changed``."""

    def local_params(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter, by plan name (what the optimizer steps)."""
        return self.face.local_params()

    def shard_of(self, buffer_index: int) -> torch.Tensor:
        """This rank's flat shard of a buffer (``plan.buffers[buffer_index]``): under ``offload="params"``
        its host master (the device holds it only around the buffer's all-gathers)."""
        if self.offload is not None:  # [offload hook] (host steps still running finish first)
            self.offload.settle()
            hosted = self.offload.hosted_shard(buffer_index)
            if hosted is not None:
                return hosted
        return self.buffer[buffer_index].shard

    def local_value(self, name: str, lp: torch.Tensor) -> torch.Tensor:
        """This rank's shard of parameter ``name`` (its local parameter ``lp``) as a tensor holding its value
        now (what checkpoints read and write): ``lp`` detached, or under ``offload="params"`` a view of its host master
        (written through: call :meth:`mark_shards_changed` after writing)."""
        if self.offload is not None:  # [offload hook] (host steps still running finish first)
            self.offload.settle()
            hosted = self.offload.hosted_value(name)
            if hosted is not None:
                return hosted
        return lp.detach()

    def mark_shards_changed(self) -> None:
        """The local shards were written outside an optimizer step (a checkpoint load): gather again."""
        self.stale = True
        if self.offload is not None:  # [offload hook] the host master shards follow the device shards
            self.offload.shards_changed()
