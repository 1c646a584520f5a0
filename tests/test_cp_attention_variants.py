"""Hugging Face attention variants under ``attn_implementation="shardplan_cp"``: sliding windows (passed as an
argument, set on the module only, or named by ``config.layer_types``), attention logit soft-capping, Hugging Face's
default ``use_cache=True``, and the variants it does not run, refused before the first step naming the module and
the attribute. Parity is with one process running transformers' own sdpa attention (eager where the model has no
sdpa, Gemma2), at cp=2 and dp=2 x cp=2; Qwen2-MoE at dp=2 x cp=1."""

from __future__ import annotations

import pytest
import torch

import shardplan as sp
from distributed import run

transformers = pytest.importorskip("transformers")

_RULES = [(r".*", sp.P(("dp", "cp")))]
_UNITS = [r"model\.layers\.\d+"]
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)


def _model(family: str, impl: str, seed: int = 0, **over):
    """A tiny model of ``family`` whose sliding window (4 or 6 tokens) is shorter than the 16- and 32-token
    sequences below, on some of its layers (all of Mistral's); Hugging Face's defaults otherwise (``use_cache``)."""
    T = transformers
    cls, cfg_cls, own = {
        "qwen2_moe": (T.Qwen2MoeForCausalLM, T.Qwen2MoeConfig, dict(  # layer 0 slides, through the mask only
            num_hidden_layers=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, sliding_window=4, use_sliding_window=True, max_window_layers=2)),
        "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config, dict(  # layers 2 and 3 slide (i >= max_window_layers)
            num_hidden_layers=4, sliding_window=6, use_sliding_window=True, max_window_layers=2)),
        "mistral": (T.MistralForCausalLM, T.MistralConfig, dict(  # every layer slides (an argument)
            num_hidden_layers=2, sliding_window=6)),
        "gemma2": (T.Gemma2ForCausalLM, T.Gemma2Config, dict(  # sliding and full in turn; logits capped at 1
            num_hidden_layers=2, head_dim=8, sliding_window=6, attn_logit_softcapping=1.0, initializer_range=0.3)),
        "gemma3": (T.Gemma3ForCausalLM, T.Gemma3TextConfig, dict(
            num_hidden_layers=2, head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"])),
    }[family]
    cfg = cfg_cls(**{**_TINY, **own, **over})
    cfg._attn_implementation = impl
    torch.manual_seed(seed)
    return cls(cfg)


# Gemma2 has no sdpa attention in transformers (and sdpa refuses its soft-capping): its reference is eager
_REFERENCE = {"gemma2": "eager"}


def _outside_cp(families) -> None:
    name = sp.context_parallel.hf_attention()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    for family in families:
        ours = _model(family, name)(input_ids=ids).logits
        theirs = _model(family, "sdpa")(input_ids=ids).logits
        full = _model(family, "sdpa", sliding_window=64)(input_ids=ids).logits
        assert (ours - full).abs().max() > 1e-3, family     # the window matters at this length
        assert torch.equal(ours, theirs), (family, (ours - theirs).abs().max())


def test_shardplan_cp_outside_cp_is_sdpa_with_the_window():
    """One process, no cp: "shardplan_cp" is transformers' sdpa, sliding windows included, whether the model passes
    the window only through the mask it builds (Qwen2-MoE: it attended fully, silently) or as an argument (Qwen2)."""
    _outside_cp(("qwen2_moe", "qwen2"))


@pytest.mark.slow
def test_shardplan_cp_outside_cp_is_sdpa_with_the_window_mistral_gemma3():
    _outside_cp(("mistral", "gemma3"))


def _train(rank, world, family, text, steps=2, seq=16, traced=False, **over):
    """Per-step losses of ``family`` sharded on ``text`` with "shardplan_cp", and of one process running the
    reference attention on the whole batch; ``traced``: the plan traced on one rank's inputs."""
    name = sp.context_parallel.hf_attention()
    mesh = sp.Mesh.parse(text)
    model, ref = _model(family, name, **over), _model(family, _REFERENCE.get(family, "sdpa"), **over)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 128, (4, seq), generator=g) for _ in range(steps)]
    trace = None
    if traced:
        one = sp.plan(model, _RULES, mesh, units=_UNITS)
        xs, pos = sp.context_parallel.shard_batch(one, rank, batches[0])
        trace = ((), dict(input_ids=xs, position_ids=pos[None]))
    plan = sp.plan(model, _RULES, mesh, units=_UNITS, min_unit_bytes=0, trace=trace)
    sp.shard(model, plan)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    losses, ref_losses = [], []
    for ids in batches:
        y = torch.roll(ids, -1, 1)                      # shifted over the whole sequences, then sharded
        xs, ys, pos = sp.context_parallel.shard_batch(plan, rank, ids, y)
        loss = model(input_ids=xs, position_ids=pos[None], labels=ys, shift_labels=ys).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = sp.context_parallel.loss_mean(loss, model)
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
        r = ref(input_ids=ids, labels=y, shift_labels=y).loss
        r.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(r.item())
    return losses, ref_losses


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_qwen2_moe_window_through_the_mask_only_at_dp2_equals_one_process():
    """Qwen2-MoE sets its window on the module and passes it through the mask only: at dp=2 x cp=1 it attended
    fully (loss 5.4e-3 off at step 0), silently."""
    for losses, ref_losses in run(_train, 2, "qwen2_moe", "dp=2,cp=1"):
        assert losses == pytest.approx(ref_losses, abs=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "gemma3"])
