"""The start of an FSDP2 run on ``sp.fully_shard``, against torch's own ``fully_shard`` on the same code (issue 36):

* item 8: right after the ``fully_shard`` calls (blocks, then root), before any forward, everything FSDP2 allows
  works and gives FSDP2's values: ``model.state_dict()``, ``sp.checkpoint.full_state_dict``, ``get_model_state_dict``, DCP
  save and load, an optimizer built from ``model.parameters()`` and the training after it;
* item 11: torchtitan's meta-device start-up: build under ``torch.device("meta")``, ``fully_shard`` blocks then
  root, ``model.to_empty(device="cpu")``, the model's own ``init_weights()`` (seeded; the root has no
  ``reset_parameters``), then training: the initialised shards and the losses equal FSDP2's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import shardplan as sp
from distributed import run

TOL = dict(rtol=1e-6, atol=1e-6)


# -- a torchtitan-like Transformer: init_weights on the root (no reset_parameters), per-block init_weights ----------

class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def init_weights(self, std):
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)

    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class FeedForward(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False), nn.Linear(d, h, bias=False)

    def init_weights(self, std):
        nn.init.xavier_uniform_(self.w1.weight)  # reads the weight's shape: the global one under FSDP2
        for lin in (self.w2, self.w3):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=std)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d, h, layer_id):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attention, self.feed_forward = Attention(d), FeedForward(d, h)
        self.std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self):
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.std)
        self.feed_forward.init_weights(self.std)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, vocab=37, d=16, h=24, n=3, seq=6):
        super().__init__()
        self.dim, self.seq = d, seq
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleDict({str(i): Block(d, h, i) for i in range(n)})
        self.norm = nn.RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)
        self.out_scale = nn.Parameter(torch.ones(d))  # the root's own: it has no reset_parameters
        self.register_buffer("pos", self._positions(), persistent=False)  # torchtitan's freqs_cis, in small

    def _positions(self):
        return torch.sin(torch.arange(self.seq * self.dim, dtype=torch.float32).view(self.seq, self.dim) / 7.0)

    def init_weights(self, buffer_device=None):
        with torch.device(buffer_device or self.pos.device):
            self.pos = self._positions()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        nn.init.ones_(self.out_scale)
        std = self.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, idx):
        h = self.tok_embeddings(idx) + self.pos[: idx.shape[1]]
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h) * self.out_scale)


def _fully_shard(kind):
    if kind == "torch":
        from torch.distributed.fsdp import fully_shard
        return fully_shard
    return sp.fully_shard


def _wrap(kind, model, mesh=None):
    fs = _fully_shard(kind)
    for layer in model.layers.values():
        fs(layer, mesh=mesh)
    fs(model, mesh=mesh)
    return model


def _data(rank, world, n=3, b=2, vocab=37, seq=6):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (b * world, seq), generator=g)
        y = torch.randint(0, vocab, (b * world, seq), generator=g)
        out.append((x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]))
    return out


def _train(model, opt, data):
    losses = []
    for x, y in data:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return {k: v.detach().clone() for k, v in
            get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}


def _fulls(sd: dict) -> dict:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()}


def _built(seed=0):
    torch.manual_seed(seed)
    return Transformer()


# -- item 8: right after fully_shard --------------------------------------------------------------------------------

def _right_after(kind, rank, world, path, mesh_shape):
    """Each use below is the first use of a freshly wrapped model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    mesh = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp_replicate", "dp_shard"))
    fresh = lambda seed=0: _wrap(kind, _built(seed), mesh)  # noqa: E731
    out = {}
    sd = fresh().state_dict()
    out["state_dict_types"] = sorted({type(v).__name__ for v in sd.values()})
    out["state_dict"] = _fulls(sd)
    out["get_model_state_dict"] = _fulls(get_model_state_dict(fresh()))
    out["get_full"] = get_model_state_dict(fresh(), options=StateDictOptions(full_state_dict=True))
    if kind == "sp":
        full = sp.checkpoint.full_state_dict(fresh())
        out["sp_full_state_dict"] = full if rank == 0 else {}
    dcp.save({"model": fresh().state_dict()}, checkpoint_id=f"{path}/{kind}")
    dist.barrier()
    loaded = fresh(seed=3)  # other values: the load must bring the saved ones
    target = {"model": loaded.state_dict()}
    dcp.load(target, checkpoint_id=f"{path}/{kind}")
    loaded.load_state_dict(target["model"])
    out["dcp_loaded"] = _full(loaded)
    m = fresh()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)  # before any forward
    out["losses"] = _train(m, opt, _data(rank, world))
    out["trained"] = _full(m)
    out["dcp_loaded_losses"] = _train(loaded, torch.optim.AdamW(loaded.parameters(), lr=1e-2), _data(rank, world))
    return out


