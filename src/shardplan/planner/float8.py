"""FP8 compute through torchao (``sp.plan(..., fp8="torchao")``; docs/low_precision.md#fp8-compute): which
``nn.Linear`` modules a plan converts to torchao's ``Float8Linear``, and where that pays.

Pure: it reads the module tree (``torch.nn`` for ``isinstance``) and never imports torchao, so a plan with FP8
compute is made and printed anywhere; :mod:`shardplan.fp8` converts the modules (torchao, a device with FP8).

>>> min_tokens(4096, 14336)      # tokens per rank per step from which a 4096 -> 14336 matmul pays in float8
2837
>>> min_tokens(2048, 2048)       # never, by this rule (the 1B GPT's attention projections)
0
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..errors import PlanError
from ..lowp import rule_pairs

TORCHAO = "torchao"
MULTIPLE = 16  # float8 matmuls (torch._scaled_mm) need both dims divisible by 16, as torchao's filter checks
# [Note: the output head stays in bf16 by default] as in torchtitan (its float8 filter lists "output"): the
# logits' matmul is precision-sensitive and, with a large vocabulary, the loss reads its output at once.
HEADS = ("output", "lm_head", "head", "classifier")
# [Note: where FP8 compute pays: a rule of thumb] Float8 halves the three matmuls of a Linear (forward, grad
# input, grad weight: 6 M K N flops) at twice the bf16 rate, and adds dynamic casts of the input (M x K), the
# weight (K x N) and the output gradient (M x N), memory-bound passes whose cost grows with M K + K N + M N. So
# the gain scales with h = 1 / (1/M + 1/K + 1/N) (M: tokens per rank per step, K in, N out features). Calibrated
# on two observations, not measured per matmul: torchao float8 + FSDP2 on a 936M GPT (d 2048, ffn 5632,
# M = 8192; h <= 1269) is slower than bf16 on one H200 even compiled (153 vs 98.8 ms, issue 24), while
# torchtitan reports 1.28x on Llama-3 8B at M = 8192 (d 4096, ffn 14336; h 1638 to 2294, eager casts fused by
# torch.compile). PAYS_FROM sits between them; torchao's own filter (K <= 4096 and N <= 1024 never pays, H100)
# is applied too. Replace it with a measurement when one exists (benchmarks/train_step.py shardplan_fp8c).
PAYS_FROM = 1500


@dataclass(frozen=True)
class FP8Module:
    """One ``nn.Linear`` the plan runs in float8 (torchao ``Float8Linear``, tensorwise dynamic scales)."""
    path: str           # module path, e.g. "layers.0.attention.wq"
    weight: str         # the plan's name of its weight
    in_features: int    # K
    out_features: int   # N
    unit: str           # the unit whose buffer holds the weight
    min_tokens: int     # tokens per rank per step (M) from which its matmuls pay in float8; 0: never (PAYS_FROM)


def min_tokens(k: int, n: int) -> int:
    """The smallest M with ``1 / (1/M + 1/K + 1/N) >= PAYS_FROM`` (0: no M does), torchao's filter applied."""
    if k <= 4096 and n <= 1024:
        return 0
    rest = 1.0 / PAYS_FROM - 1.0 / k - 1.0 / n
    return 0 if rest <= 0 else int(-(-1.0 // rest))


def as_option(fp8):
    """``fp8=`` normalised: ``""`` (off), ``"torchao"`` (every eligible Linear but the head) or a tuple of
    ``(module path regex, "torchao" or "")`` pairs (first fullmatch decides; unmatched Linears stay)."""
    if fp8 is None or fp8 is False or fp8 == "":
        return ""
    if fp8 is True or fp8 == TORCHAO:
        return TORCHAO
    if isinstance(fp8, str) or not isinstance(fp8, (list, tuple)):
        raise PlanError(f"fp8 must be None, 'torchao' or a list of (module regex, 'torchao' or None) pairs; got "
                        f"{fp8!r}")
    return rule_pairs(fp8, "fp8", "(module regex, 'torchao' or None)", "[(r'.*attention.*', None), (r'layers\\..*', "
                      "'torchao')]", lambda v: TORCHAO if v in (True, TORCHAO) else "",
                      valid=lambda v: v in (None, False, True, "", TORCHAO))


def select(module, option, infos, owner: dict, compute: dict) -> tuple[tuple[FP8Module, ...], tuple[str, ...]]:
    """The Linears ``option`` converts, and why each other Linear it would have taken stays (notes).

    ``infos``: the plan's ``LeafInfo`` (tied parameters once, with their aliases); ``owner``: parameter name ->
    unit; ``compute``: parameter name -> its tensor-parallel or expert ``Compute`` (None: data-parallel only)."""
    option = as_option(option)
    if not option:
        return (), ()
    if module is None:
        raise PlanError("fp8= needs an nn.Module: it converts nn.Linear modules, and a plain pytree has none")
    import torch.nn as nn
    by_name = {}
    for info in infos:
        for n in (info.name,) + tuple(info.aliases):
            by_name[n] = info
    picked, skipped = [], []
    for path, mod in module.named_modules():
        if not isinstance(mod, nn.Linear) or not path:
            continue
        if isinstance(option, str):
            wanted, explicit = path.rsplit(".", 1)[-1] not in HEADS, False
            if not wanted:
                skipped.append(f"{path}: the output head (kept in bf16 as torchtitan does; fp8=[(regex, 'torchao')] "
                               f"converts it)")
                continue
        else:
            wanted = next((f for pattern, f in option if re.fullmatch(pattern, path)), "")
            explicit = True
            if not wanted:
                continue
        weight = by_name.get(f"{path}.weight")
        why = None
        if weight is None:
            why = "its weight is not a parameter of the plan"
        elif weight.aliases:
            why = f"its weight is tied to {', '.join((weight.name,) + weight.aliases[:2])} (an embedding reads it)"
        elif mod.in_features % MULTIPLE or mod.out_features % MULTIPLE:
            why = f"{mod.out_features}x{mod.in_features}: float8 matmuls need both dims divisible by {MULTIPLE}"
        elif compute.get(weight.name) is not None:
            why = "tensor-parallel or expert weights are not converted yet (torchao's float8 TP styles are not wired)"
        elif not getattr(weight.dtype, "is_floating_point", False):
            why = f"its weight is {weight.dtype}"
        if why:
            if explicit:
                raise PlanError(f"fp8 rule selects Linear {path!r}, which cannot run in float8: {why}")
            skipped.append(f"{path}: {why}")
            continue
        picked.append(FP8Module(path=path, weight=weight.name, in_features=mod.in_features,
                                out_features=mod.out_features, unit=owner[weight.name],
                                min_tokens=min_tokens(mod.in_features, mod.out_features)))
    if not picked:
        raise PlanError("fp8='torchao' found no nn.Linear to convert (dims divisible by 16, untied, data-parallel "
                        "weights, not the output head): " + ("; ".join(skipped[:4]) or "the model has no nn.Linear"))
    return tuple(picked), tuple(skipped)


def tokens_of(trace) -> Optional[int]:
    """Tokens per rank per step (M) from ``trace=`` example inputs: the first tensor's elements if it holds
    integers (token ids), else its elements over its last dimension; ``None`` without a tensor."""
    items = trace if isinstance(trace, (list, tuple)) else (trace.values() if isinstance(trace, dict) else (trace,))
    for t in items:
        shape = getattr(t, "shape", None)
        if shape is None or not len(shape):
            continue
        n = 1
        for s in shape:
            n *= int(s)
        return n if not t.dtype.is_floating_point else n // int(shape[-1])
    return None


def float8_gathers(mods, wanted: bool, level: int, offload, compute_axes, expert: bool) -> tuple[bool, str]:
    """Whether the float8 Linears' weights are gathered as float8 (lowp.FLOAT8_TW), and why not."""
    if not mods:
        return False, ""
    if not wanted:
        return False, "fp8_gather=False"
    if level < 3:
        return False, "the strategy keeps the parameters whole (no per-step gather)"
    if offload or compute_axes or expert:
        return False, "not supported with CPU offload, tensor or expert parallelism yet"
    return True, ""


def note(mods: tuple[FP8Module, ...], skipped: tuple[str, ...], tensorwise: bool = False, why: str = "") -> str:
    """What ``plan.notes`` says about the conversion."""
    how = ("their weights are all-gathered as float8 codes, one scale per weight from an absmax all-reduce, and "
           "reach the matmuls without a dequantize" if tensorwise else
           f"their weights are gathered in the compute dtype and cast to float8 after the gather ({why})")
    text = (f"fp8='torchao': {len(mods)} nn.Linear modules run in float8 (torchao Float8Linear, tensorwise dynamic "
            f"scales; {how})")
    if skipped:
        text += f"; {len(skipped)} stay: " + "; ".join(skipped[:4]) + (" ..." if len(skipped) > 4 else "")
    return text


def warnings(mods: tuple[FP8Module, ...], tokens: Optional[int]) -> list[str]:
    """Where FP8 compute does not pay (the rule of thumb above): never, or not at ``tokens`` per rank."""
    out = []
    never = [m for m in mods if not m.min_tokens]
    if never:
        shapes = sorted({(m.in_features, m.out_features) for m in never})
        out.append(f"fp8: {len(never)} of {len(mods)} float8 Linear(s) are too small for FP8 compute to pay at any "
                   f"batch (in x out {', '.join(f'{k}x{n}' for k, n in shapes[:4])}: the casts cost more than the "
                   f"faster matmul saves; e.g. {never[0].path}); exclude them with fp8=[(regex, None), ...] "
                   f"(docs/low_precision.md#fp8-compute)")
    if tokens:
        short = [m for m in mods if m.min_tokens and tokens < m.min_tokens]
        if short:
            need = max(m.min_tokens for m in short)
            out.append(f"fp8: at {tokens:,d} tokens per rank per step (traced), {len(short)} float8 Linear(s) are "
                       f"below the size where FP8 compute pays (up to {need:,d} tokens needed, e.g. "
                       f"{short[0].path}); raise the batch or sequence, or exclude them")
    return out
