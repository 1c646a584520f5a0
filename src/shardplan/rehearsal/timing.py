"""Timestamps inside a training step: a unit's forward between its hooks, its backward between its
outputs' gradient and its inputs'. CUDA events on a GPU (read after the step synchronises), the host
clock on the CPU."""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn as nn

from ..activations import _tensors


class Clock:
    """Named marks in stream order; :meth:`read` gives ``{name: seconds since the first mark}``."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append((name, e))
        else:
            self.marks.append((name, time.perf_counter()))

    def read(self) -> dict[str, float]:
        if not self.marks:
            return {}
        if self.cuda:
            torch.cuda.synchronize()
            first = self.marks[0][1]
            out = {n: first.elapsed_time(e) / 1e3 for n, e in self.marks}  # type: ignore[union-attr]
        else:
            t0 = self.marks[0][1]
            out = {n: t - t0 for n, t in self.marks}  # type: ignore[operator]
        self.marks = []
        return out


class UnitTimer:
    """Hooks on each unit's entry modules that mark ``fwd0:u``, ``fwd1:u``, ``bwd0:u`` (its outputs'
    gradient arrived) and ``bwd1:u`` (its inputs' gradient left). Registered after ``shard()``'s own hooks,
    so a unit's forward starts once its parameters are gathered."""

    def __init__(self, model: nn.Module, entries: dict[str, list[str]], clock: Clock):
        self.clock, self.in_backward, self.handles = clock, False, []
        for u, paths in entries.items():
            if not paths:
                continue
            first, last = model.get_submodule(paths[0]), model.get_submodule(paths[-1])
            self.handles.append(first.register_forward_pre_hook(self._pre(u), with_kwargs=True))
            self.handles.append(last.register_forward_hook(self._post(u)))

    def _once(self, name: str):
        done = []

        def hook(_g):
            if not done:
                done.append(1)
                self.clock.mark(name)
        return hook

    def _pre(self, u: str):
        def hook(_m, args, kwargs):
            if self.in_backward or not torch.is_grad_enabled():
                return None
            self.clock.mark(f"fwd0:{u}")
            once = self._once(f"bwd1:{u}")
            for t in _tensors((args, kwargs), []):
                if t.requires_grad:
                    t.register_hook(once)
            return None
        return hook

    def _post(self, u: str):
        def hook(_m, _args, out):
            if self.in_backward or not torch.is_grad_enabled():
                return out
            self.clock.mark(f"fwd1:{u}")
            once = self._once(f"bwd0:{u}")
            for t in _tensors(out, []):
                if t.requires_grad:
                    t.register_hook(once)
            return out
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def unit_times(marks: dict[str, float], units: list[str], root: str) -> Optional[dict[str, tuple[float, float]]]:
    """{unit: (forward s, backward s)} from one step's marks; the root gets the rest of the forward and
    the backward (``None`` if the step's own marks are missing)."""
    need = ("step0", "forward1", "backward1")
    if any(k not in marks for k in need):
        return None
    out = {}
    for u in units:
        f = marks.get(f"fwd1:{u}", 0.0) - marks.get(f"fwd0:{u}", 0.0) if f"fwd0:{u}" in marks else 0.0
        b = marks[f"bwd1:{u}"] - marks[f"bwd0:{u}"] if f"bwd0:{u}" in marks and f"bwd1:{u}" in marks else 0.0
        out[u] = (max(f, 0.0), max(b, 0.0))
    fwd = marks["forward1"] - marks["step0"]
    bwd = marks["backward1"] - marks["forward1"]
    out[root] = (max(fwd - sum(f for f, _ in out.values()), 0.0), max(bwd - sum(b for _, b in out.values()), 0.0))
    return out
