"""How a training step calls a model and what it differentiates, and activation checkpointing unit by unit: the
one call the planner's trace, the rehearsal and the benchmarks share.

>>> args, kwargs = token_inputs(model, tokens), {}     # Hugging Face: ((), {"input_ids": ..., "labels": ...})
>>> loss = scalar_of(model(tokens, tokens))             # a scalar output, an output's .loss, else a stand-in mean
"""

from __future__ import annotations

from typing import Any, Sequence

from .optraffic import tensors_in as _tensors
from .units import entry_points, has_forward


def scalar_of(output: Any):
    """The number a training step differentiates: a scalar output itself, a model output's ``.loss``
    (Hugging Face), else the mean of the first output tensor in fp32 (a stand-in loss for a model that
    returns logits). The rehearsal and the activation profile use the same one."""
    import torch
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    ts = _tensors(output, [])
    if not ts:
        raise TypeError(f"the model's output ({type(output).__name__}) holds no tensor to differentiate")
    t = ts[0]
    return t if t.numel() == 1 else t.float().mean()


def token_inputs(model, tokens):
    """How a training step calls ``model`` on a (B, T) token tensor, as ``trace=`` takes it: Hugging Face
    style (a ``forward`` with ``input_ids`` and ``labels``) ``((), {"input_ids": tokens, "labels": tokens})``;
    a ``forward(tokens, targets)`` (a second parameter named targets/target/labels/y) ``(tokens, tokens)``;
    else ``tokens``. The rehearsal and ``--trace-tokens`` use the same call, so the traced activations are
    the rehearsed step's.

    >>> token_inputs(gpt.tiny(), torch.zeros(1, 64, dtype=torch.long, device="meta"))   # (tokens, tokens)
    """
    import inspect
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return tokens
    if "input_ids" in names and "labels" in names:
        return (), {"input_ids": tokens, "labels": tokens}
    if len(names) >= 2 and names[1] in ("targets", "target", "labels", "y"):
        return tokens, tokens
    return tokens


def unit_entries(model, units: Sequence[tuple[str, Sequence[str]]]) -> dict[str, list[str]]:
    """unit -> the module paths whose calls are the unit's forward (the runtime's hooks sit there)."""
    unit_paths = [p for _, paths in units for p in paths]
    out = {}
    for name, paths in units:
        entries: list[str] = []
        for p in paths:
            entries += [p] if has_forward(model.get_submodule(p)) else entry_points(model, p, unit_paths)
        out[name] = entries
    return out


def checkpoint_units(model, entries: dict[str, list[str]], recompute_mode=None) -> list:
    """Wrap each unit's entry modules' forward in ``torch.utils.checkpoint`` (non-reentrant): activation
    checkpointing per unit. Returns ``[(module, original forward)]`` to undo it (:func:`undo_checkpoint`).
    ``recompute_mode``: makes a context manager the recompute in backward runs under (checkpoint's
    ``context_fn``): a ``TorchFunctionMode`` active around the step is not active in the backward."""
    import contextlib
    import torch.utils.checkpoint as ckpt
    extra = {} if recompute_mode is None else {"context_fn": lambda: (contextlib.nullcontext(), recompute_mode())}
    done = []
    for paths in entries.values():
        for p in paths:
            m = model.get_submodule(p)
            original = m.forward

            def wrapped(*args, _f=original, **kwargs):
                return ckpt.checkpoint(_f, *args, use_reentrant=False, **extra, **kwargs)
            m.forward = wrapped
            done.append((m, original))
    return done


def undo_checkpoint(done: list) -> None:
    for m, original in done:
        if m.__dict__.get("forward") is not None:
            del m.__dict__["forward"]
        if m.forward != original:  # a forward set on the instance before us
            m.forward = original
