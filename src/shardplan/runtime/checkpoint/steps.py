"""A run's checkpoints: one directory per step under a root, the newest complete one, the last K kept.

>>> sp.checkpoint.save(sp.checkpoint.step_dir("ckpt", step), model, opt, step=step)
>>> sp.checkpoint.prune("ckpt", keep=3)          # rank 0 removes older ones and unfinished saves
>>> path = sp.checkpoint.latest("ckpt")          # the newest complete checkpoint, or None

A checkpoint is complete when its completion marker is there: :func:`~.dcp_io.publish_atomic` writes it
last, after every rank's data, and renames the directory into place after that, so a run killed at
any moment leaves only complete checkpoints under their step names (and maybe a ``.tmp-`` directory,
which :func:`latest` ignores and :func:`prune` removes).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from typing import Optional

from .. import collectives as C
from .diagnose import MARKER
from ...errors import CheckpointError
from .async_io import inflight_paths

_STEP = re.compile(r"^step_(\d+)$")


def step_dir(root: str, step: int) -> str:
    """``root/step_00000100``: the directory of the checkpoint after ``step`` steps (names sort by step)."""
    return os.path.join(root, f"step_{step:08d}")


def complete(root: str) -> list[tuple[int, str]]:
    """``[(step, path)]`` of the complete checkpoints under ``root``, oldest first."""
    out = []
    for path in glob.glob(os.path.join(glob.escape(root), "step_*")):
        m = _STEP.match(os.path.basename(path))
        if m and os.path.isfile(os.path.join(path, MARKER)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest(root: str) -> Optional[str]:
    """The newest complete checkpoint under ``root`` (``None``: none yet)."""
    done = complete(root) if os.path.isdir(root) else []
    return done[-1][1] if done else None


def prune(root: str, keep: int) -> list[str]:
    """Keep the newest ``keep`` complete checkpoints under ``root``; remove older ones and what killed saves
    left (``.tmp-`` / ``.old-`` directories; not the one an asynchronous save of this process is writing
    into). Only global rank 0 removes anything (call it on every rank or
    on rank 0, after a save returned); returns what it removed.
    """
    if keep < 1:
        raise CheckpointError(f"keep={keep}: keep at least the newest checkpoint (keep >= 1)")
    if C.world().rank != 0 or not os.path.isdir(root):
        return []
    done = complete(root)
    gone = [p for _, p in done[:-keep]]
    writing = {os.path.abspath(p) for p in inflight_paths()}  # an asynchronous save of this process writes there
    gone += [p for p in glob.glob(os.path.join(glob.escape(root), "step_*"))
             if re.search(r"\.(tmp|old)-[0-9a-f]+$", p) and os.path.abspath(p) not in writing]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
