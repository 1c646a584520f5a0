"""torch's optimizer contract on every layout (issue 49, item 4): ``opt.state_dict()`` / ``opt.load_state_dict``,
``copy.deepcopy`` and a per-rank ``torch.save`` / ``torch.load`` resume bit for bit over ``sp.shard``'s default
(packed, contiguous) layout as over the chunked one; a local state dict loads only where the rank holds the same
shards, and DCP refuses it. On models this project did not write: a tiny Hugging Face Llama from a config and
torch's ``nn.TransformerEncoder``, at 2 gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardplan as sp
from distributed import run

KEY = "shardplan_local_states"
LLAMA_RULES = [(r".*norm\.weight", sp.P()), (r".*mlp\.down_proj\.weight", sp.P(None, "dp")), (r".*", sp.P("dp"))]


class Encoder(nn.Module):
    """torch's TransformerEncoder with a linear read-out and a regression loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 24, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 1)

    def forward(self, x, y):
        return F.mse_loss(self.head(self.enc(x)).squeeze(-1), y)


def _llama():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _build(kind: str, layout: str, world: int):
    if kind == "llama":
        model, rules, units = _llama(), LLAMA_RULES, [r"model\.layers\.\d+"]
    else:
        model, rules, units = Encoder(), [(r".*", sp.P("dp"))], [r"enc\.layers\.\d+"]
    plan = sp.plan(model, rules, sp.Mesh(dp=world), units=units, min_unit_bytes=0, layout=layout)
    model = sp.shard(model, plan)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), plan


def _step(kind, model, opt, step: int, rank: int, world: int) -> float:
    g = torch.Generator().manual_seed(100 + step)
    per = 4 // world
    if kind == "llama":
        ids = torch.randint(0, 97, (4, 12), generator=g)[rank * per:(rank + 1) * per]
        loss = model(input_ids=ids, labels=ids).loss
    else:
        x, y = torch.randn(4, 6, 16, generator=g), torch.randn(4, 6, generator=g)
        loss = model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _shards(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(kind, model, opt, steps, rank, world):
    losses = [_step(kind, model, opt, s, rank, world) for s in steps]
    return losses, _shards(model)


def _same(a, b) -> bool:
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][n], b[1][n]) for n in a[1])


def _refusal(fn) -> str:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - (DCP raises CheckpointException, a BaseException)
        return f"{type(exc).__name__}: {exc}"
    return ""


# -- the fast case: the packed layout, in one group of processes ------------------------------------------

def _packed_worker(rank, world, path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    model, opt, plan = _build("encoder", "auto", world)
    out = {"contiguous": "contiguous" in {b.layout for b in plan.buffers}}
    _train("encoder", model, opt, range(2), rank, world)
    sd = opt.state_dict()  # raised CheckpointError before (issue 49)
    out["marked"] = KEY in sd["param_groups"][0]
    out["local"] = all(type(v) is torch.Tensor for st in sd["state"].values() for v in st.values())
    saved, shards = copy.deepcopy(sd), _shards(model)  # a learning-rate finder's snapshot
    first = _train("encoder", model, opt, range(2, 4), rank, world)
    opt.load_state_dict(saved)
    model.load_state_dict(shards, strict=False)
    out["deepcopy_resumes"] = _same(_train("encoder", model, opt, range(2, 4), rank, world), first)
    torch.save(opt.state_dict(), f"{path}-{rank}.pt")
    dist.barrier()
    opt.load_state_dict(torch.load(f"{path}-{rank}.pt"))  # weights_only: the marker is a safe global
    out["swapped"] = _refusal(lambda: opt.load_state_dict(torch.load(f"{path}-{1 - rank}.pt")))
    osd = get_optimizer_state_dict(model, opt)
    out["dcp"] = _refusal(lambda: dcp.save({"optim": osd}, checkpoint_id=f"{path}-dcp"))
    return out


@pytest.mark.timeout(300)
def test_packed_layout_optimizer_state_dict_round_trips_and_refuses_elsewhere(tmp_path):
    for rank, out in enumerate(run(_packed_worker, 2, str(tmp_path / "opt"), timeout=240)):
        assert out["contiguous"] and out["marked"] and out["local"], out
        assert out["deepcopy_resumes"], rank
        assert "CheckpointError" in out["swapped"] and f"rank {1 - rank} of 2" in out["swapped"] \
            and "shardplan.checkpoint.save" in out["swapped"], out["swapped"]
        assert "cannot be given as DTensors" in out["dcp"] and "shardplan.checkpoint.save" in out["dcp"], out["dcp"]


# -- slow: per-rank torch.save, resumed in fresh processes, on both models and both layouts ----------------

def _save_worker(rank, world, path, kind, layout):
    model, opt, plan = _build(kind, layout, world)
    _train(kind, model, opt, range(2), rank, world)
    torch.save({"model": _shards(model), "optim": opt.state_dict()}, f"{path}-{rank}.pt")
    return (*_train(kind, model, opt, range(2, 5), rank, world), {b.layout for b in plan.buffers})


def _resume_worker(rank, world, path, kind, layout):
    model, opt, _ = _build(kind, layout, world)
    ck = torch.load(f"{path}-{rank}.pt")
    model.load_state_dict(ck["model"], strict=False)
    opt.load_state_dict(ck["optim"])  # a never-stepped optimizer: checked at its first step
    return _train(kind, model, opt, range(2, 5), rank, world)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["llama", "encoder"])
