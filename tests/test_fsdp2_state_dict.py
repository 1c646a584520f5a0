"""FSDP2 checkpoint code on shardplan models (issue 18, item 3): ``model.state_dict()`` gives DTensors, so
``torch.distributed.checkpoint`` and ``get/set_model_state_dict`` reshard and export correctly; ``sp.shard``
plans whose layout a DTensor cannot describe refuse clearly."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, Shard

import shardplan as sp
from distributed import run
from models import Toy, batches, toy_rules

sys.path.insert(0, "examples")
import gpt  # noqa: E402

FULL = StateDictOptions(full_state_dict=True)


def _toy(seed=0):
    return Toy(seed=seed)


def _gpt(seed=0):
    return gpt.build("tiny").init_weights(seed)


def _wrap(model, fs, mesh=None):
    blocks = model.blocks if hasattr(model, "blocks") else model.layers
    for b in blocks:
        fs(b, mesh=mesh)
    fs(model, mesh=mesh)
    return model


def _sp(make, seed=0, mesh=None):
    return _wrap(make(seed), sp.fully_shard, mesh)


def _fsdp2(make, seed=0, mesh=None):
    from torch.distributed.fsdp import fully_shard
    return _wrap(make(seed), fully_shard, mesh)


def _mine(rank, world, n=3):
    per = 8 // world
    return [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]) for x, y in batches(n, batch=8)]


def _train(model, opt, data):
    out = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _equal(a: dict, b: dict) -> bool:
    def full(v):
        return v.full_tensor() if isinstance(v, DTensor) else v
    return set(a) == set(b) and all(torch.equal(full(a[k]).cpu(), full(b[k]).cpu()) for k in b)


def _shards(model) -> dict:
    # (a module still gathered after a forward holds full ones; fully_shard's parameters are DTensors: their shards)
    return {n: p.to_local() if isinstance(p, DTensor) else p
            for n, p in sp.runtime.api.engine_of(model).local_params().items()}


def _perturb(model):
    with torch.no_grad():
        for p in _shards(model).values():
            p.add_(1.0)


def _dcp_roundtrip(model, path) -> bool:
    """Save, perturb, load in place + load_state_dict: every rank's shards back exactly."""
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    before = {n: p.detach().clone() for n, p in _shards(model).items()}
    _perturb(model)
    sd = model.state_dict()
    dcp.load({"model": sd}, checkpoint_id=path)
    model.load_state_dict(sd)
    return all(torch.equal(before[n], p) for n, p in _shards(model).items())


