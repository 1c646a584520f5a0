"""torch's ``get_state_dict`` / ``get_optimizer_state_dict`` / ``set_state_dict`` with a plain torch optimizer
over a sharded model (the FSDP2 / torchtitan checkpoint code, unchanged).

Found by the outside-model sweep (benchmarks/runs/sweep_outside.py --ckpt): the optimizer's states were this
rank's plain local shards, which DCP takes for replicated values and saves once (rank 0's copy); loading at
the same world size then gave every rank rank 0's moments without any error, and
``full_state_dict=True`` returned local shards as if full. They are DTensors now, as FSDP2 gives them, from
``opt.state_dict()`` wherever it is called (no look at the caller); over a layout DTensors cannot describe,
``opt.state_dict()`` gives this rank's local states marked as such, and DCP refuses them with a
``CheckpointError`` naming the way out (tests/test_optimizer_state_dict.py: torch's contract on that layout).
"""

from __future__ import annotations

import sys

import pytest
import torch

import shardplan as sp
from distributed import run

sys.path.insert(0, "examples")
import gpt  # noqa: E402


def _model(how: str, world: int):
    model = gpt.build("tiny").init_weights(0)
    if how == "fully_shard":
        for b in model.layers:
            sp.fully_shard(b)
        sp.fully_shard(model)
    else:  # "chunked": DTensor-describable shards; "auto": the contiguous dim-0 packing, which is not
        sp.shard(model, sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"layers\.\d+"],
                                layout=how))
    return model


def _train(model, opt, rank, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 17), generator=g)[2 * rank:2 * rank + 2]
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(rank, world, path):
    return {how: _roundtrip(rank, world, f"{path}-{how}", how) for how in ("chunked", "fully_shard")} | _refused(rank, world,
                                                                                                                 path)


def _roundtrip(rank, world, path, how):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.tensor import DTensor
    out = {}
    model = _model(how, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, rank, 2)
    saved = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    msd, osd = get_state_dict(model, opt)
    out["dtensor_states"] = all(isinstance(v, DTensor) for st in osd["state"].values() for k, v in st.items()
                                if k != "step")
    out["dtensor_outside"] = all(isinstance(v, DTensor) for st in opt.state_dict()["state"].values()
                                 for k, v in st.items() if k != "step")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    after = _train(model, opt, rank, 2, seed=2)

    model2 = _model(how, world)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    msd2, osd2 = get_state_dict(model2, opt2)
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    out["moments_equal"] = all(torch.equal(opt2.state[p][k], saved[n][k]) for n, p in model2.named_parameters()
                               for k in ("exp_avg", "exp_avg_sq"))
    out["resumed_equal"] = _train(model2, opt2, rank, 2, seed=2) == after
    full = get_optimizer_state_dict(model2, opt2, options=StateDictOptions(full_state_dict=True))
    shapes = dict(model2.state_dict())
    out["full_shapes"] = all(tuple(st["exp_avg"].shape) == tuple(shapes[n].shape) for n, st in full["state"].items())
    return out


def _refused(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    out = {}
    # a layout DTensors cannot describe (sp.shard's contiguous dim-0 packing): its local states are refused by
    # DCP, naming the way out (no look at the caller: the marker in the state dict is what DCP asks)
    model3 = _model("auto", world)
    opt3 = torch.optim.AdamW(model3.parameters(), lr=1e-3)
    _train(model3, opt3, rank, 1)
    osd = get_optimizer_state_dict(model3, opt3)
    try:
        dcp.save({"optim": osd}, checkpoint_id=f"{path}-auto")
        out["refused"] = None
    except BaseException as exc:  # noqa: BLE001 - DCP wraps it in its CheckpointException, a BaseException
        out["refused"] = str(exc)
    out["direct"] = "shardplan_local_states" in opt3.state_dict()["param_groups"][0]  # torch's contract: local states
    return out


@pytest.mark.timeout(300)
def test_torch_get_set_state_dict_with_a_plain_optimizer(tmp_path):
    for out in run(_worker, 2, str(tmp_path / "ck"), timeout=240):
        for how in ("chunked", "fully_shard"):
            assert out[how]["dtensor_states"], how
            assert out[how]["moments_equal"], f"{how}: each rank must get back its own moments"
            assert out[how]["resumed_equal"], how
            assert out[how]["full_shapes"], how
        assert out["chunked"]["dtensor_outside"]  # opt.state_dict() anywhere: DTensor moments, as FSDP2's
        assert out["refused"] is not None and "cannot be given as DTensors" in out["refused"] \
            and "shardplan.checkpoint.save" in out["refused"], out["refused"]
        assert out["direct"]
