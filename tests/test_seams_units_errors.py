"""Seams a torch FSDP2 user crosses: plans without ``units=`` (found from the model), heads that do not divide
the tensor-parallel size, ``.to()``/``.half()`` after ``shard()``, and ``torch.compile``'d modules handed to
shardplan's functions. Each works as FSDP2 would or fails at once with a shardplan error naming the fix."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import sys
import warnings

import pytest
import torch

import shardplan as sp
from shardplan.auto import find_units
from distributed import run
from models import Toy, batches, toy_rules

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "examples"))
import gpt  # noqa: E402
import gpt_rules  # noqa: E402
import gpt_rules_tp  # noqa: E402


def _meta(fn, *args, **kw):
    with torch.device("meta"):
        return fn(*args, **kw)


def _llama(transformers, kv_heads=2):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=72, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64)
    return _meta(transformers.LlamaForCausalLM, cfg)


def _t5(transformers):
    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=3,
                                num_heads=2, decoder_start_token_id=0, pad_token_id=0)
    return _meta(transformers.T5ForConditionalGeneration, cfg)


# -- item 5: units found from the model ---------------------------------------------------------------------

def test_default_units_are_the_repeated_blocks():
    transformers = pytest.importorskip("transformers")
    assert find_units(gpt.build("tiny")) == [r"layers\.\d+"]
    assert find_units(_llama(transformers)) == [r"model\.layers\.\d+"]
    assert find_units(_t5(transformers)) == [r"encoder\.block\.\d+", r"decoder\.block\.\d+"]
    assert find_units(Toy()) == [r"blocks\.\d+"]

    t5 = _t5(transformers)
    plan = sp.plan(t5, [(r".*", sp.P("dp"))], sp.Mesh(dp=4), min_unit_bytes=0)
    assert [u.name for u in plan.units] == ["<root>", "encoder.block.0", "encoder.block.1", "decoder.block.0",
                                            "decoder.block.1", "decoder.block.2"]
    assert any("automatic: the model's repeated blocks" in n for n in plan.notes)
    assert "automatic: the model's repeated blocks" in str(plan)

    llama = sp.plan(_llama(transformers), [(r".*", sp.P("dp"))], sp.Mesh(dp=2), min_unit_bytes=0)
    assert [u.name for u in llama.units][1:] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    # deterministic: the same plan (and fingerprint) built twice; equal to naming the units by hand
    model = gpt.build("tiny")
    a, b = sp.plan(model, gpt_rules.rules, sp.Mesh(dp=4)), sp.plan(model, gpt_rules.rules, sp.Mesh(dp=4))
    assert a.fingerprint() == b.fingerprint()
    assert a.equivalent(sp.plan(model, gpt_rules.rules, sp.Mesh(dp=4), units=gpt_rules.UNITS))
    assert sp.plan(model, **a.declarative()).equivalent(a)
    # units=() still means one root unit
    assert [u.name for u in sp.plan(model, gpt_rules.rules, sp.Mesh(dp=4), units=()).units] == ["<root>"]


def test_large_root_unit_warns_with_the_units_to_pass():
    model = _meta(gpt.build, "1B")  # 5.6 GiB of fp32 parameters
    with pytest.warns(sp.errors.PlanWarning, match=r"root unit holds .* pass units=\[r'layers\\.\\d\+'\]"):
        root_only = sp.plan(model, gpt_rules.rules, sp.Mesh(dp=64), units=[])
    assert any("root unit holds" in w for w in root_only.warnings)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sp.errors.PlanWarning)
        found = sp.plan(model, gpt_rules.rules, sp.Mesh(dp=64))  # units found: no warning
        sp.plan(gpt.build("tiny"), gpt_rules.rules, sp.Mesh(dp=4), units=())  # small: no warning
        sp.plan(model, gpt_rules.rules, sp.Mesh(dp=64), units=(), strategy="optim_grads")  # params whole anyway
    assert found.memory().peak < root_only.memory().peak / 2
    tree = {"w": torch.empty(2 ** 19, 2 ** 10, device="meta"), "b": torch.empty(8, device="meta")}
    with pytest.warns(sp.errors.PlanWarning, match=r"pass units=\[\.\.\.\] naming the model's blocks"):
        sp.plan(tree, [(r".*", sp.P("dp"))], sp.Mesh(dp=8))


def test_auto_rules_and_the_cli_propose_units(tmp_path):
    from shardplan.cli import main
    rules = sp.auto_rules(gpt.build("tiny"), sp.Mesh(dp=8))
    assert rules.units == [r"layers\.\d+"] and sp.Rules(rules).units == rules.units
    ns: dict = {}
    exec(rules.to_source(), ns)
    assert ns["UNITS"] == [r"layers\.\d+"] and ns["rules"] == rules
    assert sp.auto_rules({"w": torch.zeros(4, 4)}, sp.Mesh(dp=2)).units == []
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["rules", "examples/gpt.py:build", "--mesh", "dp=8"]) == 0
    assert "UNITS = [r'layers\\.\\d+']" in out.getvalue()
    path = tmp_path / "rules.py"
    path.write_text(out.getvalue())
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["plan", "examples/gpt.py:build", "--mesh", "dp=8", "--rules", str(path), "--summary",
                     "--min-unit-bytes", "0"]) == 0
    assert "layers.1" in out.getvalue()
    with contextlib.redirect_stdout(io.StringIO()) as out:  # no rules file: the plan finds the units itself
        assert main(["plan", "examples/gpt.py:build", "--mesh", "dp=8", "--summary", "--min-unit-bytes", "0"]) == 0
    assert "layers.1" in out.getvalue() and "automatic: the model's repeated blocks" in out.getvalue()


# -- item 7a: heads that the tensor-parallel size cannot split ---------------------------------------------

LLAMA_TP = [(r".*\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight", sp.P("tp")),
            (r".*\.(o_proj|down_proj)\.weight", sp.P(None, "tp")), (r".*", sp.P())]


def test_heads_not_divisible_by_tp_raise_at_plan_time():
    transformers = pytest.importorskip("transformers")
    llama = _llama(transformers, kv_heads=2)
    assert sp.plan(llama, LLAMA_TP, sp.Mesh(dp=2, tp=2), compute_axes="tp").axis("tp").modules
    with pytest.raises(sp.errors.PlanError) as exc:
        sp.plan(llama, LLAMA_TP, sp.Mesh(tp=4), compute_axes="tp")
    msg = str(exc.value)
    for words in ("model.layers.0.self_attn.k_proj.weight", "num_key_value_heads=2", "size 4", "tp=2", "P()"):
        assert words in msg, (words, msg)
    with pytest.raises(sp.errors.PlanError, match=r"attention\.wk\.weight.*2 attention heads"):  # kv_heads=2
        sp.plan(_meta(gpt.build, "small"), gpt_rules_tp.tp_rules(data=None), sp.Mesh(tp=4), compute_axes="tp")
    assert sp.plan(_meta(gpt.build, "small"), gpt_rules_tp.tp_rules(data=None), sp.Mesh(tp=2), compute_axes="tp")
    t5_rules = [(r".*SelfAttention\.[qkv]\.weight", sp.P("tp")), (r".*SelfAttention\.o\.weight", sp.P(None, "tp")),
                (r".*", sp.P())]
    with pytest.raises(sp.errors.PlanError, match=r"SelfAttention\.q\.weight.*n_heads=2"):
        sp.plan(_t5(transformers), t5_rules, sp.Mesh(tp=4), compute_axes="tp")
    # an MLP (no heads declared) is not checked
    assert sp.plan(llama, [(r".*\.(gate_proj|up_proj)\.weight", sp.P("tp")), (r".*down_proj\.weight", sp.P(None, "tp")),
                           (r".*", sp.P())], sp.Mesh(tp=8), compute_axes="tp")


# -- items 5 and 7b/c at runtime ---------------------------------------------------------------------------

def _error(fn):
    try:
        fn()
    except sp.ShardingError as exc:
        return type(exc).__name__ + ": " + str(exc)
    except Exception as exc:  # noqa: BLE001
        return "OTHER " + type(exc).__name__ + ": " + str(exc)
    return None


def _runtime_worker(rank, world, path):
    out = {}
    data = batches(3, batch=2 * world)
    ref = Toy()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model = Toy()
    plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), min_unit_bytes=0)  # units found: blocks.0..2
    out["units"] = [u.name for u in plan.units]
    sp.shard(model, plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    compiled = torch.compile(model)  # never called: only handed to shardplan's functions
    losses, ref_losses = [], []
    for i, (x, y) in enumerate(data[:2]):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = model(xs, ys)
        loss.backward()
        sp.clip_grad_norm_(compiled, 1e9)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    t = torch.tensor(losses)
    torch.distributed.all_reduce(t)
    out["losses"], out["ref_losses"] = (t / world).tolist(), ref_losses
    # torch.compile(model): the same engine, plan and state
    out["plan_of"] = sp.plan_of(compiled) is plan
    full = sp.checkpoint.full_state_dict(compiled)
    plain = sp.checkpoint.full_state_dict(model)
    out["full_same"] = rank != 0 or (full.keys() == plain.keys() and all(torch.equal(full[k], plain[k]) for k in full))
    out["full_close_to_ref"] = rank != 0 or all(torch.allclose(full[k], v, atol=1e-5) for k, v in ref.state_dict().items())
    with sp.no_sync(compiled):
        out["no_sync"] = sp.runtime.engine_of(model).sync is False
    sp.checkpoint.save(path, compiled, opt, step=2)
    out["load_step"] = sp.checkpoint.load(path, compiled, opt)
    # .to() that changes nothing still runs; one that converts raises at once, naming the fix
    out["same_dtype"] = _error(lambda: model.to(torch.float32).float().cpu())
    out["to_bf16"] = _error(lambda: model.to(torch.bfloat16))
    out["half"] = _error(lambda: model.half())
    out["to_empty"] = _error(lambda: model.to_empty(device="cpu"))
    out["dtype_kept"] = all(p.dtype == torch.float32 for p in model.parameters())
    x, y = data[2]
    loss = model(x.chunk(world)[rank], y.chunk(world)[rank])
    loss.backward()
    opt.step()
    opt.zero_grad()
    out["still_trains"] = bool(torch.isfinite(loss))
    # a child's .half() bypasses the root: the first gradient handed to its shard says what happened
    model.blocks[1].half()
    out["child_half"] = _error(lambda: model(x.chunk(world)[rank], y.chunk(world)[rank]).backward())
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 4])
def test_runtime_seams(tmp_path, world):
    for out in run(_runtime_worker, world, str(tmp_path / "ckpt"), timeout=360):
        assert out["units"] == ["<root>", "blocks.0", "blocks.1", "blocks.2"], out
        assert out["losses"] == pytest.approx(out["ref_losses"], abs=1e-5), out
        assert out["plan_of"] and out["full_same"] and out["full_close_to_ref"] and out["no_sync"], out
        assert out["load_step"] == 2 and out["same_dtype"] is None and out["dtype_kept"] and out["still_trains"], out
        for key, words in (("to_bf16", "torch.float32 -> torch.bfloat16"), ("half", "torch.float16"),
                           ("to_empty", "to_empty")):
            assert out[key].startswith("RuntimeShardingError") and words in out[key], (key, out[key])
            assert "compute_dtype=" in out[key] or "init_fn" in out[key], out[key]
        assert out["child_half"].startswith("RuntimeShardingError") and "blocks.1." in out["child_half"], out
        assert "compute_dtype=" in out["child_half"], out


def _tying_worker(rank, world):
    import gpt
    out = {}
    cfg = gpt.CONFIGS["tiny"]
    torch.manual_seed(0)
    tied, untied = gpt.GPT(cfg), gpt.GPT(dataclasses.replace(cfg, tie_embeddings=False))
    assert tied.output.weight is tied.tok_embeddings.weight and untied.output.weight is not untied.tok_embeddings.weight
    for key, planned, sharded in (("tied_plan_untied_module", tied, untied), ("untied_plan_tied_module", untied, tied)):
        plan = sp.plan(planned, [(r".*", sp.P("dp"))], sp.Mesh(dp=world))
        out[key] = _error(lambda: sp.shard(copy.deepcopy(sharded), plan))
    return out


@pytest.mark.timeout(120)
def test_a_plan_whose_tying_differs_from_the_module_is_refused():
    """A plan ties output.weight to tok_embeddings.weight; the module holds two tensors (or the other way round).
    Sharding with it would tie (or untie) the weights silently and train another model: refused on every rank."""
    for out in run(_tying_worker, 2, timeout=100):
        a, b = out["tied_plan_untied_module"], out["untied_plan_tied_module"]
        assert a is not None and a.startswith("RuntimeShardingError"), a
        assert "output.weight, tok_embeddings.weight: tied in the plan" in a and "separate tensors" in a, a
        assert b is not None and b.startswith("RuntimeShardingError"), b
        assert "one tensor in the module (tied weights)" in b and "separate parameters" in b, b
