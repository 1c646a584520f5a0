"""The marks ``fully_shard`` leaves on modules (``module.__dict__[_MARK]``: each call's options, its owner and
root), the marked modules of a root, and the flags the FSDP2 face shares between its rooms: a compile in
progress, gradient-sync flags set (and checked at the root's forward), init views open."""

from __future__ import annotations

import torch.nn as nn

from ..errors import ShardingError
from ..runtime.builder import FULLY_SHARD_MARK

_MARK = FULLY_SHARD_MARK
_COMPILING = [False]  # a root's plan is compiling: the modules' overrides step aside
_INIT_VIEWS = [0]  # how many roots' modules hold their init view (each root's list: its options' "init_views")


def _marked(module: nn.Module, recurse: bool) -> list:
    if not recurse:
        return [module]
    return [m for m in module.modules() if _MARK in m.__dict__]


_SYNC_SET = [False]  # set_requires_gradient_sync was called: the root's forwards check the flags agree


def _marked_of_root(root: nn.Module) -> list:
    """``(name, module)`` of every marked module under a compiled root, walked once (the structure is fixed
    once the plan compiled): torchtitan calls ``set_requires_gradient_sync`` at every micro-step."""
    got = root.__dict__[_MARK].get("marked_modules")
    if got is None:
        got = root.__dict__[_MARK]["marked_modules"] = [(name or "<root>", m) for name, m in root.named_modules()
                                                        if _MARK in m.__dict__]
    return got


def _check_sync_flags(root: nn.Module) -> None:
    """At the root's forward: the modules' gradient-sync flags agree (checked again only after a change)."""
    if not _SYNC_SET[0] or root.__dict__[_MARK].get("sync_checked"):
        return
    flags = {}
    for name, m in _marked_of_root(root):
        flags.setdefault(m.__dict__[_MARK].get("sync", True), []).append(name)
    if len(flags) <= 1:
        root.__dict__[_MARK]["sync_checked"] = True
    if len(flags) > 1:
        raise ShardingError(f"set_requires_gradient_sync: shardplan synchronises the gradients of the whole model at "
                            f"once, but modules {flags[False][:5]} have requires_gradient_sync=False and "
                            f"{flags[True][:5]} True. Call model.set_requires_gradient_sync(flag) on the root "
                            f"(recurse=True)")
