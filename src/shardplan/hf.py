"""Hugging Face models: from a ``config.json`` alone, on the meta device (plan a 70B model on a laptop), and
their attention made to capture as it runs eagerly.

>>> model = shardplan.hf.model_from_config("path/to/config.json")     # or a model folder; no weights, no memory
>>> plan = sp.plan(model, sp.auto_rules(model, mesh), mesh, units=[shardplan.hf.block_class(model)])
>>> shardplan.hf.capturable_attention(model)    # before sp.capture: the same attention kernel captured as eager

Needs the ``transformers`` package (``pip install shardplan[hf]``).
"""

from __future__ import annotations

import json
import os
import re
import sys
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


CAPTURABLE_SDPA = "shardplan_sdpa"
"""The attention implementation :func:`capturable_attention` registers with transformers: its ``"sdpa"``."""

# [Note: transformers' causal mask under a CUDA-graph capture] transformers 5.0 to 5.17 decide whether SDPA may
# use ``is_causal=True`` (no mask tensor: the flash kernel) with a check that also answers "tracing" while a CUDA
# stream is capturing, so a captured step builds an explicit boolean mask its eager steps never build: SDPA then
# takes a masked kernel (slower, and not bit-identical to the eager step). 5.18 only asks when a padding mask
# is given. The mask function below decides from the arguments' structure alone, as 5.18 does.
_MASK_UNDER_CAPTURE = ((5, 0), (5, 18))


def _version(v: str) -> tuple:
    out = []
    for part in v.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def _causal_or_sdpa_mask(*args, **kwargs):
    """transformers' SDPA mask, or ``None`` (SDPA's own ``is_causal``) for a plain causal mask with no padding
    and as many queries as keys (or one query): decided from shapes, never from tensor values or capture state."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    q = kwargs.get("q_length")
    if q is None and isinstance(kwargs.get("cache_position"), torch.Tensor):  # transformers < 5.17 passes positions
        q = kwargs["cache_position"].shape[0]
    kv = kwargs.get("kv_length")
    if (not args and kwargs.get("allow_is_causal_skip", True) and kwargs.get("attention_mask") is None
            and kwargs.get("mask_function", causal_mask_function) is causal_mask_function
            and kwargs.get("local_size") is None and isinstance(q, int) and isinstance(kv, int) and (q == 1 or q == kv)
            and not isinstance(kwargs.get("q_offset"), torch.Tensor) and not torch.compiler.is_exporting()):
        return None
    return sdpa_mask(*args, **kwargs)


def capturable_attention(model: nn.Module) -> nn.Module:
    """Make a transformers model's SDPA attention capture as it runs eagerly; returns ``model``.

    transformers 5.0 to 5.17 build an explicit causal mask when they see a CUDA-graph capture, where eagerly they
    pass ``is_causal=True``: a step captured with :func:`shardplan.capture` then runs a different, slower attention
    kernel and is not bit-identical to its eager steps (``capture`` refuses such a model, naming this function).
    This switches the model to ``"shardplan_sdpa"``: transformers' own SDPA attention with a mask function that
    decides from shapes alone (no padding mask and a plain causal mask: ``is_causal=True``; anything else,
    sliding-window layers included: transformers' SDPA mask). Eagerly it computes what ``"sdpa"`` computes, bit
    for bit. A model whose modeling code compares its implementation with ``"sdpa"`` by name is refused
    ([Note: a model that asks for "sdpa" by name]).

    >>> model = transformers.LlamaForCausalLM(config)         # attn_implementation="sdpa", the default
    >>> shardplan.hf.capturable_attention(model)
    >>> step = sp.capture(train_step)
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        raise PlanError("hf.capturable_attention needs transformers 4.53 or later (its AttentionInterface and "
                        "AttentionMaskInterface): pip install -U transformers") from None
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl == CAPTURABLE_SDPA:
        return model
    if impl != "sdpa":
        raise PlanError(f"hf.capturable_attention: {type(model).__name__} uses attn_implementation={impl!r}; it "
                        f"changes the SDPA path only. Use model.set_attn_implementation('sdpa') first if SDPA is what "
                        f"you want captured, or capture the model as it is")
    named = _asks_for_sdpa_by_name(model)
    if named:
        cls, path = named
        raise PlanError(f"hf.capturable_attention: {cls} compares attn_implementation with 'sdpa' by name in its own "
                        f"code ({path}): under the name {CAPTURABLE_SDPA!r} it would take another path than under "
                        f"'sdpa' (Gemma 4 slices its queries where a causal mask was skipped: other logits, silently). "
                        f"Capture it with attn_implementation='sdpa' as it is (transformers 5.18 or later), or with "
                        f"model.set_attn_implementation('eager')")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    AttentionInterface.register(CAPTURABLE_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAPTURABLE_SDPA, _causal_or_sdpa_mask)
    model.set_attn_implementation(CAPTURABLE_SDPA)
    return model


# [Note: a model that asks for "sdpa" by name] some transformers models decide by the implementation's name, not
# by the mask they got (Gemma 4's KV-shared layers: ``_attn_implementation == "sdpa"`` keeps all queries where a
# mask is None). Under another name they compute otherwise than under "sdpa": their modeling file is searched
_SDPA_BY_NAME = re.compile(r"""_attn_implementation\s*(?:==|!=)\s*["']sdpa["']"""
                           r"""|["']sdpa["']\s*(?:==|!=)\s*[\w.]*_attn_implementation"""
                           r"""|_attn_implementation\s+(?:not\s+)?in\s*[\[({][^\])}]*["']sdpa["']""")


def _asks_for_sdpa_by_name(model: nn.Module) -> Optional[tuple[str, str]]:
    """``(class name, modeling file)`` of a module of ``model`` whose transformers modeling file compares the
    attention implementation with ``"sdpa"`` by name, or ``None``."""
    seen: set = set()
    for m in model.modules():
        name = type(m).__module__
        if name in seen or not name.startswith("transformers.models."):
            continue
        seen.add(name)
        path = getattr(sys.modules.get(name), "__file__", None)
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except (OSError, TypeError):
            continue
        if _SDPA_BY_NAME.search(source):
            return type(m).__name__, os.path.relpath(path, os.path.dirname(os.path.dirname(os.path.dirname(path))))
    return None


def _transformers_version() -> Optional[str]:
    """The version of transformers if a model of it can exist here (it was imported), else ``None``."""
    import sys
    tf = sys.modules.get("transformers")
    return None if tf is None else str(getattr(tf, "__version__", "0"))


def capture_problem(module: Optional[nn.Module]) -> Optional[str]:
    """Why capturing ``module`` would not run what its eager steps run (the installed transformers builds a mask
    under capture only; [Note: transformers' causal mask under a CUDA-graph capture]), or ``None``."""
    version = _transformers_version()
    if module is None or version is None:
        return None
    lo, hi = _MASK_UNDER_CAPTURE
    if not lo <= _version(version) < hi:
        return None
    for name, m in module.named_modules():
        impl = getattr(getattr(m, "config", None), "_attn_implementation", None)
        if impl == "sdpa" and type(m).__module__.startswith("transformers."):
            where = f"{type(m).__name__} at {name!r}" if name else type(m).__name__
            return (f"transformers {version} builds an explicit causal mask under a CUDA-graph capture and none "
                    f"eagerly: the captured attention of {where} (attn_implementation='sdpa') would run another kernel "
                    f"than the eager steps, slower and not bit-identical. Call shardplan.hf.capturable_attention(model) "
                    f"before capturing, or upgrade transformers to 5.18 or later")
    return None
