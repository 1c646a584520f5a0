"""What each mesh axis does in a :class:`~shardplan.planner.facade.Plan`: the compute axes (``plan.axes``: one
frozen value per axis, planner/axes.py) read by kind and under their old names (``plan.tp_modules``,
``plan.expert_calls``, ...), and the data axes that split the batch. A mixin of ``Plan``, over its fields.
"""

from __future__ import annotations

from typing import Any, Optional

from . import axes as AX
from . import context_parallel as CPX
from . import expert_parallel as EP
from . import tensor_parallel as tp


class PlanAxes:
    """``Plan``'s mesh axes by job: compute (``tp``, ``ep``, ``cp``) and data."""

    # -- the compute axes (``axes``: one frozen value per axis, planner/axes.py), and their old names ----------
    def axis(self, kind: str) -> Any:
        """The value of compute axis ``kind`` (``"tp"``, ``"ep"``, ``"cp"``, ...) in this plan, or ``None``.

        >>> plan.axis("tp").modules == plan.tp_modules
        True
        """
        return AX.value(self.axes, kind)

    @property
    def compute_axes(self) -> tuple[str, ...]:
        """Mesh axes that shard compute (tensor parallelism)."""
        v = self.axis("tp")
        return v.axes if v is not None else ()

    @property
    def tp_modules(self) -> tuple[tp.TPModule, ...]:
        """Modules run tensor-parallel, with their styles."""
        v = self.axis("tp")
        return v.modules if v is not None else ()

    @property
    def tp_activations(self) -> Optional[tuple[tp.Activation, ...]]:
        """Traced activation sizes of the tensor-parallel modules (``None``: not traced)."""
        v = self.axis("tp")
        return v.activations if v is not None else None

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """Mesh axes that split stacked experts (expert parallelism)."""
        v = self.axis("ep")
        return v.axes if v is not None else ()

    @property
    def expert_modules(self) -> tuple[EP.ExpertModule, ...]:
        """Modules whose experts the expert axes split."""
        v = self.axis("ep")
        return v.modules if v is not None else ()

    @property
    def expert_calls(self) -> Optional[tuple[EP.ExpertCall, ...]]:
        """Traced token inputs of the expert modules (``None``: not traced)."""
        v = self.axis("ep")
        return v.calls if v is not None else None

    @property
    def context_calls(self) -> Optional[tuple[CPX.AttentionCall, ...]]:
        """Traced attention calls (``None``: not traced, or no ``cp`` axis)."""
        v = self.axis("cp")
        return v.calls if v is not None else None

    def tp_module(self, path: str) -> Optional[tp.TPModule]:
        return next((m for m in self.tp_modules if m.path == path), None)

    def expert_module(self, path: str) -> Optional[EP.ExpertModule]:
        """The expert module at ``path`` (its experts split over ``plan.expert_axes``), or ``None``.

        >>> plan.expert_module("layers.0.moe.experts").local_experts   # experts one ep rank holds
        """
        return next((m for m in self.expert_modules if m.path == path), None)

    # -- data parallelism -------------------------------------------------------------------------------
    @property
    def data_axes(self) -> tuple[str, ...]:
        """The mesh axes that split the batch: every axis but the compute axes and the context axis ``cp``
        (its ranks share their samples and split each sequence: ``shardplan.context_parallel.shard_batch``)."""
        return tuple(a for a in self.mesh.axis_names if a not in self.compute_axes and a != "cp")

    @property
    def data_size(self) -> int:
        """Into how many slices the global batch is split (ranks of one tensor-parallel group share one)."""
        return self.mesh.axis_size(self.data_axes) if self.data_axes else 1

    def data_index(self, rank: int) -> int:
        """Which slice of the global batch ``rank`` computes.

        >>> x_local = x.chunk(plan.data_size)[plan.data_index(rank)]
        """
        return self.mesh.axis_index(rank, self.data_axes)
