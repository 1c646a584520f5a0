"""Hugging Face models from a ``config.json`` alone, on the meta device: plan a 70B model on a laptop.

>>> model = shardplan.hf.model_from_config("path/to/config.json")     # or a model folder; no weights, no memory
>>> plan = sp.plan(model, sp.auto_rules(model, mesh), mesh, units=[shardplan.hf.block_class(model)])

Needs the ``transformers`` package (``pip install shardplan[hf]``).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.nn as nn

from .errors import PlanError


def model_from_config(path: str, *, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """The ``transformers`` causal LM a ``config.json`` (or a folder holding one) describes, built on the
    meta device; ``dtype`` overrides the config's ``torch_dtype``."""
    try:
        import transformers
    except ImportError:
        raise PlanError("hf: targets need the transformers package: pip install 'shardplan[hf]'") from None
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise PlanError(f"no config file at {path!r}")
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); a Hugging "
                            f"Face config.json is one JSON object") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise PlanError(f"{path} has no model_type; it must be a Hugging Face config.json")
    cfg = transformers.AutoConfig.for_model(**d)
    import torch._dynamo  # noqa: F401  (transformers imports it lazily; torch 2.6 cannot import it under meta)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    if dtype is not None:
        model.to(dtype)
    return model


def block_class(model: nn.Module) -> Optional[type]:
    """The class of the repeated blocks: of the ``ModuleList`` whose same-class elements hold the most
    parameters (a decoder's layers, not the experts inside them)."""
    best, size = None, 0
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 1 and len({type(m) for m in mod}) == 1:
            n = sum(p.numel() for p in mod.parameters())
            if n > size:
                best, size = type(mod[0]), n
    return best