@pytest.mark.parametrize("layout", ["auto", "chunked"])
def test_per_rank_torch_save_resumes_bit_for_bit(tmp_path, kind, layout):
    if kind == "llama":
        pytest.importorskip("transformers", reason="the test extra installs transformers")
    path = str(tmp_path / "ck")
    ran = run(_save_worker, 2, path, kind, layout, timeout=280)
    resumed = run(_resume_worker, 2, path, kind, layout, timeout=280)
    # the llama's rules put every layout in one plan: packed (contiguous) or chunked, interleaved, replicated
    assert kind != "llama" or ran[0][2] == {"contiguous" if layout == "auto" else "interleaved", "interleaved",
                                            "replicated"}, ran[0][2]
    for rank, (a, b) in enumerate(zip(ran, resumed)):
        assert a[0] == b[0], (rank, a[0], b[0])
        assert all(torch.equal(a[1][n], b[1][n]) for n in a[1]), rank


# -- slow: the refusals ---------------------------------------------------------------------------------------

def _elsewhere_worker(rank, world, path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict)
    out = {}
    if world == 2:
        model, opt, _ = _build("llama", "auto", world)
        _train("llama", model, opt, range(1), rank, world)
        torch.save(opt.state_dict(), f"{path}-{rank}.pt")
        dist.barrier()
        other = f"{path}-{1 - rank}.pt"
        fresh_model, fresh = _build("llama", "auto", world)[:2]
        fresh.load_state_dict(torch.load(other))  # no hooks yet: refused at the first step, before any update
        out["fresh"] = _refusal(lambda: _step("llama", fresh_model, fresh, 0, rank, world))
        out["fresh_again"] = _refusal(lambda: _step("llama", fresh_model, fresh, 0, rank, world))  # still refused
        chunked = _build("llama", "chunked", world)
        _train("llama", chunked[0], chunked[1], range(1), rank, world)
        out["other_plan"] = _refusal(lambda: chunked[1].load_state_dict(torch.load(f"{path}-{rank}.pt")))
        torch.save(chunked[1].state_dict(), f"{path}-chunked-{rank}.pt")  # DTensor states
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        osd = get_optimizer_state_dict(model, opt, options=flat)
        out["dcp_flat"] = _refusal(lambda: dcp.save({"optim": osd}, checkpoint_id=f"{path}-dcp"))
        out["get_state_dict"] = _refusal(lambda: get_state_dict(model, opt))
    else:  # world 1: rank 0's local states of the world-2 run
        model, opt, _ = _build("llama", "auto", world)
        _train("llama", model, opt, range(1), rank, world)
        out["other_world"] = _refusal(lambda: opt.load_state_dict(torch.load(f"{path}-0.pt")))
        # a DTensor torch.save wrote at world 2: its mesh's process groups are not this run's
        chunked = _build("llama", "chunked", world)
        _train("llama", chunked[0], chunked[1], range(1), rank, world)
        out["dtensor_other_world"] = _refusal(lambda: chunked[1].load_state_dict(torch.load(f"{path}-chunked-0.pt")))
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_states_refused_on_other_shards_and_by_dcp(tmp_path):
    pytest.importorskip("transformers", reason="the test extra installs transformers")
    path = str(tmp_path / "ck")
    for rank, out in enumerate(run(_elsewhere_worker, 2, path, timeout=280)):
        for key in ("fresh", "other_plan"):
            assert "CheckpointError" in out[key] and "shardplan.checkpoint.load" in out[key], (key, out[key])
        assert f"rank {1 - rank} of 2" in out["fresh"] and "first step" in out["fresh"], out["fresh"]
        assert "CheckpointError" in out["fresh_again"], out["fresh_again"]
        assert "cannot be given as DTensors" in out["dcp_flat"], out["dcp_flat"]
        assert "CheckpointError" in out["get_state_dict"] and "cannot be given as a DTensor" in out["get_state_dict"]
    (one,) = run(_elsewhere_worker, 1, path, timeout=200)
    assert "rank 0 of 2" in one["other_world"] and "rank 0 of 1" in one["other_world"], one["other_world"]
    assert "CheckpointError" in one["dtensor_other_world"] and "the world has 1" in one["dtensor_other_world"] \
        and "shardplan.checkpoint.load" in one["dtensor_other_world"], one["dtensor_other_world"]