def test_sliding_windows_and_softcap_under_cp_equal_one_process(family):
    """Sliding windows (Mistral's every layer, Qwen2's upper layers, Gemma2/3's every other one) and Gemma2's
    soft-capped logits under cp, with Hugging Face's default use_cache=True: refused before (the window, the cap,
    and the sliding cache's slicing of this rank's chunks); now the losses of one process. Untraced at cp=2 (the
    flow check's first step), traced at dp=2 x cp=2."""
    for world, text in ((2, "dp=1,cp=2"), (4, "dp=2,cp=2")):
        for losses, ref_losses in run(_train, world, family, text, 2, 32, world == 4):
            assert losses == pytest.approx(ref_losses, abs=1e-5), (family, text)


def _gpt_oss(impl):
    cfg = transformers.GptOssConfig(**dict(_TINY, num_hidden_layers=2, head_dim=8, num_local_experts=4,
                                           num_experts_per_tok=2, sliding_window=4))
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return transformers.GptOssForCausalLM(cfg)


@pytest.mark.slow
def test_what_shardplan_cp_does_not_run_is_refused_before_the_first_step_naming_the_module_and_attribute():
    """Attention sinks (gpt-oss's ``sinks``, passed as ``s_aux=``): refused at plan time under cp, at the first call
    outside it. A window the model keeps in its config and applies through its mask alone, which the module does
    not say (PhiMoE): refused at plan time when traced, at the first call otherwise, naming the fix, which runs."""
    name = sp.context_parallel.hf_attention()
    with pytest.raises(sp.errors.PlanError, match=r"module 'model.layers.0.self_attn' \(GptOssAttention\) has 'sinks'"):
        sp.plan(_gpt_oss(name), _RULES, sp.Mesh(dp=1, cp=2), units=_UNITS)
    ids = torch.randint(0, 128, (2, 16))
    with pytest.raises(sp.errors.RuntimeShardingError, match=r"GptOssAttention \(layer 0\) was given s_aux= \(attention "
                                                      r"sinks, its attribute 'sinks'\)"):
        _gpt_oss(name)(input_ids=ids)

    def phimoe(impl):
        cfg = transformers.PhimoeConfig(**dict(_TINY, num_hidden_layers=2, num_local_experts=4, sliding_window=4))
        cfg._attn_implementation = impl
        torch.manual_seed(0)
        return transformers.PhimoeForCausalLM(cfg)
    fix = r"PhimoeAttention \(layer 0\) cannot tell whether its layer uses config.sliding_window=4.*sliding_window ="
    with pytest.raises(sp.errors.PlanError, match=fix):
        sp.plan(phimoe(name), _RULES, sp.Mesh(dp=2, cp=1), units=_UNITS, trace=((), dict(input_ids=ids)))
    model = phimoe(name)
    with pytest.raises(sp.errors.RuntimeShardingError, match=fix):
        model(input_ids=ids)
    for layer in model.model.layers:               # the fix the message names: PhiMoE windows every layer
        layer.self_attn.sliding_window = model.config.sliding_window
    assert torch.equal(model(input_ids=ids).logits, phimoe("sdpa")(input_ids=ids).logits)


