"""The compute axes at run time: how each puts itself in place on a sharded model, by the kind names of
:mod:`shardplan.planner.axes`. Expert and context parallelism are here; tensor parallelism installs with the device
meshes it needs (``runtime/tensor_parallel.py``, called by the faces). A new axis registers its installer, which
typically hooks the modules that issue its collectives and runs each through the executor
(:class:`~.axis_ops.AxisOps`).

Both faces go through this module, so that adding an axis needs no edit in either:

* ``shard()`` calls :func:`install` once; the handles live with the model.
* ``functional_call`` calls :func:`bind` at every call (one module may be called under several plans in turn, and
  keeps no hooks between calls); the handles are removed when the call returns. An axis registered without a
  ``bind`` is installed at every call (its installer is its binder); one whose installer makes state worth
  keeping, or puts in place what must outlive the call (what a checkpoint's recompute in backward reads), gives
  a ``bind`` that puts this plan's state in place and takes other plans' away.

>>> register("fx", lambda module, plan, groups, exe: [])   # returns the hooks' handles
"""

from __future__ import annotations

from typing import Callable, Optional

from . import context_parallel as CP
from . import expert_parallel as EP

Installer = Callable[..., list]  # (module, plan, groups, exe) -> handles


def _experts(module, plan, groups, exe) -> list:
    EP.install(module, plan, groups, exe)  # expert modules find their ep group (dispatch / combine)
    return []


def _context(module, plan, groups, exe) -> list:
    return CP.install(module, plan, groups, exe)  # attention() gathers over cp while the model runs


_INSTALLERS: dict[str, Installer] = {"ep": _experts, "cp": _context}
_BINDERS: dict[str, Installer] = {"ep": EP.bind, "cp": _context}  # (cp: its group is made once per executor)


def register(kind: str, install: Installer, bind: Optional[Installer] = None) -> Installer:
    """Install axis ``kind`` with ``install(module, plan, groups, exe) -> handles`` on every later ``shard()``, and
    ``bind`` (default: ``install``) at every later ``functional_call``."""
    if kind in _INSTALLERS:
        raise ValueError(f"a run-time installer for compute axis {kind!r} is registered already")
    _INSTALLERS[kind] = install
    _BINDERS[kind] = bind or install
    return install


def unregister(kind: str) -> None:
    _INSTALLERS.pop(kind, None)
    _BINDERS.pop(kind, None)


def install(module, plan, groups, exe) -> list:
    """Every registered axis installed for ``plan`` on ``module`` (``shard()``); the handles of the hooks they made."""
    return [h for fn in list(_INSTALLERS.values()) for h in fn(module, plan, groups, exe)]


def bind(module, plan, groups, exe) -> list:
    """Every registered axis put in place for one ``functional_call`` of ``module`` under ``plan`` (other plans'
    taken away); the handles of the hooks they made, which the call removes when it returns."""
    return [h for fn in list(_BINDERS.values()) for h in fn(module, plan, groups, exe)]
