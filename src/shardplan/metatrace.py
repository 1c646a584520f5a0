"""What a traced training step on the meta device needs of the model's call (the planner's ``trace=``,
the activation profile, the rehearsal's steps): no KV cache, and the few reads of values a meta tensor
has not got.

* ``use_cache``: a forward that takes it (Hugging Face models, whose default is ``True``) is called with
  ``use_cache=False``, as a training step calls it. With a cache, each call appends its keys and values
  to a ``DynamicCache``; the activation profile's checkpointed pass recomputes every unit, which appends
  them again (``CheckpointError: Recomputed values ... different metadata``, or eager attention's
  broadcast error over twice the keys), and the cache would hold every layer's keys and values until the
  output dies, which a training step does not. The forward of a context-parallel model gets the same
  (runtime/context_group.py): a cache there would hold this rank's chunks only, and a sliding-window cache
  slices them (transformers' own training with ``use_cache=False``).
* :class:`MetaTrace`, a dispatch mode active while shardplan runs a model on meta tensors:

  - a scalar read of a meta **bool** tensor (``bool(t)``, ``if t.all():``, ``t.item()``) answers
    ``True``. [Note: data-dependent checks] the ones Hugging Face makes before it computes ask whether the
    batch is plain (``(packed_sequence_mask[:, -1] == 0).all()``: no packed sequences; ``padding_mask.all()``:
    no padding), which is what a token batch without values stands for, and what HF answers itself
    when it traces (``is_tracing``). Any other scalar read (``int(t.max())``, a count of tokens per expert)
    raises :class:`~shardplan.errors.PlanError` naming the code that asked, since no answer is right.
  - ``torch._grouped_mm`` (Hugging Face's MoE experts) of fp32 or fp16 inputs: torch's meta kernel
    checks the CUDA kernel's dtype (bf16 only) although the shapes do not depend on it; the output's shape
    is taken from the bf16 kernel and its dtype is the inputs' (what the CPU kernel returns).
"""

from __future__ import annotations

import inspect
import os
import traceback
from typing import Any, Optional

from .errors import PlanError, ShardingError


def forward_parameters(model) -> list[str]:
    """The names of ``model.forward``'s parameters, in order (``[]``: no signature to read)."""
    try:
        return list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return []


def takes_use_cache(model) -> bool:
    return "use_cache" in forward_parameters(model)


_TRACED_WHY = ("the activation profile's checkpointed pass recomputes each unit, which appends its keys and values "
               "to the cache a second time")


def training_call(model, args: tuple, kwargs: dict, where: str = "trace=", error=PlanError, why: str = _TRACED_WHY,
                  names: Optional[list] = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` as a training step calls ``model``: ``use_cache=False`` added where its forward
    takes ``use_cache`` and the call does not say (see the module's docstring); ``use_cache=True`` refused
    with ``error``, saying ``why``. ``names``: the forward's parameters, read once by a caller that calls often."""
    names = forward_parameters(model) if names is None else names
    if "use_cache" not in names:
        return args, kwargs
    i = names.index("use_cache")
    given = kwargs["use_cache"] if "use_cache" in kwargs else args[i] if i < len(args) else None
    if given is not None:
        if given:
            raise error(
                f"{where} calls {type(model).__name__}.forward with use_cache=True: a training step keeps no KV cache, "
                f"and {why}. Fix: leave use_cache out (shardplan then passes use_cache=False) or pass "
                f"use_cache=False")
        return args, kwargs
    if i < len(args):  # (None, given positionally)
        return args[:i] + (False,) + args[i + 1:], kwargs
    return args, dict(kwargs, use_cache=False)


def _caller() -> str:
    """The innermost frame of the model's code (outside torch and shardplan) on the stack: ``file:line in fn``."""
    here = os.path.dirname(os.path.abspath(__file__))
    import torch
    skip = (here, os.path.dirname(os.path.abspath(torch.__file__)))
    for fr in reversed(traceback.extract_stack()):
        path = os.path.abspath(fr.filename)
        if not path.startswith(skip):
            return f"{fr.filename}:{fr.lineno} in {fr.name} ({(fr.line or '').strip()[:120]!r})"
    return "the model's forward"


def _is_meta(x: Any) -> bool:
    import torch
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def meta_trace():
    """The :class:`MetaTrace` mode (a new one each time: enter it with ``with``)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    import torch

    aten = torch.ops.aten
    grouped = getattr(aten, "_grouped_mm", None)

    class MetaTrace(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is aten._local_scalar_dense.default and args and _is_meta(args[0]):
                if args[0].dtype == torch.bool:
                    return True
                raise PlanError(
                    f"the model reads a value of a tensor while shardplan traces it on the meta device, where tensors "
                    f"have shapes but no values ({args[0].dtype} Tensor.item(), at {_caller()}): a data-dependent "
                    f"branch or size cannot be traced. Fix: trace a model whose forward computes without reading "
                    f"tensor values (an HF MoE: a grouped_mm experts implementation, not a loop over the experts "
                    f"hit), or plan without trace=")
            if grouped is not None and func is grouped.default and len(args) >= 2 and _is_meta(args[0]) \
                    and args[0].dtype in (torch.float32, torch.float16) and args[1].dtype == args[0].dtype:
                dt = args[0].dtype
                low = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.dtype == dt else a for a in args]
                return func(*low, **kwargs).to(dt)
            return func(*args, **kwargs)

    return MetaTrace()


def reraise(model, exc: BaseException, what: str) -> None:
    """A model's traced call failed: shardplan's own errors as they are, anything else as a PlanError naming
    the model, the code that raised and the fix."""
    if isinstance(exc, ShardingError):
        raise exc
    tb = traceback.extract_tb(exc.__traceback__)
    here = os.path.dirname(os.path.abspath(__file__))
    at = next((f"{fr.filename}:{fr.lineno} in {fr.name}" for fr in reversed(tb)
               if not os.path.abspath(fr.filename).startswith(here) and "/torch/" not in fr.filename), "")
    raise PlanError(f"{what} of {type(model).__name__} failed on the meta device: {type(exc).__name__}: "
                    f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                    f"{f' (at {at})' if at else ''}. Fix the model's call (trace= holds its arguments: "
                    f"((), {{'input_ids': ..., 'labels': ...}}) for a Hugging Face model), or plan without trace=") from exc