def _worker_right_after(rank, world, path, mesh_shape):
    return {kind: _right_after(kind, rank, world, path, mesh_shape) for kind in ("torch", "sp")}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, str):
        return a == b
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), **TOL)


def _check_right_after(results):
    for rank, res in enumerate(results):
        ours, theirs = res["sp"], res["torch"]
        for key in theirs:
            assert _same(ours[key], theirs[key]), (rank, key)
        if rank == 0:
            assert _same(ours["sp_full_state_dict"], theirs["get_full"]), rank
        assert ours["state_dict_types"] == ["DTensor"], ours["state_dict_types"]


@pytest.mark.timeout(240)
def test_right_after_fully_shard_two_ranks(tmp_path):
    _check_right_after(run(_worker_right_after, 2, str(tmp_path), None, timeout=220))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_right_after_fully_shard_four_ranks_hsdp(tmp_path):
    _check_right_after(run(_worker_right_after, 4, str(tmp_path), (2, 2), timeout=280))


# -- item 11: torchtitan's meta-device start-up ----------------------------------------------------------------------

def _torchtitan_start(kind, rank, world, mesh_shape):
    mesh = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp_replicate", "dp_shard"))
    with torch.device("meta"):
        model = Transformer()
    _wrap(kind, model, mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(7)  # the same seed on every rank, as torchtitan seeds
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {"init": _full(model)}
    out["losses"] = _train(model, opt, _data(rank, world))
    out["trained"] = _full(model)
    return out


def _worker_torchtitan(rank, world, mesh_shape):
    res = {kind: _torchtitan_start(kind, rank, world, mesh_shape) for kind in ("torch", "sp")}
    res["errors"] = _start_errors(rank, world)
    return res


def _start_errors(rank, world):
    """What the start-up still refuses, each naming the fix."""
    out = {}

    def catch(key, fn):
        try:
            fn()
            out[key] = "no error"
        except sp.ShardingError as exc:
            out[key] = str(exc)

    with torch.device("meta"):
        m = Transformer()
    _wrap("sp", m)
    catch("no_to_empty", lambda: m(torch.zeros(1, 6, dtype=torch.long)))  # the root has no reset_parameters
    with torch.device("meta"):
        m = Transformer()
    _wrap("sp", m)
    catch("block_to_empty", lambda: m.layers["0"].to_empty(device="cpu"))
    m.to_empty(device="cpu")

    def replace():
        m.output.weight = nn.Parameter(torch.zeros(37, 16))
        m.parameters()
    catch("replaced", replace)
    with torch.device("meta"):
        m = Transformer()
    _wrap("sp", m)
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.init_weights()
    m(torch.zeros(1, 6, dtype=torch.long))
    catch("to_empty_after_use", lambda: m.to_empty(device="cpu"))
    catch("inner_unit", lambda: sp.checkpoint.full_state_dict(m.layers["0"]))  # shardplan's functions take the root
    return out


def _check_torchtitan(results):
    for rank, res in enumerate(results):
        ours, theirs = res["sp"], res["torch"]
        for key in ("init", "losses", "trained"):
            assert _same(ours[key], theirs[key]), (rank, key)
        errors = res["errors"]
        assert "to_empty(device=...)" in errors["no_to_empty"] and "init_weights" in errors["no_to_empty"], errors
        assert "Transformer" in errors["no_to_empty"], errors
        assert "call to_empty(device=...) on the root model" in errors["block_to_empty"], errors
        assert "['output.weight']" in errors["replaced"] and "in place" in errors["replaced"], errors
        assert "to_empty" in errors["to_empty_after_use"] and "before" in errors["to_empty_after_use"], errors
        assert "pass the root model" in errors["inner_unit"], errors


@pytest.mark.slow  # fully_shard's start-up: test_right_after_fully_shard_two_ranks
@pytest.mark.timeout(240)
def test_torchtitan_meta_start_two_ranks():
    _check_torchtitan(run(_worker_torchtitan, 2, None, timeout=220))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchtitan_meta_start_four_ranks():
    _check_torchtitan(run(_worker_torchtitan, 4, None, timeout=280))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchtitan_meta_start_four_ranks_hsdp():
    results = run(_worker_torchtitan, 4, (2, 2), timeout=280)
    for res in results:
        for key in ("init", "losses", "trained"):
            assert _same(res["sp"][key], res["torch"][key]), key
