"""A checkpoint of another form than the loader reads (full vs sharded, functional vs module, a bare DCP
model state dict, another optimizer, a changed parameter set) raises a CheckpointError that names what
differs and how to load or convert it; a run's checkpoint directory keeps the last K complete ones."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import shardplan as sp
from distributed import run
from models import Toy, batches, toy_rules


def _sharded(rank, world, seed=0, **kw):
    model = Toy(seed=seed, **kw)
    plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0)
    sp.shard(model, plan)
    return model, plan


def _train(model, opt, rank, world):
    x, y = batches(1)[0]
    per = x.shape[0] // world
    model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
    opt.step()
    opt.zero_grad()


def _error(fn) -> str:
    try:
        fn()
    except sp.errors.CheckpointError as exc:
        return str(exc)
    return "no error"


def _writer(rank, world, root):
    model, plan = _sharded(rank, world)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, adamw, rank, world)
    sp.checkpoint.save(f"{root}/module", model, adamw, step=1)
    sp.checkpoint.save(f"{root}/no_opt", model, step=1)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    _train(model, sgd, rank, world)
    sp.checkpoint.save(f"{root}/sgd", model, sgd, step=2)
    dcp.save(sp.checkpoint.state_dict(model)["model"], checkpoint_id=f"{root}/bare")  # FSDP2 style: no "model." prefix
    full = sp.checkpoint.full_state_dict(model)
    if rank == 0:
        os.makedirs(f"{root}/full_dir", exist_ok=True)
        torch.save(full, f"{root}/full.pt")
        torch.save(full, f"{root}/full_dir/model.pt")
    params = sp.shard_tree(dict(Toy().named_parameters()), plan)
    sp.checkpoint.save_tree(f"{root}/tree", plan, {"params": params}, step=3)
    untied = Toy()
    untied.head.weight = nn.Parameter(untied.emb.weight.detach().clone())
    uplan = sp.plan(untied, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0)
    sp.shard(untied, uplan)
    sp.checkpoint.save(f"{root}/untied", untied, step=1)
    return True


def _reader(rank, world, root):
    model, plan = _sharded(rank, world, seed=5)
    adamw = lambda: torch.optim.AdamW(model.parameters(), lr=1e-3)  # noqa: E731
    out = {
        "file": _error(lambda: sp.checkpoint.load(f"{root}/full.pt", model)),
        "full_dir": _error(lambda: sp.checkpoint.load(f"{root}/full_dir", model)),
        "tree": _error(lambda: sp.checkpoint.load(f"{root}/tree", model)),
        "bare": _error(lambda: sp.checkpoint.load(f"{root}/bare", model)),
        "no_opt": _error(lambda: sp.checkpoint.load(f"{root}/no_opt", model, adamw())),
        "sgd": _error(lambda: sp.checkpoint.load(f"{root}/sgd", model, adamw())),
        "untied": _error(lambda: sp.checkpoint.load(f"{root}/untied", model)),
        "missing": _error(lambda: sp.checkpoint.load(f"{root}/nothing_here", model)),
        "module_as_tree": _error(lambda: sp.checkpoint.load_tree(
            f"{root}/module", plan, {"params": sp.shard_tree(dict(Toy().named_parameters()), plan)})),
    }
    out["no_opt_model_only"] = sp.checkpoint.load(f"{root}/no_opt", model)  # the fixes the messages name work
    sd = sp.checkpoint.state_dict(model)
    dcp.load(sd["model"], checkpoint_id=f"{root}/bare")
    sp.checkpoint.load_state_dict(model, sd)
    loaded, saved = sp.checkpoint.full_state_dict(model), torch.load(f"{root}/full.pt") if rank == 0 else {}
    out["bare_recipe"] = all(torch.equal(loaded[k], v) for k, v in saved.items())
    bigger, _ = _sharded(rank, world, n=4)  # one block more: a changed parameter set
    out["bigger"] = _error(lambda: sp.checkpoint.load(f"{root}/module", bigger))
    wider, _ = _sharded(rank, world, h=31)
    out["wider"] = _error(lambda: sp.checkpoint.load(f"{root}/module", wider))
    full = torch.load(f"{root}/full.pt") if rank == 0 else {}
    out["nested"] = _error(lambda: sp.checkpoint.load_full_state_dict(model, {"model": full, "step": 3} if rank == 0 else {}))
    out["prefixed"] = _error(lambda: sp.checkpoint.load_full_state_dict(
        model, {f"module.{k}": v for k, v in full.items()} if rank == 0 else {}))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoints_of_another_form_say_what_they_are_and_how_to_load_them(tmp_path):
    root = str(tmp_path)
    run(_writer, 2, root)
    os.makedirs(f"{root}/killed.tmp-0123abcd")
    for r in run(_reader, 2, root):
        assert "is a file" in r["file"] and "sp.checkpoint.load_full_state_dict(model, torch.load(path)" in r["file"], r["file"]
        assert "holds full state dict files (model.pt)" in r["full_dir"], r["full_dir"]
        assert "functional checkpoint" in r["tree"] and "sp.checkpoint.load_tree" in r["tree"], r["tree"]
        assert "saved at step 3" in r["tree"], r["tree"]
        assert "saved directly" in r["bare"] and "sd = sp.checkpoint.state_dict(model)" in r["bare"], r["bare"]
        assert "holds no optimizer state" in r["no_opt"] and "no optimizer" in r["no_opt"], r["no_opt"]
        assert "momentum_buffer" in r["sgd"] and "exp_avg, exp_avg_sq" in r["sgd"], r["sgd"]
        assert "another optimizer type" in r["sgd"], r["sgd"]
        assert "head.weight (= emb.weight)" in r["untied"], r["untied"]
        assert "no checkpoint at" in r["missing"] and "module" in r["missing"], r["missing"]
        assert "module checkpoint (sp.checkpoint.save)" in r["module_as_tree"], r["module_as_tree"]
        assert r["no_opt_model_only"] == 1 and r["bare_recipe"]
        assert "parameters of the model not in the checkpoint (" in r["bigger"] and "blocks.3.fc1.weight" in r["bigger"]
        assert "strict=False" in r["bigger"] and "nothing loaded" in r["bigger"], r["bigger"]
        assert "global shapes that differ" in r["wider"] and "(29, 13)" in r["wider"], r["wider"]
        assert "full_state_dict" in r["wider"], r["wider"]
        assert "pass full['model']" in r["nested"], r["nested"]
        assert "names differ by a prefix" in r["prefixed"] and "'module.'" in r["prefixed"], r["prefixed"]
    msg = str(pytest.raises(sp.errors.CheckpointError, _load_meta, f"{root}/killed.tmp-0123abcd").value)
    assert "did not finish" in msg, msg
    msg = str(pytest.raises(sp.errors.CheckpointError, _load_meta, root).value)
    assert "directory of checkpoints" in msg and "module" in msg, msg


def _load_meta(path):
    from shardplan.runtime.checkpoint.dcp_io import _metadata
    return _metadata(path)


def _fake(root, step, complete=True):
    path = sp.checkpoint.step_dir(root, step)
    os.makedirs(path)
    if complete:
        open(os.path.join(path, ".shardplan-complete"), "w").close()
    return path


def test_latest_and_prune_keep_complete_checkpoints_only(tmp_path):
    root = str(tmp_path / "ck")
    assert sp.checkpoint.latest(root) is None
    for step in (2, 4, 6, 10):
        _fake(root, step)
    unfinished = _fake(root, 12, complete=False)  # a directory without its marker is not a checkpoint
    os.makedirs(sp.checkpoint.step_dir(root, 14) + ".tmp-0123abcd")  # what a killed save leaves
    assert sp.checkpoint.latest(root) == sp.checkpoint.step_dir(root, 10)
    removed = sp.checkpoint.prune(root, keep=2)
    assert sorted(os.path.basename(p) for p in removed) == ["step_00000002", "step_00000004", "step_00000014.tmp-0123abcd"]
    assert sorted(os.listdir(root)) == ["step_00000006", "step_00000010", "step_00000012"]
    assert os.path.isdir(unfinished)  # not touched: it may be a save in flight of another writer
    msg = str(pytest.raises(sp.errors.CheckpointError, _load_meta, root).value)
    assert "directory of checkpoints" in msg and "step_00000010" in msg
    with pytest.raises(sp.errors.CheckpointError, match="keep at least"):
        sp.checkpoint.prune(root, keep=0)
