"""Drop-in entry points and automatic choices (issue 13): FSDP2-style fully_shard, Megatron-FSDP-style
fully_shard_model / fully_shard_optimizer, auto_rules, declarative plans, Hugging Face configs on the CLI."""

from __future__ import annotations

import contextlib
import io
import sys

import pytest
import torch
import torch.distributed as dist

import shardplan as sp
from distributed import run

sys.path.insert(0, "examples")
import gpt  # noqa: E402

LR, ATOL, STEPS = 3e-3, 1e-5, 3
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _data(world, rank):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, 256, (4 * world, 17), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    per = out[0][0].shape[0] // world
    return out, [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]) for x, y in out]


def _train(model, batches, *, reduce=True):
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if reduce and dist.is_initialized():
            dist.all_reduce(t)
            t /= dist.get_world_size()
        losses.append(t.item())
    return losses


def _reference(world):
    full, _ = _data(world, 0)
    return _train(gpt.build("tiny").init_weights(0), full, reduce=False)


def _build(system, rank, world, case):
    from torch.distributed.device_mesh import init_device_mesh
    model = gpt.build("tiny").init_weights(0)
    hsdp = case.get("hsdp")
    if system in ("torch_fsdp2", "fully_shard"):
        if system == "torch_fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            fully_shard = sp.fully_shard
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard")) if hsdp else None
        for i, layer in enumerate(model.layers):
            fully_shard(layer, mesh=mesh, reshard_after_forward=case.get("raf", True) or i > 0)
        fully_shard(model, mesh=mesh)
        return model
    if system == "fully_shard_model":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("outer", "fsdp")) if hsdp else None
        return sp.fully_shard_model(model, device_mesh=mesh, dp_shard_dim="fsdp" if hsdp else None,
                                    dp_outer_dim="outer" if hsdp else None, fsdp_unit_modules=[gpt.Block],
                                    zero_dp_strategy=case.get("strategy", 3), grad_reduce_in_fp32=True)
    axes = ("replica", "shard") if hsdp else ("dp",)
    mesh = sp.Mesh(replica=2, shard=world // 2) if hsdp else sp.Mesh(dp=world)
    plan = sp.plan(model, [(r".*", sp.P(axes[-1]))], mesh, strategy=case.get("strategy", 3), units=[r"layers\.\d+"],
                   min_unit_bytes=0)
    return sp.shard(model, plan)


def _dropin_worker(rank, world, cases):
    _, mine = _data(world, rank)
    out = []
    for case in cases:
        res = {}
        for system in case["systems"]:
            model = _build(system, rank, world, case)
            res[system] = _train(model, mine)
            if system not in ("torch_fsdp2", "rules"):
                plan = sp.plan_of(model)
                again = sp.plan(gpt.build("tiny"), **plan.declarative())  # the plan back as data, rebuilt
                res[system + "_declarative_equal"] = again.equivalent(plan)
        out.append(res)
    return out


def _check(results, cases, world):
    ref = _reference(world)
    for k, case in enumerate(cases):
        res = results[0][k]
        for system in case["systems"]:
            assert res[system] == pytest.approx(ref, abs=ATOL), (case, system, res[system], ref)
            if system + "_declarative_equal" in res:
                assert res[system + "_declarative_equal"], (case, system, "declarative() does not rebuild the plan")


CASES_2 = [dict(systems=["torch_fsdp2", "fully_shard", "rules"]), dict(systems=["fully_shard"], raf=False)] + \
    [dict(systems=["fully_shard_model", "rules"], strategy=s) for s in STRATEGIES]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_entry_points_train_like_rules_fsdp2_and_single_process():
    _check(run(_dropin_worker, 2, CASES_2), CASES_2, 2)


CASES_4 = [dict(systems=["torch_fsdp2", "fully_shard", "fully_shard_model", "rules"], hsdp=True)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_entry_points_hsdp_four_ranks():
    _check(run(_dropin_worker, 4, CASES_4), CASES_4, 4)


def _errors_worker(rank, world):
    msgs = {}
    for kwargs in (dict(nccl_ub=True), dict(outer_dp_sharding_strategy=1), dict(calculate_per_token_loss=True),
                   dict(no_such_argument=1), dict(zero_dp_strategy="zero9")):
        try:
            sp.fully_shard_model(gpt.build("tiny"), **kwargs)
            msgs[next(iter(kwargs))] = "no error"
        except sp.ShardingError as exc:
            msgs[next(iter(kwargs))] = str(exc)
    try:
        sp.fully_shard(gpt.build("tiny"), reshard_after_forward=2)
        msgs["int_raf"] = "no error"
    except sp.ShardingError as exc:
        msgs["int_raf"] = str(exc)
    try:
        sp.fully_shard_optimizer(torch.optim.AdamW(gpt.build("tiny").parameters()))
        msgs["optimizer"] = "no error"
    except sp.ShardingError as exc:
        msgs["optimizer"] = str(exc)
    model = sp.fully_shard_model(gpt.build("tiny").init_weights(0), fsdp_unit_modules=["Block"])  # a class name
    opt = sp.fully_shard_optimizer(torch.optim.AdamW(model.parameters()))
    x = torch.randint(0, 256, (2, 8))
    model(x, x).backward()
    next(iter(model.parameters())).grad.fill_(float("nan"))
    try:
        opt.step()
        msgs["nan"] = "no error"
    except FloatingPointError as exc:
        msgs["nan"] = str(exc)
    msgs["units"] = [u.name for u in sp.plan_of(model).units]
    # a lone fully_shard call compiles when the optimizer asks for the parameters
    lone = gpt.build("tiny").init_weights(0)
    sp.fully_shard(lone)
    n_local = sum(p.to_local().numel() for p in lone.parameters())  # (DTensor parameters, as FSDP2's)
    msgs["lone"] = (n_local, sum(p.numel() for p in gpt.build("tiny").parameters()))
    return msgs


@pytest.mark.timeout(120)
def test_unsupported_arguments_raise_naming_them():
    for msgs in run(_errors_worker, 2):
        for arg in ("nccl_ub", "outer_dp_sharding_strategy", "calculate_per_token_loss", "no_such_argument",
                    "zero_dp_strategy", "reshard_after_forward"):
            key = "int_raf" if arg == "reshard_after_forward" else arg
            assert arg in msgs[key], (arg, msgs[key])
        assert "model.parameters()" in msgs["optimizer"]
        assert "non-finite" in msgs["nan"]
        assert msgs["units"][1:] == ["layers.0", "layers.1"]
        assert msgs["lone"][0] < msgs["lone"][1]  # sharded: each rank holds part


# -- auto_rules, declarative plans, Hugging Face configs ------------------------------------------------------

def _tiny_hf_models():
    transformers = pytest.importorskip("transformers")
    llama = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    return {
        "llama_tied": transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama, tie_word_embeddings=True)),
        "llama_untied": transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama, tie_word_embeddings=False)),
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4,
                                                                     n_positions=64)),
        "mixtral": transformers.MixtralForCausalLM(transformers.MixtralConfig(**llama, num_local_experts=4,
                                                                               num_experts_per_tok=2)),
    }


