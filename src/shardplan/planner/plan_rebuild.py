"""What rebuilds a :class:`~shardplan.planner.facade.Plan` from its module: its options grouped by feature
(``plan.policies``), the keyword arguments of :func:`shardplan.plan` (``plan.declarative()``) and a rules file
(``plan.to_source()``). A mixin of ``Plan``, over its fields.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from ..auto import rules_from_specs
from ..rules import regex_list_source
from . import float8 as F8
from .kinds import LayoutChoice
from .policies import Layout as LayoutPolicy, Offload as OffloadPolicy, Policies, Precision, Schedule


class PlanRebuild:
    """``Plan``'s recipe: ``policies``, ``declarative()``, ``to_source()``."""

    @property
    def policies(self) -> Policies:
        """The plan's options grouped by feature: the :class:`~shardplan.planner.policies.Precision`,
        :class:`~shardplan.planner.policies.Offload` (``None``: no offload), :class:`~shardplan.planner.policies.Schedule`
        and :class:`~shardplan.planner.policies.Layout` that rebuild it, with the numbers the planner chose
        (``offload_fraction="auto"``'s fraction, ``min_unit_bytes``); read from the plan, so a plan loaded from JSON
        has them too. The flat attributes (``plan.compute_dtype``, ``plan.offload_fraction``, ...) read the same.

        >>> plan.policies.precision.compute_dtype, plan.policies.schedule.prefetch
        ('bfloat16', 1)
        >>> sp.plan(model, rules, mesh, units=units, **plan.policies.keywords())      # the same plan
        """
        gathers = [(re.escape(p.name), self.buffers[p.buffer].gather_dtype) for p in self.params
                   if self.buffers[p.buffer].gather_dtype and not self.buffers[p.buffer].tensorwise]
        # (the float8 Linears' tensorwise gathers follow from fp8= and fp8_gather=)
        fp8 = [(re.escape(m.path), F8.TORCHAO) for m in self.fp8_modules]
        precision = Precision(compute_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype,
                              gather_dtype=tuple(gathers) or None, fp8=tuple(fp8) or None,
                              fp8_gather=any(b.tensorwise for b in self.buffers) if fp8 else True)
        rafs = {u.reshard_after_forward for u in self.units[1:]}
        raf = rafs.pop() if len(rafs) == 1 else self.reshard_after_forward if not rafs \
            else {u.name: False for u in self.units[1:] if not u.reshard_after_forward}
        return Policies(precision=precision,
                        offload=OffloadPolicy(self.offload, self.offload_fraction) if self.offload else None,
                        schedule=Schedule(prefetch=self.prefetch, order=self.order, reshard_after_forward=raf),
                        layout=LayoutPolicy(self.layout, self.min_unit_bytes))

    def declarative(self) -> dict[str, Any]:
        """Keyword arguments of :func:`shardplan.plan` that rebuild this plan from its module: rules (one
        per parameter name, block indices generalised), units (exact module paths), options (the flat keywords
        of :attr:`policies`).

        >>> sp.plan(model, **plan.declarative()).equivalent(plan)      # True (a traced order needs trace=)
        """
        specs = [(p.name, p.spec if self.level else self.param(p.name).spec) for p in self.params]
        paths = [m for u in self.units[1:] for m in u.module_paths]
        tp_opts = dict(compute_axes=self.compute_axes,
                       styles=[(re.escape(m.path), m.style) for m in self.tp_modules]) if self.compute_axes else {}
        pol = self.policies
        pr, off = pol.precision, pol.offload
        return dict(rules=rules_from_specs(specs), mesh=self.mesh, strategy=self.strategy, **tp_opts,
                    units=[re.escape(m) for m in paths], compute_dtype=self.compute_dtype,
                    reduce_dtype=self.reduce_dtype, prefetch=self.prefetch,
                    reshard_after_forward=pol.schedule.reshard_after_forward,
                    optimizer_states=self.optimizer_states, min_unit_bytes=self.min_unit_bytes, order=self.order,
                    **({"layout": self.layout} if self.layout != LayoutChoice.AUTO else {}),
                    **({"offload": self.offload} if off else {}),
                    **({"offload_fraction": off.fraction} if off and off.fraction != 1 else {}),
                    **({"gather_dtype": list(pr.gather_dtype)} if pr.gather_dtype else {}),
                    **({"fp8": list(pr.fp8), "fp8_gather": pr.fp8_gather} if pr.fp8 else {}))

    def to_source(self) -> str:
        """A rules file that rebuilds this plan: ``rules``, ``UNITS`` (the exact modules of its units),
        ``MESH``, ``OPTIONS`` (and ``compute_axes``, ``styles`` with tensor parallelism), which
        ``shardplan plan TARGET --rules FILE`` reads, and ``make_plan(model)`` for Python."""
        d = self.declarative()
        rules, mesh, units = d.pop("rules"), d.pop("mesh"), d.pop("units")
        tp_opts = {k: d.pop(k) for k in ("compute_axes", "styles") if k in d}
        out = [f"# shardplan {self.strategy} on {mesh!r}, plan fingerprint {self.fingerprint()}: rebuild it with",
               "#   shardplan plan TARGET --rules THIS_FILE      (flags given there override the values below)",
               "#   plan = make_plan(model)                       (in Python)",
               "", "import shardplan as sp", rules.to_source().rstrip("\n"), ""]
        out.append("UNITS = " + _wrapped([regex_list_source([u])[1:-1] for u in units]))
        out.append(f"MESH = sp.{mesh!r}")
        if tp_opts:
            out.append(f"compute_axes = {tp_opts['compute_axes']!r}")
            out.append("styles = " + _wrapped([f"({regex_list_source([pat])[1:-1]}, {style!r})"
                                               for pat, style in tp_opts["styles"]]))
        out.append("OPTIONS = " + _wrapped([f"{k}={v!r}" for k, v in d.items()], "dict(", ")"))
        out += ["", "",
                "def make_plan(model):",
                "    return sp.plan(model, rules, MESH, units=UNITS, **OPTIONS"
                + (", compute_axes=compute_axes, styles=styles)" if tp_opts else ")"), ""]
        return "\n".join(out)


def _wrapped(items: Sequence[str], open_: str = "[", close: str = "]", width: int = 88) -> str:
    """``[a, b, ...]`` as source: one line when it fits, else several items per indented line."""
    one = open_ + ", ".join(items) + close
    if len(one) <= width:
        return one
    lines, line = [], ""
    for item in items:
        if line and len(line) + len(item) + 2 > width - 4:
            lines.append(line)
            line = ""
        line += (" " if line else "") + item + ","
    lines.append(line)
    return open_ + "\n" + "\n".join("    " + l for l in lines) + "\n" + close
