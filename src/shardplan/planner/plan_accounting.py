"""What a :class:`~shardplan.planner.facade.Plan` costs: memory per rank, bytes sent per step, the host step of
CPU offload, and the forecast step time (through the function :mod:`shardplan.forecast` registers here). A
mixin of ``Plan``, over its fields; the counting itself is :mod:`~shardplan.planner.accounting`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Union

from ..errors import PlanError
from . import accounting
from .offload import HOST_GBPS, balanced_fraction, host_step_bytes
from .values import Memory

if TYPE_CHECKING:  # annotations only
    from ..forecast import ComputeModel, Forecast, Network

# [Note: the forecast sits above the planner: it reads plans, and nothing in planner/ imports it. ``Plan.forecast``
# calls the function :mod:`shardplan.forecast` registers here (:func:`register_forecast`) when it is imported;
# ``import shardplan`` imports it (torch-free), so the method always works]
_FORECAST: Optional[Callable[..., "Forecast"]] = None


def register_forecast(forecast: Callable[..., "Forecast"]) -> None:
    """Make ``plan.forecast(...)`` call ``forecast(plan, ...)`` (:func:`shardplan.forecast.forecast`)."""
    global _FORECAST
    _FORECAST = forecast


class PlanAccounting:
    """``Plan``'s costs: ``memory``, ``comm_bytes``, ``max_gathered_units``, ``padding``, ``host_step_s``,
    ``balanced_offload_fraction``, ``forecast``."""

    # -- accounting ----------------------------------------------------------------------------------
    def memory(self, rank: int = 0, *, recompute: bool = False) -> Memory:
        """Planned bytes on ``rank``: params, grads and optimizer state, and the peak over the schedule.
        A plan traced with example inputs (``trace=``) adds the traced step's activations to the peak
        (``memory.activations``: their share of it); ``recompute=True``: with every unit checkpointed.
        ``host``/``host_peak``: host memory of CPU offload (0 without it).

        >>> m = plan.memory(0); m.peak, m.states_peak, m.activations   # activations None: not traced
        """
        return Memory(**accounting.memory(self, rank, recompute))

    def host_step_s(self, gbps: float = HOST_GBPS) -> float:
        """Estimated seconds of the host optimizer step per training step at ``gbps`` GB/s of host memory
        bandwidth (``benchmarks/host_adamw.py`` measures a host's): the bytes it moves (28 per fp32 element
        for AdamW) over the bandwidth ([Note: the host step's bound], planner/offload.py); 0 without offload.
        A step takes at least ``max(device step, host step)``.

        >>> plan.host_step_s(gbps=91)   # the 1B fully offloaded on a 16-core H200 host: ~0.3 s
        """
        return host_step_bytes(self.buffers, self.optimizer_states) / (gbps * 1e9)

    def balanced_offload_fraction(self, host_s: float, window_s: float, at_least: float = 0.0) -> float:
        """The ``offload_fraction`` whose host step just fits ``window_s`` (the backward it overlaps), given
        this offloading plan's measured host step ``host_s`` per training step (``opt.host_stats()["kernel_s"]``
        per step); not below ``at_least`` (the smallest fraction that fits the device, from
        ``offload_fraction="auto"``). Re-plan with the number returned (docs/offload.md).

        >>> f = plan.balanced_offload_fraction(host_s=0.28, window_s=0.09)   # ~0.32 of the state on the host
        """
        if not self.offload:
            raise PlanError("balanced_offload_fraction: this plan offloads nothing; call it on the plan the host step "
                            "was measured with (plan(..., offload='optimizer'))")
        return balanced_fraction(self.buffers, self.units, host_s, window_s, at_least)

    def comm_bytes(self, rank: int = 0) -> dict[str, Optional[int]]:
        """Bytes each rank sends per training step, by op kind (ring algorithms: (n-1)/n of the payload).
        With compute axes, ``tensor_parallel`` adds the activations the styles move: estimated when the plan
        was traced with example inputs (``trace=``), ``None`` ("not estimated") otherwise. With CPU offload,
        ``copy_d2h`` / ``copy_h2d`` are the host<->device copy bytes per step (not in ``total``, the network's).
        With expert modules split over an expert axis, ``expert_parallel`` adds the token all-to-alls
        (estimated from a traced plan's expert inputs under balanced routing; ``None`` untraced)."""
        return accounting.comm_bytes(self)

    def max_gathered_units(self) -> int:
        """Most units whose parameters are gathered (or being gathered) at once in a training step."""
        return accounting.max_gathered_units(self)

    @property
    def padding(self) -> int:
        """Padded elements summed over buffers (per rank group)."""
        return sum(b.padding for b in self.buffers)

    def forecast(self, network: Union[str, dict, "Network"], compute: Union[None, str, float, dict, "ComputeModel"] = None,
                 *, batch: tuple[int, int], rank: int = 0, scalar_all_reduces: int = 0) -> "Forecast":
        """Predicted step time of ``rank`` on ``network`` (a preset name, a dict, a JSON file or a
        :class:`shardplan.forecast.Network`) with per-rank ``batch = (B, T)``: compute (FLOPs at an achievable
        rate, or measured unit times: ``compute=``), each collective from an α–β model of the link its group
        crosses, and the overlap this schedule allows. Returns a frozen :class:`shardplan.forecast.Forecast`.
        ``scalar_all_reduces``: blocking one-number all-reduces per step (``sp.clip_grad_norm_`` issues one).
        The same as ``shardplan.forecast.forecast(plan, ...)``.

        >>> f = plan.forecast(network="h100-8x-ib400", batch=(1, 4096))
        >>> print(f); f.step_s, f.exposed_s, f.tokens_per_s, f.mfu; f.to_chrome_trace("forecast.json")
        """
        if _FORECAST is None:  # (`import shardplan` registers it: only a broken install gets here)
            raise PlanError("plan.forecast: shardplan.forecast is not imported; call "
                            "shardplan.forecast.forecast(plan, network, ...) instead")
        return _FORECAST(self, network, compute, batch=batch, rank=rank, scalar_all_reduces=scalar_all_reduces)
