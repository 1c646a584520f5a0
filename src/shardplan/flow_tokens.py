"""What :mod:`shardplan.flow`'s check knows of the tokens as a whole under context parallelism: which modules map
each token to its own output (token-local: an expert module whose code is known dropless), and which values are
a rank's *partial* means over the sequence (a loss's mean over this rank's tokens) and what may be computed from
them.

[Note: token-local modules] Under ``cp`` each rank holds 2 of ``2*cp`` chunks of every sequence. A module whose
output row for a token depends on that token's input row alone (a router: logits, softmax and top-k over the
experts; an experts block: each token's top-k experts, weighted, summed) computes the same rows on a chunk as on
the whole sequence, whatever it does inside. A router is checked op by op like everything else: its
operations act along the experts, never the tokens (a capacity-limited router ranks tokens by position, a
``cumsum`` or ``topk`` along them, and stays refused). An experts block regroups the tokens by expert
(``sort``, ``x[perm]``, ``index_add_``, grouped matrix products over per-expert counts) and puts every row back:
token-local, yet each of those operations mixes the token dimension when seen alone. So the check judges an
*expert module* (:func:`is_expert_module`: an integer ``num_experts`` and stacked per-expert weights) whose
token input carries the sequence mark as a whole: it follows the ops inside as usual but holds back a refusal
about the sequence until the module returns, and lets the module through, its outputs marked like its token
input, when the code that ran is known dropless and token-local:

* transformers' experts interface (``@use_experts_implementation`` classes: ``MixtralExperts``,
  ``Qwen2MoeExperts``, ...) running its class's own (``eager``) forward or an implementation transformers itself
  defines (``grouped_mm``, ``batched_mm``; :func:`trusted_experts`);
* or a forward that moved its tokens through ``sp.expert_parallel.dispatch`` and back through ``combine``
  (dropless: every token reaches its experts, no capacity), which report themselves (:func:`FlowCheck.routed`).

Anything else (an experts module of one's own that drops tokens over a capacity, an implementation registered
under another name) gets the held-back refusal, naming why the module was not taken as token-local.

[Note: partial means] A sum or mean over the split sequence is allowed (a loss's mean over tokens: gradients
are averaged over cp, so the ranks' means average to the whole sequence's, the tokens being as many on each).
That holds for what is *linear* in such means only. The result of a reduction over the sequence is a partial
value; sums, differences, negation, scaling by what is not partial, views and casts keep it partial; a product
or quotient of two partial values (Switch/Mixtral's load-balancing loss: the fraction of tokens per expert times
the mean router probability, each over this rank's tokens), or a nonlinear function of one (``NONLINEAR``), is
refused: the mean of the ranks' products is not the product over the whole sequence, and the loss would be wrong
silently. Operations in none of the lists (a hook, ``item()``, an unknown one) drop the partial mark: what they
compute is not followed further.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .units import _num_experts

LINEAR = {"add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__", "__isub__", "sub_", "neg",
          "__neg__", "sum", "mean", "nansum", "nanmean", "view", "reshape", "flatten", "squeeze", "unsqueeze", "to",
          "float", "double", "half", "bfloat16", "type_as", "clone", "contiguous", "detach", "__getitem__", "select",
          "stack", "cat", "expand", "expand_as", "broadcast_to", "zeros_like", "empty_like", "ones_like", "full_like",
          "requires_grad_", "cpu", "cuda"}
SCALE = {"mul", "__mul__", "__rmul__", "__imul__", "mul_", "div", "__truediv__", "__itruediv__", "div_", "true_divide"}
PRODUCT = {"matmul", "__matmul__", "mm", "bmm", "dot", "vdot", "inner", "outer", "einsum", "mv"}
NONLINEAR = {"exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "pow", "__pow__", "__rpow__", "__ipow__", "sqrt",
             "rsqrt", "square", "reciprocal", "sigmoid", "tanh", "softmax", "log_softmax", "softplus", "relu", "gelu",
             "silu", "abs", "logsumexp", "norm", "std", "var", "prod", "maximum", "minimum", "clamp", "clip", "max",
             "min", "amax", "amin", "sin", "cos", "erf", "atan", "xlogy", "logaddexp", "__rtruediv__", "__rdiv__"}
COUNT = {"histc", "bincount"}  # counts over every element: a sum over the sequence, partial like it
PARTIAL_FIX = ("compute it from the whole sequences (gather what it reduces over cp first), or leave it out of a "
               "model trained on the cp axis (a Hugging Face MoE model: output_router_logits=False, the "
               "load-balancing loss off)")


@dataclass
class Frame:
    """An expert module's call with a sequence-marked token input, held open until it returns (see the Note):
    its ``path`` and ``module``, the token input's ``mark`` and its size along it (``n``), the first refusal
    held back (an exception) and whether ``dispatch`` and ``combine`` moved its tokens."""

    path: str
    module: object
    mark: object
    n: int
    held: Optional[Exception] = None
    routed: set = field(default_factory=set)


def trusted_experts(mod) -> Optional[str]:
    """The name of the dropless, token-local code ``mod`` runs as transformers' experts interface (``"eager"``:
    its class's own forward; ``"grouped_mm"``, ``"batched_mm"``, ...: transformers' own implementations), or
    ``None`` (not such a module, its forward replaced on the instance, or an implementation registered by
    someone else)."""
    if not type(mod).__module__.startswith("transformers.") or "forward" in mod.__dict__:
        return None
    if not callable(getattr(type(mod), "_apply_gate", None)):  # (what @use_experts_implementation gives a class)
        return None
    impl = getattr(getattr(mod, "config", None), "_experts_implementation", None)
    if impl in (None, "eager"):
        return "eager"
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # (transformers is optional)
    except ImportError:  # pragma: no cover - a transformers module without transformers
        return None
    fn = ALL_EXPERTS_FUNCTIONS.get(impl) if isinstance(impl, str) else None   # (as the class's forward looks it up)
    return impl if getattr(fn, "__module__", "") == "transformers.integrations.moe" else None


def is_expert_module(mod) -> bool:
    """An integer ``num_experts`` and a stacked parameter of its own (3 or more dimensions): an expert module as
    :func:`shardplan.units.expert_count` says, also once ``shard()`` left it this rank's experts only (``ep``)."""
    return _num_experts(mod) is not None and any(p.dim() >= 3 for p in mod.parameters(recurse=False))


