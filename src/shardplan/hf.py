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
    """The ``transformers`` causal LM a ``config.json`` (or a folder holding one) describes (an
    encoder-decoder's ``...ForConditionalGeneration`` for T5-like configs), built on the meta device;
    ``dtype`` overrides the config's ``torch_dtype``."""
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
    # a causal LM where the config has one (Llama, GPT-2, Mixtral, ...), else an encoder-decoder LM (T5, BART)
    if type(cfg) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        auto = transformers.AutoModelForCausalLM
    elif type(cfg) in transformers.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING:
        auto = transformers.AutoModelForSeq2SeqLM
    else:
        raise PlanError(f"{path}: model_type {d['model_type']!r} has no causal or sequence-to-sequence LM class in "
                        f"transformers {transformers.__version__}; build the model in a function and pass "
                        f"path/to/file.py:fn instead")
    import torch._dynamo  # noqa: F401  (transformers imports it lazily; torch 2.6 cannot import it under meta)
    with torch.device("meta"):
        model = auto.from_config(cfg)
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
