"""The compute axes at run time: how each installs itself on a sharded model (``shard()`` calls :func:`install`),
by the kind names of :mod:`shardplan.planner.axes`. Expert and context parallelism are here; tensor
parallelism installs with the device meshes it needs (``runtime/tensor_parallel.py``, called by the faces).
A new axis registers its installer, which typically hooks the modules that issue its collectives and runs
each through the executor (:class:`~.axis_ops.AxisOps`).

>>> register("fx", lambda module, plan, groups, exe: [])   # returns the hooks' handles
"""

from __future__ import annotations

from typing import Callable

from . import context_parallel as CP
from . import expert_parallel as EP

Installer = Callable[..., list]  # (module, plan, groups, exe) -> handles


def _experts(module, plan, groups, exe) -> list:
    EP.install(module, plan, groups, exe)  # expert modules find their ep group (dispatch / combine)
    return []


def _context(module, plan, groups, exe) -> list:
    return CP.install(plan, groups, module, exe)  # context-parallel attention finds the cp group


_INSTALLERS: dict[str, Installer] = {"ep": _experts, "cp": _context}


def register(kind: str, install: Installer) -> Installer:
    """Install axis ``kind`` with ``install(module, plan, groups, exe) -> handles`` on every later ``shard()``."""
    if kind in _INSTALLERS:
        raise ValueError(f"a run-time installer for compute axis {kind!r} is registered already")
    _INSTALLERS[kind] = install
    return install


def unregister(kind: str) -> None:
    _INSTALLERS.pop(kind, None)


def install(module, plan, groups, exe) -> list:
    """Every registered axis installed for ``plan`` on ``module``; the handles of the hooks they made."""
    return [h for fn in list(_INSTALLERS.values()) for h in fn(module, plan, groups, exe)]