def open_frame(path: str, mod, args, marks_of, sequence: str) -> Optional[Frame]:
    """A frame for ``mod``'s call when it is an expert module whose first tensor input carries the sequence mark
    (``marks_of(t)``: a tensor's marks; ``sequence``: the sequence mark's source)."""
    if not is_expert_module(mod):
        return None
    x = next((t for t in args if isinstance(t, torch.Tensor)), None)
    m = next((m for m in marks_of(x) if m.source == sequence), None) if x is not None else None
    return Frame(path, mod, m, x.shape[m.dim]) if m is not None else None


def why_not(frame: Frame) -> str:
    """Why ``frame``'s module was not taken as token-local (appended to the refusal held back)."""
    return (f" ({frame.path!r} is an expert module ({type(frame.module).__name__}), taken as token-local under cp "
            f"only when it runs transformers' own experts implementations or moves its tokens through "
            f"sp.expert_parallel.dispatch and combine (dropless); this one did neither, and a module that drops "
            f"tokens over a capacity by their position computes another result on a chunk of the sequence)")


def mark_outputs(frame: Frame, out, mark) -> None:
    """Mark the outputs of a token-local call like its token input: every tensor whose dimension ``m.dim`` has
    the input's size ``n`` (``mark(t, m)``)."""
    from torch.utils._pytree import tree_leaves  # (torch's private pytree, as flow.py uses)
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.ndim > frame.mark.dim and t.shape[frame.mark.dim] == frame.n:
            mark(t, frame.mark)


def partial_rule(name: str, args, kwargs, partial: dict) -> Optional[str]:
    """Whether an operation on partial means (``partial``: {id of a tensor argument: its origin}) keeps its
    output partial (``"keep"``), is refused (a reason), or anything else (``"drop"``: the partial mark is not
    carried; reading the value, a hook, ...)."""
    if name in LINEAR:
        return "keep"
    if name in SCALE:
        a = args[0] if args else kwargs.get("input")
        b = args[1] if len(args) > 1 else kwargs.get("other")
        pa, pb = id(a) in partial, id(b) in partial
        if pa and pb:
            return "multiplies or divides two means over the sequence (each over this rank's tokens only)"
        if pb and not name.startswith("mul") and "mul" not in name:
            return "divides by a mean over the sequence (over this rank's tokens only)"
        return "keep"
    if name in PRODUCT and sum(id(t) in partial for t in args if isinstance(t, torch.Tensor)) > 1:
        return "multiplies two means over the sequence (each over this rank's tokens only)"
    if name in NONLINEAR:
        return "is a function of a mean over the sequence (over this rank's tokens only) that is not linear"
    return "drop"
