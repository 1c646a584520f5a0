"""What rebuilds a plan from its module: the keyword arguments of :func:`shardplan.plan` (:func:`declarative`,
``plan.declarative()``) and a rules file (:func:`to_source`, ``plan.to_source()``). Pure functions over a
:class:`~shardplan.planner.facade.Plan`.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from ..auto import rules_from_specs
from ..rules import regex_list_source
from . import float8 as F8
from . import tensor_parallel as TPX
from .kinds import LayoutChoice


def _reshard_after_forward(plan):
    """One bool when every unit agrees, else ``{unit: False}`` for the units kept gathered."""
    rafs = {u.reshard_after_forward for u in plan.units[1:]}
    if len(rafs) == 1:
        return rafs.pop()
    return plan.reshard_after_forward if not rafs else {u.name: False for u in plan.units[1:] if not u.reshard_after_forward}


def _precision(plan) -> dict[str, Any]:
    """``gather_dtype=`` per parameter and ``fp8=`` per module, where the plan has them."""
    gathers = [(re.escape(p.name), plan.buffers[p.buffer].gather_dtype) for p in plan.params
               if plan.buffers[p.buffer].gather_dtype and not plan.buffers[p.buffer].tensorwise]
    # (the float8 Linears' tensorwise gathers follow from fp8= and fp8_gather=)
    fp8 = [(re.escape(m.path), F8.TORCHAO) for m in plan.fp8_modules]
    return {**({"gather_dtype": gathers} if gathers else {}),
            **({"fp8": fp8, "fp8_gather": any(b.tensorwise for b in plan.buffers)} if fp8 else {})}


def declarative(plan) -> dict[str, Any]:
    """Keyword arguments of :func:`shardplan.plan` that rebuild ``plan`` from its module: rules (one per parameter
    name, block indices generalised), units (exact module paths), options (with the numbers the planner chose:
    ``offload_fraction="auto"``'s fraction, ``min_unit_bytes``).

    >>> sp.plan(model, **plan.declarative()).equivalent(plan)      # True (a traced order needs trace=)
    """
    specs = [(p.name, p.spec) for p in plan.params]
    paths = [m for u in plan.units[1:] for m in u.module_paths]
    tp = TPX.of(plan)
    tp_opts = dict(compute_axes=tp.axes, styles=[(re.escape(m.path), m.style) for m in tp.modules]) if tp.axes else {}
    return dict(rules=rules_from_specs(specs), mesh=plan.mesh, strategy=plan.strategy, **tp_opts,
                units=[re.escape(m) for m in paths], compute_dtype=plan.compute_dtype,
                reduce_dtype=plan.reduce_dtype, prefetch=plan.prefetch,
                reshard_after_forward=_reshard_after_forward(plan),
                optimizer_states=plan.optimizer_states, min_unit_bytes=plan.min_unit_bytes, order=plan.order,
                **({"layout": plan.layout} if plan.layout != LayoutChoice.AUTO else {}),
                **({"offload": plan.offload} if plan.offload else {}),
                **({"offload_fraction": plan.offload_fraction} if plan.offload and plan.offload_fraction != 1 else {}),
                **_precision(plan))


def to_source(plan) -> str:
    """A rules file that rebuilds ``plan``: ``rules``, ``UNITS`` (the exact modules of its units), ``MESH``,
    ``OPTIONS`` (and ``compute_axes``, ``styles`` with tensor parallelism), which
    ``shardplan plan TARGET --rules FILE`` reads, and ``make_plan(model)`` for Python."""
    d = declarative(plan)
    rules, mesh, units = d.pop("rules"), d.pop("mesh"), d.pop("units")
    tp_opts = {k: d.pop(k) for k in ("compute_axes", "styles") if k in d}
    out = [f"# shardplan {plan.strategy} on {mesh!r}, plan fingerprint {plan.fingerprint()}: rebuild it with",
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
