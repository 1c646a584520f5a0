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
        full = sp.full_state_dict(model)
        diff = max((full[n] - p).abs().max().item() for n, p in ref_params.items()) if rank == 0 else 0.0
        out[(how, strategy, order)] = (losses, diff, n_units)
    return ref_losses, out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_t5_passthrough_units_train_like_one_process(world):
    for ref_losses, out in run(_t5_worker, world, timeout=560):
        for case, (losses, diff, n_units) in out.items():
            assert n_units > 1 or case[0] == "auto_rules", (case, n_units)  # the blocks really are units (the case this tests)
            assert losses == pytest.approx(ref_losses, abs=2e-6), case
            assert diff < 2e-6, (case, diff)