def _worker(rank, world, tmp, reshard_from):
    res = {}
    # (2) full export equals the unsharded model; cpu_offload gives rank 0 the full dict
    m = _sp(_toy)
    ref = _toy().state_dict()
    res["full"] = _equal(get_model_state_dict(m, options=FULL), ref)
    off = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    res["full_cpu"] = _equal(off, ref) if rank == 0 else off == {}
    sharded = get_model_state_dict(m)
    res["sharded_get"] = all(isinstance(v, DTensor) for k, v in sharded.items() if k != "scale") and _equal(sharded, ref)
    res["buffer_plain"] = type(m.state_dict()["scale"]) is torch.Tensor
    res["tied"] = m.state_dict()["head.weight"].to_local().data_ptr() == m.state_dict()["emb.weight"].to_local().data_ptr()

    # (4) the same DTensor state dict as torch FSDP2 on the same model (keys, shapes, placements, values)
    for make, label in [(_toy, "toy"), (_gpt, "gpt")]:
        ours, theirs = _sp(make).state_dict(), _fsdp2(make).state_dict()
        res[f"vs_fsdp2_{label}"] = list(ours) == list(theirs) and all(
            type(ours[k]) is type(theirs[k]) and ours[k].shape == theirs[k].shape
            and (not isinstance(ours[k], DTensor) or (tuple(ours[k].placements) == tuple(theirs[k].placements)
                                                      and ours[k].to_local().shape == theirs[k].to_local().shape))
            for k in theirs) and _equal(ours, theirs)
    if world == 4:  # HSDP: (Replicate, Shard(0)) over (replicate, shard)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        ours, theirs = _sp(_toy, mesh=mesh).state_dict(), _fsdp2(_toy, mesh=mesh).state_dict()
        res["vs_fsdp2_hsdp"] = all(tuple(ours[k].placements) == tuple(theirs[k].placements)
                                   for k in theirs if isinstance(theirs[k], DTensor)) and _equal(ours, theirs)
        # FSDP2's DTensors (another mesh) load into ours: gathered and cut to our boxes
        target = _sp(_toy, seed=1, mesh=mesh)
        target.load_state_dict(theirs)
        res["load_fsdp2_sd"] = _equal(get_model_state_dict(target, options=FULL), ref)

    # (3) set_model_state_dict: full from rank 0 (broadcast), full everywhere, sharded
    m3 = _sp(_toy, seed=1)
    # (a copy: torch's broadcast rewrites rank 0's dict into DTensors in place, as for FSDP2's DTensor parameters)
    set_model_state_dict(m3, {k: v.clone() for k, v in ref.items()} if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    res["set_broadcast"] = _equal(get_model_state_dict(m3, options=FULL), ref)
    _perturb(m3)
    set_model_state_dict(m3, {k: v.clone() for k, v in ref.items()}, options=FULL)
    res["set_full"] = _equal(get_model_state_dict(m3, options=FULL), ref)
    _perturb(m3)
    set_model_state_dict(m3, _sp(_toy).state_dict())
    res["set_sharded"] = _equal(get_model_state_dict(m3, options=FULL), ref)
    x, y = _mine(rank, world, 1)[0]
    res["set_forward"] = m3(x, y).item() == pytest.approx(_toy()(x, y).item(), abs=1e-6)

    # (1) DCP in place (uneven shards, tied weights), then training continues as if uninterrupted
    data = _mine(rank, world)
    straight = _sp(_toy)
    expect = _train(straight, torch.optim.AdamW(straight.parameters(), lr=1e-2), data)
    m1 = _sp(_toy)
    opt = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    first = _train(m1, opt, data[:1])
    res["dcp_roundtrip"] = _dcp_roundtrip(m1, f"{tmp}/toy{world}")
    saved_full = get_model_state_dict(m1, options=FULL)  # what the checkpoint holds, for (5) at the next world
    if rank == 0:
        torch.save(saved_full, f"{tmp}/toy{world}.full.pt")
    rest = _train(m1, opt, data[1:])
    res["continues"] = first + rest == expect
    res["dcp_roundtrip_gpt"] = _dcp_roundtrip(_sp(_gpt), f"{tmp}/gpt{world}")

    # (5) reshard: a checkpoint saved from sp.fully_shard at another world size loads here
    if reshard_from:
        m5 = _sp(_toy, seed=1)
        sd = m5.state_dict()
        dcp.load({"model": sd}, checkpoint_id=reshard_from)
        m5.load_state_dict(sd)
        saved = torch.load(f"{reshard_from}.full.pt")
        res["reshard"] = _equal(get_model_state_dict(m5, options=FULL), saved)

    # sp.shard: a contiguous plan refuses, naming the parameter and the fix; a chunked plan gives DTensors
    model = _toy()
    plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0)
    sp.shard(model, plan)
    try:
        model.state_dict()
        res["refuses"] = "no error"
    except sp.errors.CheckpointError as exc:
        res["refuses"] = str(exc)
    full = sp.checkpoint.full_state_dict(model)  # every rank takes part; rank 0 gets the tensors
    res["contiguous_full_export"] = rank != 0 or _equal(full, ref)
    model.load_state_dict(_toy(seed=1).state_dict())  # full plain tensors load into any layout
    full = sp.checkpoint.full_state_dict(model)
    res["contiguous_full_load"] = rank != 0 or _equal(full, _toy(seed=1).state_dict())
    for strategy in ["optim", "optim_grads_params"]:
        model = _toy()
        plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0,
                       layout="chunked", strategy=strategy)
        sp.shard(model, plan)
        sd = model.state_dict()
        res[f"chunked_{strategy}"] = _equal(sd, ref) and sd["blocks.1.fc2.weight"].placements == (Shard(1),)
        model(x, y)  # ZeRO-1 keeps the gathered parameters: a load must make it gather again
        model.load_state_dict(_sp(_toy, seed=1).state_dict())
        res[f"chunked_{strategy}_stale"] = model(x, y).item() == pytest.approx(_toy(seed=1)(x, y).item(), abs=1e-6)
        res[f"chunked_{strategy}_dcp"] = _dcp_roundtrip(model, f"{tmp}/chunked{world}{strategy}")
    dist.barrier()
    return res


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp2_state_dicts_world_4_then_reshard_to_2(tmp_path):
    for world, src in [(4, None), (2, str(tmp_path / "toy4"))]:
        out = run(_worker, world, str(tmp_path), src, timeout=280)
        for rank, res in enumerate(out):
            msg = res.pop("refuses")
            assert "cannot be given as a DTensor" in msg and "shardplan.checkpoint.state_dict" in msg and "checkpoint.save" in msg
            assert any(f"'{n}'" in msg for n in ("frozen", "emb.weight", "blocks.0.ln.weight", "blocks.0.fc1.weight")), msg
            bad = [k for k, v in res.items() if v is not True]
            assert not bad, (world, rank, bad)


