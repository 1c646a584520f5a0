"""Model shapes found by the outside-model sweep (benchmarks/runs/sweep_outside.py, sweep_edges.py).

One module object registered at two places (``layers = ModuleList([blk, other, blk])``) crashed
``shard()`` with ``KeyError: 'layers.2.0'`` (start-up looked owners up in the de-duplicated module list);
it trains now, with the losses and parameters of unsharded data-parallel training.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardplan as sp
from distributed import run

V = 31


class Reused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, 16)
        blk = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.layers = nn.ModuleList([blk, nn.Sequential(nn.Linear(16, 16), nn.Tanh()), blk])
        self.head = nn.Linear(16, V)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V, (4, 6), generator=g) for _ in range(3)]


def _train(model, data, rank=None, world=1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids in data:
        if rank is None:  # data-parallel semantics in one process: every rank's half, loss / world
            loss = sum(model(ids[r * 2:(r + 1) * 2]) / 2 for r in range(2))
        else:
            loss = model(ids[rank * 2:(rank + 1) * 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if rank is not None:
            torch.distributed.all_reduce(t)
            t /= world
        losses.append(t.item())
    return losses


def _worker(rank, world):
    out = {}
    data = _batches()
    for face in ("shard_static", "shard_dynamic", "fully_shard"):
        model = Reused()
        if face == "fully_shard":
            for layer in model.layers:
                sp.fully_shard(layer)
            sp.fully_shard(model)
        else:
            order = face.split("_")[1]
            sp.shard(model, sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"layers\.\d+"],
                                    min_unit_bytes=0, order=order))
        losses = _train(model, data, rank, world)
        full = sp.checkpoint.full_state_dict(model)
        out[face] = (losses, full)
    return out


@pytest.mark.timeout(200)
def test_a_module_registered_twice_trains_like_unsharded():
    ref = Reused()
    ref_losses = _train(ref, _batches())
    out = run(_worker, 2, timeout=150)[0]
    for face, (losses, full) in out.items():
        assert losses == pytest.approx(ref_losses, rel=1e-5), face
        for n, p in ref.named_parameters():
            assert torch.allclose(full[n], p.detach(), atol=1e-6), (face, n)


class NaiveExperts(nn.Module):
    """Stacked experts whose forward indexes them by global expert id (as Hugging Face MoE modules do), without
    shardplan.expert_parallel.dispatch: split over ep, each rank would silently use its own experts in place of
    the ones routed to."""

    def __init__(self, num_experts=4, d=8):
        super().__init__()
        self.num_experts = num_experts
        self.w = nn.Parameter(torch.randn(num_experts, d, d))

    def forward(self, x, ids):
        return torch.stack([x[i] @ self.w[int(e)] for i, e in enumerate(ids)])


class NaiveMoE(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.experts = NaiveExperts()

    def forward(self, x):
        ids = torch.zeros(x.shape[0], dtype=torch.long)  # every token to expert 0 (held by ep rank 0 only)
        return self.experts(self.inp(x), ids).pow(2).mean()


def _ep_worker(rank, world):
    model = NaiveMoE()
    plan = sp.plan(model, [(r"experts\.w", sp.P("ep", None, None)), (r".*", sp.P())], sp.Mesh(ep=world),
                   units=(), min_unit_bytes=0)
    assert [m.path for m in plan.axis("ep").modules] == ["experts"]
    sp.shard(model, plan)
    try:
        model(torch.randn(4, 8))
    except sp.errors.RuntimeShardingError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_experts_split_over_ep_without_dispatch_are_refused():
    for msg in run(_ep_worker, 2, timeout=100):
        assert msg is not None and "'experts'" in msg and "dispatch" in msg and "P('dp', None, None)" in msg


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Conv2d(3 if i == 0 else 4, 4, 3, padding=1, bias=False),
                                                   nn.BatchNorm2d(4), nn.ReLU()) for i in range(2)])
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x.flatten(1)), y)


def _bn_worker(rank, world, path, phase, saved=None):
    model = ConvBN()
    sp.shard(model, sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if phase == "save":
        g = torch.Generator().manual_seed(rank)  # every rank its own batches: its own running statistics
        for _ in range(2):
            model(torch.randn(2, 3, 4, 4, generator=g), torch.randint(0, 3, (2,), generator=g)).backward()
            opt.step()
            opt.zero_grad()
        sp.checkpoint.save(path, model, opt, step=2)
        return {k: v.clone() for k, v in model.named_buffers()}
    with pytest.warns(UserWarning, match="older shardplan") if phase == "old" else _nothing():
        sp.checkpoint.load(path, model, opt)
    sd = sp.checkpoint.state_dict(model)
    return {k: v.clone() for k, v in model.named_buffers()}, sorted(k for k in sd["model"] if "running" in k)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoints_hold_buffers(tmp_path):
    """BatchNorm running statistics were not in sp.checkpoint / sp.checkpoint.state_dict: a resumed run silently went on
    with freshly initialised statistics. They are saved (rank 0's, as shard() and full_state_dict use) and loaded
    on every rank, at any world size; a checkpoint without them loads with a warning."""
    path = str(tmp_path / "ck")
    saved = run(_bn_worker, 2, path, "save", timeout=120)
    assert not torch.equal(saved[0]["blocks.0.1.running_mean"], saved[1]["blocks.0.1.running_mean"])
    for world in (2, 4):
        for bufs, keys in run(_bn_worker, world, path, "load", timeout=120):
            assert keys == ["blocks.0.1.running_mean", "blocks.0.1.running_var", "blocks.1.1.running_mean",
                            "blocks.1.1.running_var"]
            for k, v in bufs.items():
                assert torch.equal(v, saved[0][k]), k
    # a checkpoint written without buffers (older shardplan): loads, warns, buffers keep their values
    import shutil
    import torch.distributed.checkpoint as dcp  # noqa: F401
    old = str(tmp_path / "old")
    shutil.copytree(path, old)
    from torch.distributed.checkpoint import FileSystemReader
    meta = FileSystemReader(old).read_metadata()
    for k in [k for k in meta.state_dict_metadata if "running" in k or "num_batches" in k]:
        del meta.state_dict_metadata[k]
    import pickle
    with open(f"{old}/.metadata", "wb") as f:
        pickle.dump(meta, f)
    fresh = ConvBN()
    for bufs, _ in run(_bn_worker, 2, old, "old", timeout=120):
        for k, v in bufs.items():
            assert torch.equal(v, dict(fresh.named_buffers())[k]), k


def _data_assign_worker(rank, world):
    out = {}
    for strategy in ("optim_grads", "optim_grads_params"):
        model = Reused()
        sp.shard(model, sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"layers\.\d+"],
                                min_unit_bytes=0, strategy=strategy, layout="chunked"))
        ids = _batches()[0][rank * 2:(rank + 1) * 2]
        model(ids).backward()
        with torch.no_grad():
            for p in model.parameters():  # in place: fine
                p.sub_(0.1 * p.grad)
                p.grad = None
        model(ids).backward()
        with torch.no_grad():
            for p in model.parameters():  # replaces the tensors: refused (every rank holds a piece of each)
                p.data = p.data - 0.1 * p.grad
                p.grad = None
        try:
            model(ids)
            out[strategy] = None
        except sp.errors.RuntimeShardingError as exc:
            out[strategy] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_replacing_a_parameters_data_is_refused():
    """``p.data = new`` after shard() left the shard the runtime gathers from unchanged: training went on with
    the old values (0.6% loss difference after 3 SGD steps on GPT-2, every strategy). Now the next forward
    raises, naming the parameter and the in-place way."""
    for out in run(_data_assign_worker, 2, timeout=100):
        for strategy, msg in out.items():
            assert msg is not None and "'emb.weight'" in msg and "p.copy_(new)" in msg, strategy
