"""How a rehearsal initialises the model it materialises one unit at a time on meta start-up
(:class:`RehearsalInit`: ``init_fn``, Hugging Face's ``_init_weights``, ``reset_parameters``, else a generic
init, said in the notes), and the buffers left on the meta device, filled."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn


def _fill_meta_buffers(model: nn.Module, device: torch.device) -> list[str]:
    """Non-parameter buffers still on the meta device (the rehearsal built the model there) get ones on
    ``device``: their values cannot matter to a rehearsal's memory and time, nor to a loss it does not show."""
    filled = []
    for path, mod in model.named_modules():
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            if b.device.type == "meta":
                mod._buffers[name] = torch.ones(b.shape, dtype=b.dtype, device=device)
                filled.append(f"{path}.{name}" if path else name)
            elif b.device != device:
                mod._buffers[name] = b.to(device)
    return filled


GENERIC_INIT = ("normal(0, 0.02) for matrices, ones for the weights and scales of vectors (norms), zeros for biases "
                "and other vectors")


class RehearsalInit:
    """How the rehearsal initialises each module it materialises (``init_fn(module)`` of :func:`shard`, called
    once per module that owns parameters, one unit at a time): ``init_fn`` when given; else a Hugging Face
    model's own ``_init_weights(module)`` (what ``post_init`` runs, one module at a time instead of the whole
    model); else the module's ``reset_parameters()``; and a parameter none of these wrote (a norm without
    ``reset_parameters``, GPT-2's ``Conv1D``, a module HF's ``_init_weights`` does not know) gets the generic
    rehearsal initialisation (:data:`GENERIC_INIT`). :meth:`describe` says which, for the output.

    [Note: what was written] every floating-point parameter of the module is filled with NaN first; one
    still NaN after the module's own initialisation was not written by it. The values cannot change a
    rehearsal's memory or time, but uninitialised memory can hold NaNs and denormals, which can."""

    def __init__(self, model: nn.Module, init_fn: Optional[Callable[[nn.Module], None]] = None):
        self.user = init_fn
        hf = getattr(model, "_init_weights", None)
        self.hf = hf if callable(hf) and hasattr(model, "config") else None
        self.model_name = type(model).__name__
        self.paths = {id(m): n for n, m in model.named_modules()}
        self.counts = {"init_fn": 0, "hf": 0, "reset": 0}
        self.generic: list[str] = []  # "path (Class)" of the modules with parameters the generic init wrote

    def __call__(self, m: nn.Module) -> None:
        if self.user is not None:
            self.user(m)
            self.counts["init_fn"] += 1
            return
        own = [(n, p) for n, p in m.named_parameters(recurse=False) if p.is_floating_point()]
        for _, p in own:
            p.fill_(float("nan"))
        if self.hf is not None:
            self.hf(m)
            self.counts["hf"] += 1
        elif callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
            self.counts["reset"] += 1
        left = [(n, p) for n, p in own if bool(torch.isnan(p).any())]
        for n, p in left:
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif n in ("weight", "scale", "gamma", "g"):
                p.fill_(1.0)
            else:
                p.zero_()
        if left:
            path = self.paths.get(id(m), "?") or "<root>"
            self.generic.append(f"{path} ({type(m).__name__}: {', '.join(n for n, _ in left)})")

    def describe(self) -> str:
        """One line: which initialisation the rehearsal used, and where the generic one."""
        parts = []
        if self.counts["init_fn"]:
            parts.append(f"init_fn for {self.counts['init_fn']} module(s)")
        if self.counts["hf"]:
            parts.append(f"Hugging Face's own {self.model_name}._init_weights, one module at a time, for "
                         f"{self.counts['hf']} module(s)")
        if self.counts["reset"]:
            parts.append(f"reset_parameters() for {self.counts['reset']} module(s)")
        if self.generic:
            shown = ", ".join(self.generic[:4]) + (f" and {len(self.generic) - 4} more" if len(self.generic) > 4 else "")
            parts.append(f"the generic rehearsal initialisation ({GENERIC_INIT}) for {len(self.generic)} module(s) "
                         f"with no initialisation of their own, or parameters it left unwritten: {shown}")
        return "initialisation: " + ("; ".join(parts) if parts else "no parameters were materialised")
