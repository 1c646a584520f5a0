"""A :class:`~shardplan.planner.facade.Plan` written out and read back: JSON (``to_dict``, ``to_json``,
``from_json``), its fingerprint, ``equivalent``, ``summary`` and the Chrome trace of its schedule. A mixin of
``Plan``, over its fields; the writing itself is :mod:`~shardplan.planner.serialize`'s and
:mod:`~shardplan.planner.render`'s.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from typing import TYPE_CHECKING, Any, Optional

from . import render, serialize

if TYPE_CHECKING:  # annotations only
    from .facade import Plan


class PlanIO:
    """``Plan`` as JSON and back, its fingerprint, summary and Chrome trace."""

    # -- serialisation -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return serialize.to_dict(self)

    def to_json(self, indent: Optional[int] = None) -> str:
        return serialize.to_json(self, indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls(**serialize.plan_fields(text))

    def fingerprint(self) -> str:
        """A short hash of the plan's JSON: equal on every process that built the same plan."""
        return self._fingerprint

    @cached_property
    def _fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def equivalent(self, other: "Plan") -> bool:
        """Whether ``other`` shards and schedules exactly like this plan (only the rules' wording, the
        planner's notes and the warnings may differ): the test for a plan rebuilt from :meth:`declarative`."""
        def core(p):
            d = p.to_dict()
            for q in d["params"]:
                q.pop("rule")
            d.pop("notes"), d.pop("warnings")
            return d
        return core(self) == core(other)

    def summary(self) -> dict[str, Any]:
        """The plan's options and sizes, for telling two plans apart (ranks that disagree, say)."""
        return serialize.summary(self)

    def to_chrome_trace(self, path: str, *, gbps: float = 100.0) -> None:
        """Write the planned schedule as a Chrome/Perfetto trace (open in ui.perfetto.dev); a picture of the
        plan's order and sizes at ``gbps`` GB/s, not a measurement."""
        render.chrome_trace(self, path, gbps)
