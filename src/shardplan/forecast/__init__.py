"""Forecast: a plan's predicted step time at N GPUs, from an α–β network model and a compute model. Pure:
no process group, no GPU.

>>> import shardplan as sp
>>> f = plan.forecast(network="h100-8x-ib400", batch=(1, 4096))       # a preset, a dict or a JSON file
>>> print(f); f.step_s, f.exposed_s, f.tokens_per_s, f.mfu
>>> f2 = plan.forecast(network=f.network.with_link("inter", busbw=90.0), batch=(1, 4096))

Modules: ``network`` (links, presets, where groups sit, the α–β time of a collective), ``compute``
(achievable rates and measured unit times), ``flops`` (matmul FLOPs per unit from the plan),
``tp_comm`` (tensor-parallel activation collectives), ``timeline`` (the simulation), ``result`` (the
:class:`Forecast` value), ``model`` (:func:`forecast`: the plan's program walked into a timeline),
``cli`` (``shardplan forecast``).
"""

from .compute import PRESETS as COMPUTE_PRESETS
from .compute import ComputeModel, compute_model
from .model import forecast
from .network import PRESETS as NETWORK_PRESETS
from .network import Cost, Link, Network, Placement, collective_time, network, placement
from .result import CollectiveForecast, Forecast
from ..planner.facade import register_forecast

register_forecast(forecast)  # plan.forecast(...) calls it (the planner never imports the forecast)

__all__ = ["forecast", "Forecast", "CollectiveForecast", "Network", "Link", "Cost", "Placement", "network",
           "placement", "collective_time", "ComputeModel", "compute_model", "NETWORK_PRESETS", "COMPUTE_PRESETS"]