@pytest.mark.slow
def test_gemma2_soft_capped_logits_outside_cp_are_eager_attention():
    """Gemma2 caps its attention logits (softcap=; here at 1.0, with weights large enough for the cap to bite),
    which transformers' sdpa refuses: outside cp "shardplan_cp" computes them as transformers' eager attention
    does (with the window of its sliding layers)."""
    name = sp.context_parallel.hf_attention()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    ours, eager = _model("gemma2", name)(input_ids=ids).logits, _model("gemma2", "eager")(input_ids=ids).logits
    uncapped = _model("gemma2", "eager", attn_logit_softcapping=None)(input_ids=ids).logits
    assert (eager - uncapped).abs().max() > 0.1                  # the cap matters here
    assert torch.equal(ours, eager)


def _refusals(rank, world):
    name = sp.context_parallel.hf_attention()
    model = _model("mistral", name)
    plan = sp.plan(model, _RULES, sp.Mesh(dp=1, cp=2), units=_UNITS)
    sp.shard(model, plan)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    xs, pos = sp.context_parallel.shard_batch(plan, rank, ids)
    try:
        model(input_ids=xs, position_ids=pos[None], use_cache=True)
        return "ran"
    except sp.errors.RuntimeShardingError as exc:
        return str(exc)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_use_cache_true_under_cp_is_refused_naming_use_cache_false():
    """Hugging Face's default (use_cache left out) runs under cp with no cache (the parity tests above); asked for
    explicitly, a cache of this rank's chunks is refused, naming the fix."""
    for got in run(_refusals, 2):
        assert "use_cache=True" in got and "pass use_cache=False" in got, got


def test_attention_window_and_softcap_outside_cp():
    """sp.context_parallel.attention's own window= and softcap= (the plain call): the window keeps the keys
    i-window < j <= i, the cap is eager attention's, and a window without is_causal=True is refused."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    pos = torch.arange(8)
    band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 3)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band)
    assert torch.allclose(sp.context_parallel.attention(q, k, v, is_causal=True, window=3), want, atol=1e-6)
    s = torch.tanh((q @ k.transpose(-1, -2)) * 0.5 / 0.7) * 0.7
    capped = torch.softmax(s.masked_fill(~band, float("-inf")), -1) @ v
    got = sp.context_parallel.attention(q, k, v, is_causal=True, window=3, softcap=0.7)
    assert torch.allclose(got, capped, atol=1e-6)
    with pytest.raises(sp.errors.RuntimeShardingError, match="without is_causal=True"):
        sp.context_parallel.attention(q, k, v, window=3)


def _ignored_labels(rank, world, steps=2, seq=16):
    """Hugging Face's shifted labels (the last position ignored, -100) at cp=2: refused without
    ``num_items_in_batch``; with it, the losses of one process."""
    name = sp.context_parallel.hf_attention()
    model, ref = _model("mistral", name, sliding_window=None), _model("mistral", "sdpa", sliding_window=None)
    plan = sp.plan(model, _RULES, sp.Mesh(dp=1, cp=2), units=_UNITS, min_unit_bytes=0)
    sp.shard(model, plan)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    g = torch.Generator().manual_seed(5)
    out = {"losses": [], "ref": []}
    for step in range(steps):
        ids = torch.randint(0, 128, (4, seq), generator=g)
        y = torch.roll(ids, -1, 1)
        y[:, -1] = -100                                  # nothing follows the last token
        xs, ys, pos = sp.context_parallel.shard_batch(plan, rank, ids, y)
        if step == 0:
            try:
                model(input_ids=xs, position_ids=pos[None], labels=ys, shift_labels=ys)
                out["refused"] = ""
            except sp.errors.RuntimeShardingError as exc:
                out["refused"] = str(exc)
        n = (y != -100).sum() / 2
        loss = model(input_ids=xs, position_ids=pos[None], labels=ys, shift_labels=ys, num_items_in_batch=n).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)                  # the ranks' shares of the whole sum / n
        out["losses"].append(t.item() / 2)
        r = ref(input_ids=ids, labels=y, shift_labels=y).loss
        r.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["ref"].append(r.item())
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ignored_labels_under_cp_are_refused_without_num_items_in_batch():
    """Each rank's loss is the mean over its own labelled tokens: with the last position ignored the ranks hold 16
    and 15 and the step was not the whole sequences' mean, silently. Refused, naming num_items_in_batch; with it,
    one process's losses."""
    for got in run(_ignored_labels, 2):
        assert "num_items_in_batch" in got["refused"], got["refused"]
        assert got["losses"] == pytest.approx(got["ref"], abs=1e-5)
