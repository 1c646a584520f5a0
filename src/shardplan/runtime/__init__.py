"""The runtime: executes a :class:`shardplan.Plan` with torch.distributed (NCCL on GPUs, gloo on CPU).

``executor`` runs the plan's schedule; ``hooks`` report a module's events to it; ``buffers`` and ``unit``
hold the per-rank storage and state; ``collectives`` every collective and process group."""

from .api import (clip_grad_norm_, compile_units, engine_of, mark_shards_changed, memory_stats, no_sync, record_ops,
                  reset_peak, set_requires_gradient_sync, shard)

__all__ = ["shard", "no_sync", "clip_grad_norm_", "record_ops", "memory_stats", "reset_peak", "engine_of",
           "mark_shards_changed", "compile_units", "set_requires_gradient_sync"]