def test_auto_rules_cover_shard_and_round_trip():
    models = {name: gpt.build(name) for name in ("tiny", "small")}
    with torch.device("meta"):
        models["1B"] = gpt.build("1B")
    models.update(_tiny_hf_models())
    for name, model in models.items():
        for mesh in (sp.Mesh(dp=4), sp.Mesh(replica=2, shard=4)):
            limit = 4096
            rules = sp.auto_rules(model, mesh, min_shard_bytes=limit)
            specs = sp.match(rules, model, mesh=mesh)          # covers every parameter (raises otherwise)
            for pname, p in model.named_parameters():
                big = p.numel() * p.element_size() >= limit and p.dim() > 0
                assert (specs[pname] != sp.P()) == big, (name, pname, specs[pname])
                assert "replica" not in specs[pname].axes
            ns: dict = {}
            exec(rules.to_source(), ns)
            assert ns["rules"] == rules, name
            plan = sp.plan(model, rules, mesh)
            assert sp.plan(model, **plan.declarative()).equivalent(plan), name
    odd = {"w": torch.empty(7, 64)}  # dim 0 would pad 12.5% over 8 ranks: dim 1 divides evenly, and the rule says so
    rules = sp.auto_rules(odd, sp.Mesh(dp=8), min_shard_bytes=0)
    assert sp.match(rules, odd)["w"] == sp.P(None, "dp") and "divides evenly" in rules.to_source()


@pytest.mark.parametrize("config", ["llama3_8b", "llama3_70b", "mixtral_8x7b", "qwen2_7b"])
def test_hf_configs_plan_on_the_cli(config):
    pytest.importorskip("transformers")
    import time
    from shardplan.cli import main
    out = io.StringIO()
    t = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = main(["plan", f"hf:examples/hf/{config}.json", "--mesh", "dp=64", "--summary", "--dtype", "bf16"])
    assert code == 0 and "memory on rank 0" in out.getvalue() and time.perf_counter() - t < 60
    assert "units (forward order)" in out.getvalue() and "DecoderLayer" not in out.getvalue().split("units")[0]
    with contextlib.redirect_stdout(io.StringIO()) as rules_out:
        assert main(["rules", f"hf:examples/hf/{config}.json", "--mesh", "dp=8"]) == 0
    ns: dict = {}
    exec(rules_out.getvalue(), ns)
    assert isinstance(ns["rules"], sp.Rules)
