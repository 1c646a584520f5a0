"""Hugging Face's ``"shardplan_cp"`` attention: transformers' ``AttentionInterface`` function that runs
:func:`~shardplan.runtime.context_attention.attention` under context parallelism and transformers' sdpa (or,
with soft-capping, its eager semantics) outside it, with the model's sliding windows either way.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..errors import PlanError, RuntimeShardingError
from ..units import tracing
from .context_attention import attention
from .context_group import active, positions

HF_ATTENTION = "shardplan_cp"  # the name shardplan's attention is registered under in Hugging Face's AttentionInterface

# [Note: Hugging Face attention under cp. A transformers model picks its attention function by name
# (config._attn_implementation) from AttentionInterface, which any library may extend. Under this name the
# model's attention calls attention(): keys and values gathered over cp, the causal mask of the full-sequence
# positions, narrowed to the layer's sliding window (_layer_window). The name is not in AttentionMaskInterface,
# so transformers builds no mask for it (its own masks, made from this rank's local positions, would be wrong
# under cp): every mask the model would build is rebuilt here. Transformers 5.x then passes no mask at all, the
# caller's 2-D padding mask included: under cp the model's call is checked for padding instead
# (context_group._no_padding); outside cp a padded batch is not seen here (tests/test_review49.py's xfail).
# Outside context parallelism it is Hugging Face's sdpa function with the same window mask transformers gives
# sdpa, and refuses packed position_ids, which sdpa would need a mask for, instead of attending without it.
# Soft-capped logits (softcap=, Gemma2) are transformers' eager attention's, which sdpa refuses.]

_CHECKED = weakref.WeakValueDictionary()  # what was last found fine, by role (each layer gets the same tensors)
_VERSIONS: dict = {}  # role -> the version counter of the tensor found fine


def _checked(role: str, t: torch.Tensor) -> bool:
    """Whether ``t`` was found fine for ``role`` already, unchanged since. [Note: a buffer the caller refills in
    place (a preallocated attention_mask, padded this time) is the same object: its version counter tells]"""
    try:
        version = t._version
    except RuntimeError:  # (an inference tensor keeps no version counter: checked every time)
        return False
    if _CHECKED.get(role) is t and _VERSIONS.get(role) == version:
        return True
    _CHECKED[role], _VERSIONS[role] = t, version
    return False


def _name(module) -> str:
    idx = getattr(module, "layer_idx", None)
    return f"{type(module).__name__}" + (f" (layer {idx})" if isinstance(idx, int) else "")


def _hf_refuse(module, what: str, fix: str):
    """The refusal of a call: a :class:`PlanError` in the planner's traced step (before any process starts),
    a :class:`RuntimeShardingError` at the first step otherwise."""
    error = PlanError if tracing() else RuntimeShardingError
    return error(f"Hugging Face attention {HF_ATTENTION!r} in {_name(module)} {what}; {fix}")


# the arguments transformers' attention functions take that this one cannot honour, by what they are
UNSUPPORTED = {"s_aux": "attention sinks", "sinks": "attention sinks", "position_bias": "a position bias"}


def _layer_window(module, kwargs) -> Optional[int]:
    """The sliding window this attention module's layer uses (``None``: full causal attention), as the model's
    own mask would apply it: the ``sliding_window=`` argument where the model passes one (Mistral, Qwen2,
    Gemma2/3; ``None`` there is a full layer, as Exaone4 says of its global layers while every module keeps the
    window as its attribute), else the module's ``sliding_window`` attribute (Qwen2-MoE sets it on its sliding
    layers and passes the window through the mask only), else ``config.layer_types`` at the module's ``layer_idx``.

    [Note: a window passed through the mask only] transformers builds no mask for an attention name it does
    not know, so a model that windows a layer through its mask alone would attend fully here, silently. A
    config with a window that none of the above places on this layer (PhiMoE masks every layer with
    ``config.sliding_window`` and says so nowhere else; other models keep a window in the config unused) is
    refused, naming the fix, rather than guessed.]"""
    if "sliding_window" in kwargs:  # the model's word, None included (Exaone4 keeps the window on every module)
        window = kwargs["sliding_window"]
        return int(window) if window is not None else None
    window = getattr(module, "sliding_window", None)
    if window:
        return int(window)
    cfg = getattr(module, "config", None)
    types, idx = getattr(cfg, "layer_types", None), getattr(module, "layer_idx", None)
    if types is not None and isinstance(idx, int) and 0 <= idx < len(types):
        if types[idx] == "sliding_attention":
            if not getattr(cfg, "sliding_window", None):
                raise _hf_refuse(module, f"is a sliding layer (config.layer_types[{idx}]) without a window "
                                 f"(config.sliding_window={getattr(cfg, 'sliding_window', None)!r})",
                                 "set config.sliding_window, or make the layer 'full_attention'")
            return int(cfg.sliding_window)
        if types[idx] != "full_attention":
            raise _hf_refuse(module, f"is a {types[idx]!r} layer (config.layer_types[{idx}])",
                             "it runs full or sliding-window attention only; use another attention without the cp "
                             "axis")
        return None
    if hasattr(module, "sliding_window") or not getattr(cfg, "sliding_window", None):
        return None  # (the module says it attends fully, or there is no window)
    raise _hf_refuse(module, f"cannot tell whether its layer uses config.sliding_window={cfg.sliding_window} (the "
                             f"model passes no sliding_window= argument, the module has no sliding_window attribute "
                             f"and the config no layer_types)",
                     "set the window each attention module uses as its sliding_window attribute (None for full "
                     "attention), e.g. `for layer in model.model.layers: layer.self_attn.sliding_window = "
                     "config.sliding_window` where the model masks every layer with it")


def _variant(module, kwargs: dict, is_causal) -> tuple[bool, Optional[int], Optional[float]]:
    """``(causal, window, softcap)`` of this call, the arguments it cannot honour refused (naming the module and
    the attribute). The soft-cap is the ``softcap=`` argument only, as in transformers' eager attention (Gemma3
    keeps ``attn_logit_softcapping`` on its modules and never passes it: neither applies it)."""
    for key, what in UNSUPPORTED.items():
        if kwargs.get(key) is not None:
            attr = next((a for a in ("sinks", "s_aux") if key in ("s_aux", "sinks") and hasattr(module, a)), None)
            raise _hf_refuse(module, f"was given {key}= ({what}{f', its attribute {attr!r}' if attr else ''})",
                             "it runs causal attention (a sliding window and soft-capped logits included) only: "
                             "use the model's own attention without the cp axis")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = _layer_window(module, kwargs)
    if window is not None and not causal:
        raise _hf_refuse(module, f"slides a window of {window} over bidirectional attention (is_causal=False)",
                         "it runs causal sliding windows only; use the model's own attention without the cp axis")
    softcap = kwargs.get("softcap")
    for key in ("sliding_window", "softcap"):
        kwargs.pop(key, None)
    return causal, window, (float(softcap) if softcap is not None else None)


def _check_mask(module, attention_mask) -> None:
    if attention_mask is not None and not (attention_mask.ndim == 2 and (_checked("mask", attention_mask)
                                                                       or bool(attention_mask.all()))):
        if attention_mask.ndim == 2:
            _CHECKED.pop("mask", None)
        raise _hf_refuse(module, f"got an attention_mask (shape {tuple(attention_mask.shape)}) that masks tokens",
                         "context-parallel attention runs the causal mask of the full sequence only: train on unpadded "
                         "(or packed-free) batches without attention_mask, or without the cp axis")


def _check_positions(module, position_ids, g, t: int) -> None:
    """``position_ids`` are 0..T-1 outside cp (``g`` None), this rank's positions of the full sequence under it."""
    if g is None:
        if position_ids is not None and not _checked("positions_plain", position_ids):
            if not bool((position_ids == torch.arange(position_ids.shape[-1], device=position_ids.device)).all()):
                _CHECKED.pop("positions_plain", None)
                raise _hf_refuse(module, "got position_ids other than 0..T-1 outside context parallelism (packed "
                                 "sequences?)", "use attn_implementation='sdpa' for such batches")
        return
    if position_ids is None:
        raise _hf_refuse(module, "got no position_ids under context parallelism",
                         "pass position_ids=pos[None] (pos from sp.context_parallel.shard_batch): without them the "
                         "model numbers each rank's chunks 0..T/cp-1")
    if not _checked("positions", position_ids):
        want = positions(t * g.size, g.size, g.group.rank, device=position_ids.device)
        if position_ids.shape[-1] != t or not bool((position_ids == want).all()):
            _CHECKED.pop("positions", None)
            raise _hf_refuse(module, f"got position_ids that are not this rank's positions {want.tolist()[:8]}...",
                             "pass position_ids=pos[None] with pos from sp.context_parallel.shard_batch")