def test_chunked_layout_is_a_plan_option():
    model = Toy()
    auto = sp.plan(model, toy_rules(), sp.Mesh(dp=2), units=[r"blocks\.\d+"], min_unit_bytes=0)
    chunked = sp.plan(model, toy_rules(), sp.Mesh(dp=2), units=[r"blocks\.\d+"], min_unit_bytes=0, layout="chunked")
    assert "contiguous" in {b.layout for b in auto.buffers} and "contiguous" not in {b.layout for b in chunked.buffers}
    assert auto.layout == "auto" and "layout" not in json.loads(auto.to_json())  # older plans keep their fingerprints
    assert chunked.fingerprint() != auto.fingerprint()
    assert sp.Plan.from_json(chunked.to_json()).layout == "chunked"
    assert sp.plan(model, **chunked.declarative()).equivalent(chunked) and "layout='chunked'" in chunked.to_source()
    assert chunked.local_slices("blocks.0.fc1.weight", 1) == (slice(15, 29), slice(0, 13))  # torch.chunk's piece
    with pytest.raises(sp.errors.PlanError, match="layout"):
        sp.plan(model, toy_rules(), sp.Mesh(dp=2), layout="rows")


def _one_format_worker(rank, world, path):
    """A chunked plan's checkpoint written from shardplan.checkpoint.state_dict (ShardedTensor values) and one written from
    model.state_dict() (DTensor values): each loads into the other kind, exactly (DCP stores boxes, not types)."""
    def make(seed):
        m = Toy(seed=seed)
        return sp.shard(m, sp.plan(m, toy_rules(), sp.Mesh(dp=world), layout="chunked", min_unit_bytes=0))
    a = make(0)
    want = sp.checkpoint.full_state_dict(a)
    kinds = (type(sp.checkpoint.state_dict(a)["model"]["blocks.0.fc1.weight"]).__name__,
             type(a.state_dict()["blocks.0.fc1.weight"]).__name__)
    dcp.save(sp.checkpoint.state_dict(a), checkpoint_id=f"{path}/sharded")
    dcp.save({"model": a.state_dict()}, checkpoint_id=f"{path}/dtensor")
    b = make(1)
    own = sp.checkpoint.state_dict(b)["model"]  # (model.state_dict() names the tied head too: shardplan's holds one of the two)
    sd = {"model": {k: v for k, v in b.state_dict().items() if k in own}}
    dcp.load(sd, checkpoint_id=f"{path}/sharded")
    b.load_state_dict(sd["model"], strict=False)
    c = make(2)
    sd = sp.checkpoint.state_dict(c)
    dcp.load(sd, checkpoint_id=f"{path}/dtensor")
    sp.checkpoint.load_state_dict(c, sd)
    got_b, got_c = sp.checkpoint.full_state_dict(b), sp.checkpoint.full_state_dict(c)
    return kinds, all(torch.equal(got_b[n], t) and torch.equal(got_c[n], t) for n, t in want.items())


@pytest.mark.timeout(200)
def test_sharded_tensor_and_dtensor_checkpoints_are_one_format(tmp_path):
    for kinds, equal in run(_one_format_worker, 2, str(tmp_path), timeout=190):
        assert kinds == ("ShardedTensor", "DTensor") and equal
