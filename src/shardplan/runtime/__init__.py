"""The runtime: executes a :class:`shardplan.Plan` with torch.distributed (NCCL on GPUs, gloo on CPU)."""

from .api import clip_grad_norm_, engine_of, memory_stats, no_sync, record_ops, reset_peak, shard

__all__ = ["shard", "no_sync", "clip_grad_norm_", "record_ops", "memory_stats", "reset_peak", "engine_of"]