def _sdpa_mask(t: int, window: int, device) -> Optional[torch.Tensor]:
    """The mask transformers gives sdpa for a sliding window over ``t`` positions (``[1, 1, t, t]``): none while
    the window covers every key (masking_utils skips it, and sdpa runs ``is_causal``)."""
    if t < window:
        return None
    pos = torch.arange(t, device=device)
    return ((pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window))[None, None]


def _hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                  **kwargs):
    """The ``AttentionInterface`` function registered as ``"shardplan_cp"`` (:func:`hf_attention`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    causal, window, softcap = _variant(module, kwargs, is_causal)
    _check_mask(module, attention_mask)
    g = active()
    if not tracing():
        _check_positions(module, kwargs.get("position_ids"), g, query.shape[-2])
    extra = {"enable_gqa": True} if getattr(module, "num_key_value_groups", 1) > 1 else {}
    if g is None and not tracing() and softcap is None:  # transformers' sdpa, its window mask included
        mask = _sdpa_mask(query.shape[-2], window, query.device) if window is not None else None
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = attention(query, key, value, dropout_p=dropout, is_causal=causal, scale=scaling, window=window,
                    softcap=softcap, **extra)
    return out.transpose(1, 2).contiguous(), None


def hf_attention() -> str:
    """Register shardplan's context-parallel attention with Hugging Face's ``AttentionInterface`` and return
    its name, ``"shardplan_cp"``: build the model with it (or switch a built one) to train it on a ``cp`` axis.

    >>> cfg = transformers.LlamaConfig(..., attn_implementation=sp.context_parallel.hf_attention())
    >>> model.set_attn_implementation(sp.context_parallel.hf_attention())   # or on a built model

    Under a plan with cp > 1 it gathers keys and values over cp like :func:`attention` (pass
    ``position_ids`` from :func:`shard_batch`; no padding mask), with the layer's sliding window and soft-capped
    logits where the model has them; otherwise it is Hugging Face's ``"sdpa"`` (with soft-capping, its eager
    attention's semantics: transformers' sdpa refuses ``softcap``)."""
    from transformers import AttentionInterface
    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    return HF_ATTENTION
