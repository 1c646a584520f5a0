"""Seams between shardplan's faces and torch's contracts, tried with models we did not write (issue 18):
units that pass a tensor through (HF T5), optimizers built before sharding, the FSDP2 drop-in without
a root call, and ranks whose models differ. Each either trains exactly like one process or fails at
once with a shardplan error naming the parameter and the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import shardplan as sp
from distributed import run
from models import Toy, batches, toy_rules

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
T5_BLOCKS = r"(encoder|decoder)\.block\.\d+"


def _t5():
    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=3, num_decoder_layers=2,
                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg)


def _t5_batches(n: int, world: int):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(1, 64, (2 * world, 7), generator=g), torch.randint(1, 64, (2 * world, 5), generator=g))
            for _ in range(n)]


def _t5_train(model, data, rank: int, world: int, sharded: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in data:
        if sharded:
            per = x.shape[0] // world
            x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if sharded:  # every rank's mean over the same number of tokens: the world mean is the global mean
            torch.distributed.all_reduce(t)
            t /= world
        losses.append(t.item())
    return losses


def _t5_worker(rank, world):
    """Every T5 block is a unit; blocks return ``position_bias`` they were given. Each way of sharding,
    every strategy and both orders, against one process on the global batch."""
    data = _t5_batches(2, world)
    ref = _t5()
    ref_losses = _t5_train(ref, data, 0, 1, sharded=False)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    out = {}
    cases = [("units", s, o) for s in STRATEGIES for o in ("static", "dynamic")]
    cases += [("auto_rules", "optim_grads_params", "static"), ("fully_shard", "optim_grads_params", "static")]
    for how, strategy, order in cases:
        model = _t5()
        mesh = sp.Mesh(dp=world)
        if how == "fully_shard":
            for block in list(model.encoder.block) + list(model.decoder.block):
                sp.fully_shard(block)
            sp.fully_shard(model)
        else:
            rules = sp.auto_rules(model, mesh, min_shard_bytes=0) if how == "auto_rules" else [(r".*", sp.P("dp"))]
            units = {} if how == "auto_rules" else {"units": [T5_BLOCKS]}
            plan = sp.plan(model, rules, mesh, strategy=strategy, order=order, min_unit_bytes=0, **units)
            sp.shard(model, plan)
        n_units = len(sp.plan_of(model).units)
        losses = _t5_train(model, data, rank, world, sharded=True)
        full = sp.checkpoint.full_state_dict(model)
        diff = max((full[n] - p).abs().max().item() for n, p in ref_params.items()) if rank == 0 else 0.0
        out[(how, strategy, order)] = (losses, diff, n_units)
    return ref_losses, out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_t5_passthrough_units_train_like_one_process(world):
    for ref_losses, out in run(_t5_worker, world, timeout=560):
        for case, (losses, diff, n_units) in out.items():
            assert n_units > 1, (case, n_units)  # the blocks really are units (the case this tests)
            assert losses == pytest.approx(ref_losses, abs=2e-6), case
            assert diff < 2e-6, (case, diff)


# -- optimizers built before sharding (items 2 and 4) -----------------------------------------------------

def _toy_losses(model, opt, data, rank, world, sharded):
    losses = []
    for x, y in data:
        if sharded:
            per = x.shape[0] // world
            x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if sharded:
            torch.distributed.all_reduce(t)
            t /= world
        losses.append(t.item())
    return losses


def _early_optimizer_worker(rank, world):
    data = batches(3)
    ref = Toy()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = _toy_losses(ref, ref_opt, data, 0, 1, False)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    out = {}
    for case in ["eager", "meta"]:
        if case == "meta":
            with torch.device("meta"):
                model = Toy()
        else:
            model = Toy()
        before = list(model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # before shard(): holds the parameters it saw
        plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0)
        if case == "meta":  # the values Toy() builds eagerly, copied in by init_fn as each unit materialises
            init = {**dict(Toy().named_parameters()), **dict(Toy().named_buffers())}
            path_of = {id(m): name for name, m in model.named_modules()}

            def init_fn(m):
                for attr, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
                    t.copy_(init[f"{path_of[id(m)]}.{attr}".lstrip(".")])
            sp.shard(model, plan, init_fn=init_fn)
        else:
            sp.shard(model, plan)
        same = [a is b for a, b in zip(before, model.parameters())]
        losses = _toy_losses(model, opt, data, rank, world, True)
        full = sp.checkpoint.full_state_dict(model)
        diff = max((full[n] - p).abs().max().item() for n, p in ref_params.items() if n in full) if rank == 0 else 0.0
        out[case] = (all(same), losses, diff)
    return ref_losses, out


def _stepped_before_worker(rank, world):
    model = Toy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batches(1)[0]
    model(x, y).backward()
    opt.step()  # state shaped like the full parameters
    opt.zero_grad()
    sp.shard(model, sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0))
    per = x.shape[0] // world
    model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
    try:
        opt.step()
    except sp.errors.RuntimeShardingError as exc:
        return str(exc)
    return "stepped"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_optimizer_built_before_shard_trains(world):
    for ref_losses, out in run(_early_optimizer_worker, world):
        for case, (same, losses, diff) in out.items():
            assert same, case  # model.parameters() are the very objects the optimizer holds
            assert losses == pytest.approx(ref_losses, abs=1e-6), case
            assert diff < 1e-6, (case, diff)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_optimizer_state_from_before_shard_is_refused():
    for msg in run(_stepped_before_worker, 2):
        assert "built before sharding" in msg and "exp_avg" in msg, msg


def _blocks_only_worker(rank, world):
    """``fully_shard`` on the blocks only, no root call, the optimizer built before the first forward:
    shardplan and torch FSDP2 train the same numbers on every rank (the root's own parameters are
    managed by neither, so their gradients stay local in both)."""
    import sys
    sys.path.insert(0, "examples")
    import gpt
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 256, (2, 17), generator=g) for _ in range(3)]
    out = {}
    for system, fs in [("shardplan", sp.fully_shard), ("fsdp2", torch_fully_shard)]:
        model = gpt.build("tiny").init_weights(0)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        for layer in model.layers:
            fs(layer)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for x in data:
            model(x[:, :-1], x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        full = {}
        for i, layer in enumerate(model.layers):
            if system == "shardplan":
                sd = sp.checkpoint.full_state_dict(layer)  # rank 0 gets the full tensors
                sd = {k: v for k, v in sd.items()}
            else:
                sd = {k: v.full_tensor() for k, v in layer.named_parameters()}
            full.update({f"layers.{i}.{k}": v for k, v in sd.items()})
        full.update({n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("layers.")})
        moved = max((full[n] - start[n]).abs().max().item() for n in full if n.startswith("layers.")) if rank == 0 else 0
        out[system] = (full, moved)
    a, b = out["shardplan"][0], out["fsdp2"][0]
    diff = max((a[n] - b[n]).abs().max().item() for n in b if n in a)  # rank > 0: the root's own parameters
    return out["shardplan"][1], out["fsdp2"][1], diff, sorted(set(b) - set(a))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_fully_shard_blocks_only_trains_like_fsdp2(world):
    for rank, (moved, moved_fsdp2, diff, missing) in enumerate(run(_blocks_only_worker, world)):
        assert diff < 1e-5, (rank, diff)
        if rank == 0:
            assert moved > 1e-3 and moved_fsdp2 > 1e-3, (moved, moved_fsdp2)
            assert not missing, missing


# -- ranks whose models differ (item 6) ----------------------------------------------------------------------

def _seeds_worker(rank, world):
    out = {}
    # different seeds: refused on every rank, naming parameters
    model = Toy(seed=rank)
    try:
        sp.shard(model, sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0))
        out["refused"] = None
    except sp.errors.RuntimeShardingError as exc:
        out["refused"] = str(exc)
    # one replicated parameter nudged on one rank: still caught
    model = Toy()
    if rank == world - 1:
        with torch.no_grad():
            model.blocks[2].ln.weight[3] += 1e-3
    try:
        sp.shard(model, sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0))
        out["nudged"] = None
    except sp.errors.RuntimeShardingError as exc:
        out["nudged"] = str(exc)
    # sync_module_states=True: rank 0's model everywhere, trains like one process on it
    data = batches(2)
    ref = Toy(seed=0)
    ref_losses = _toy_losses(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data, 0, 1, False)
    model = Toy(seed=rank)
    sp.shard(model, sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0),
             sync_module_states=True)
    out["synced"] = (_toy_losses(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data, rank, world, True),
                     ref_losses)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_with_different_models_are_refused(world):
    for out in run(_seeds_worker, world):
        assert out["refused"] and "differ before sharding" in out["refused"] and "emb.weight" in out["refused"]
        assert "sync_module_states=True" in out["refused"]
        assert out["nudged"] and "blocks.2.ln.weight" in out["nudged"] and "blocks.1.ln.weight" not in out["nudged"]
        losses, ref_losses = out["synced"]
        assert losses == pytest.approx(ref_losses, abs=1e-6)


# -- FSDP2's gradient-sync switch and start-up broadcast on every face (issue 39 item 5) ----------------------

def _accumulate(model, data, rank, world, switch):
    """Two micro-batches per step (the first without gradient sync), one AdamW step; the parameters after it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = data[0][0].shape[0] // world
    for i, (x, y) in enumerate(data[:2]):
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        if switch:
            model.set_requires_gradient_sync(i == 1)
            model(x, y).backward()
        else:
            with sp.no_sync(model) if i == 0 else __import__("contextlib").nullcontext():
                model(x, y).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _sync_api_worker(rank, world):
    from shardplan import fully_shard
    data = batches(2)
    plan = lambda m: sp.plan(m, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0)
    a, b = Toy(), Toy()
    switched = _accumulate(sp.shard(a, plan(a)), data, rank, world, switch=True)
    with_no_sync = _accumulate(sp.shard(b, plan(b)), data, rank, world, switch=False)
    out = {"same_as_no_sync": all(torch.equal(p, q) for p, q in zip(switched, with_no_sync))}
    c = Toy()
    eng = sp.runtime.engine_of(sp.shard(c, plan(c)))
    c.set_requires_gradient_sync(False)
    out["off"] = eng.sync is False
    c.set_requires_gradient_sync(True, recurse=False)
    out["on"] = eng.sync is True
    # fully_shard(sync_module_states=True): ranks built with different seeds train rank 0's model
    ref = Toy(seed=0)
    ref_losses = _toy_losses(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data, 0, 1, False)
    model = Toy(seed=rank)
    for blk in model.blocks:
        fully_shard(blk, sync_module_states=True)
    fully_shard(model, sync_module_states=True)
    out["synced"] = (_toy_losses(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data, rank, world, True),
                     ref_losses)
    model = Toy(seed=rank)
    fully_shard(model)
    try:
        model.parameters()
        out["refused"] = None
    except sp.errors.RuntimeShardingError as exc:
        out["refused"] = str(exc)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shard_has_set_requires_gradient_sync_and_fully_shard_syncs_module_states():
    for out in run(_sync_api_worker, 2):
        assert out["same_as_no_sync"] and out["off"] and out["on"], out
        losses, ref_losses = out["synced"]
        assert losses == pytest.approx(ref_losses, abs=1e-6)
        assert out["refused"] and "fully_shard(model, sync_module_states=True)" in out["refused"]
