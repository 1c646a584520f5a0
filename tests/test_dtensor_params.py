"""Issue 37, item 3: a sharded module's parameters are FSDP2's DTensor parameters (``fully_shard``, and
``shard(..., dtensor_params=True)`` on a chunked plan): global shape and numel, ``full_tensor()``, ``to_local()``
(a view of the flat shard, no copy), placements, DTensor gradients; torch's AdamW (foreach), ``clip_grad_norm_``,
``get_state_dict`` / ``set_state_dict`` and ``dcp.save`` / ``dcp.load`` run on them unmodified, with the numbers of
torch's own FSDP2 (or of one process); ``shardplan.checkpoint`` and accumulation still work."""

from __future__ import annotations

import contextlib
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

import shardplan as sp
from distributed import run

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=1e-5, atol=1e-5)


def _llama(seed=0):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def _wrap(kind, model, **kw):
    if kind == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = sp.fully_shard
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _batches(rank, world, n=3, b=2, seq=7):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 97, (b * world, seq), generator=g)
        out.append(ids[rank * b:(rank + 1) * b])
    return out


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(kind, rank, world, steps):
    """AdamW (foreach) on the DTensor parameters, torch's clip_grad_norm_ before each step."""
    m = _wrap(kind, _llama())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
    out = []
    for ids in _batches(rank, world, steps):
        loss = _loss(m, ids)
        loss.backward()
        out.append(float(_full(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))))
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return m, opt, out


def _faces(m) -> list:
    """What a user reads off each parameter, FSDP2's way."""
    return [(n, type(p).__name__, tuple(p.shape), p.numel(), tuple(p.to_local().shape), tuple(p.placements),
             tuple(p.device_mesh.shape)) for n, p in m.named_parameters()]


def _parity(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    res = {}
    runs = {}
    for kind in ("torch", "sp"):
        m, opt, out = _train(kind, rank, world, 3)
        runs[kind] = (m, opt)
        res[f"{kind}_numbers"] = out
        res[f"{kind}_faces"] = _faces(m)
        res[f"{kind}_full"] = {n: p.full_tensor().detach().clone() for n, p in m.named_parameters()}
        res[f"{kind}_moments"] = {k: _full(v["exp_avg"]).clone() for k, v in opt.state_dict()["state"].items()}
        msd, osd = get_state_dict(m, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/{kind}")
        dist.barrier()
    m, opt = runs["sp"]
    eng = sp.runtime.api.engine_of(m)
    flat = {b.shard.untyped_storage().data_ptr() for b in eng.buffer.values()}
    res["no_copy"] = all(p.to_local().untyped_storage().data_ptr() in flat for p in m.parameters())
    res["grads_dtensor_after_backward"] = None
    loss = _loss(m, _batches(rank, world, 1)[0])
    loss.backward()
    res["grads_dtensor_after_backward"] = all(isinstance(p.grad, DTensor) and p.grad.placements == p.placements
                                              and p.grad.shape == p.shape for p in m.parameters())
    res["grad_full"] = {n: p.grad.full_tensor().clone() for n, p in m.named_parameters()}
    tm = runs["torch"][0]
    _loss(tm, _batches(rank, world, 1)[0]).backward()
    res["torch_grad_full"] = {n: p.grad.full_tensor().clone() for n, p in tm.named_parameters()}
    for mm, oo in runs.values():
        oo.zero_grad()
    # DCP round trip through torch's helpers, each implementation loading either's checkpoint
    for kind in ("torch", "sp"):
        for src in ("torch", "sp"):
            m2 = _wrap(kind, _llama(seed=7))
            opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, foreach=True)
            msd, osd = get_state_dict(m2, opt2)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=f"{path}/{src}")
            set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            losses = []
            for ids in _batches(rank, world, 5)[3:]:
                loss = _loss(m2, ids)
                loss.backward()
                opt2.step()
                opt2.zero_grad()
                losses.append(loss.item())
            res[f"resume_{kind}_from_{src}"] = losses
            dist.barrier()
    return res


def _close(a, b) -> bool:
    if isinstance(a, dict):
        return set(a) == set(b) and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fully_shard_parameters_are_fsdp2_dtensors(tmp_path):
    for r in run(_parity, 2, str(tmp_path), timeout=280):
        assert r["sp_faces"] == r["torch_faces"], (r["sp_faces"], r["torch_faces"])
        assert all(f[1] == "DTensor" and f[5] == (Shard(0),) for f in r["sp_faces"])
        assert _close(r["sp_numbers"], r["torch_numbers"]), (r["sp_numbers"], r["torch_numbers"])
        assert _close(r["sp_full"], r["torch_full"]) and _close(r["sp_moments"], r["torch_moments"])
        assert r["no_copy"] and r["grads_dtensor_after_backward"]
        assert _close(r["grad_full"], r["torch_grad_full"])
        want = r["resume_torch_from_torch"]
        for key in ("resume_sp_from_sp", "resume_sp_from_torch", "resume_torch_from_sp"):
            assert _close(r[key], want), (key, r[key], want)


# -- shardplan's own checkpoints, accumulation, resharding to one process, shard(dtensor_params=True) ------------

def _reference(world, steps, accumulate=1, grads=False):
    """One process on the whole batch (each micro-batch's loss / accumulate, summed into .grad); with ``grads``,
    the gradients of the first step instead of the trained parameters."""
    m = _llama()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
    batches = [torch.cat(bs) for bs in zip(*[_batches(r, world, steps * accumulate) for r in range(world)])]
    for k in range(steps):
        for ids in batches[k * accumulate:(k + 1) * accumulate]:
            (_loss(m, ids) / accumulate).backward()
        if grads:
            return {n: p.grad.clone() for n, p in m.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _rest(rank, world, path):
    res = {}
    # accumulation: a micro-step under no_sync, then a synchronising one; and two synchronising backwards adding
    # their reduced DTensor gradients in .grad: the gradients of one process on the whole batch
    batches = _batches(rank, world, 2)
    for label in ("accumulated", "accumulated_synced"):
        m = _wrap("sp", _llama())
        with sp.no_sync(m) if label == "accumulated" else contextlib.nullcontext():
            (_loss(m, batches[0]) / 2).backward()
        (_loss(m, batches[1]) / 2).backward()
        res[label] = {n: p.grad.full_tensor().clone() for n, p in m.named_parameters()}

    # shardplan.checkpoint.save / load on DTensor parameters: training resumes as if uninterrupted
    m = _wrap("sp", _llama())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
    data = _batches(rank, world, 4)
    for ids in data[:2]:
        _loss(m, ids).backward()
        opt.step()
        opt.zero_grad()
    sp.checkpoint.save(f"{path}/ckpt", m, opt, step=2)
    m2 = _wrap("sp", _llama(seed=9))
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, foreach=True)
    res["step"] = sp.checkpoint.load(f"{path}/ckpt", m2, opt2)
    res["state_types"] = sorted({type(v).__name__ for st in opt2.state.values() for v in st.values()})
    for mm, oo in ((m, opt), (m2, opt2)):
        for ids in data[2:]:
            _loss(mm, ids).backward()
            oo.step()
            oo.zero_grad()
    res["sp_ckpt_same"] = all(torch.equal(a.full_tensor(), b.full_tensor())
                              for a, b in zip(m.parameters(), m2.parameters()))
    full = sp.checkpoint.full_state_dict(m)  # rank 0 gets every full tensor
    whole = {n: p.full_tensor() for n, p in m.named_parameters()}  # (a collective each: every rank)
    res["full_export"] = rank != 0 or all(torch.equal(full[n], whole[n]) for n in whole)

    # shard(dtensor_params=True): a chunked plan trains on DTensor parameters; a contiguous one refuses
    model = _llama()
    plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"model\.layers\.\d+"],
                   min_unit_bytes=0, layout="chunked")
    sp.shard(model, plan, dtensor_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    for ids in _batches(rank, world, 2):
        _loss(model, ids).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        opt.zero_grad()
    res["shard_dtensor"] = all(isinstance(p, DTensor) for p in model.parameters())
    res["shard_trained"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    model = _llama()
    plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"model\.layers\.\d+"],
                   min_unit_bytes=0)  # layout "auto": packs whole rows
    try:
        sp.shard(model, plan, dtensor_params=True)
        res["contiguous"] = "no error"
    except sp.ShardingError as exc:
        res["contiguous"] = str(exc)
    # an optimizer built on the parameter objects held before the plan compiled steps the DTensor parameters
    # that replaced them (FSDP2's fully_shard replaces them at the call: an optimizer built after it holds those)
    model = _llama()
    held = list(model.parameters())
    _wrap("sp", model)
    early = torch.optim.AdamW(held, lr=1e-2, foreach=True)
    for ids in _batches(rank, world, 2):
        _loss(model, ids).backward()
        early.step()
        early.zero_grad()
    res["early"] = all(isinstance(p, DTensor) for g in early.param_groups for p in g["params"])
    res["early_trained"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}

    # a scalar parameter (replicated: FSDP2 refuses them) stays a plain 0-d tensor beside the DTensors; torch's
    # clip_grad_norm_ and AdamW (foreach) take the mix, with one process's numbers
    def gained(seed=0):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(4, 6), Gain(), nn.Linear(6, 3))
        return m
    x = torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(3))
    ref = gained()
    F.mse_loss(ref(x), torch.zeros(4 * world, 3)).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True).step()
    m = gained()
    sp.fully_shard(m[1])
    sp.fully_shard(m)
    F.mse_loss(m(x[rank * 4:(rank + 1) * 4]), torch.zeros(4, 3)).backward()
    got = _full(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1))
    torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True).step()
    res["scalar"] = [type(p).__name__ for p in m.parameters()]
    res["scalar_norm"] = (float(got), float(want))
    res["scalar_trained"] = _close({n: _full(p).detach() for n, p in m.named_parameters()},
                                   {n: p.detach() for n, p in ref.named_parameters()})
    return res


class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return torch.tanh(x) * self.g


def _load_one(rank, world, path):
    """The 2-rank checkpoint resharded onto one process (world 1): DCP through torch's helpers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    m = _wrap("sp", _llama(seed=4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=f"{path}/sp")
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return {n: p.full_tensor().detach().clone() for n, p in m.named_parameters()}


def _save_two(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    m, opt, _ = _train("sp", rank, world, 2)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/sp")
    return {n: p.full_tensor().detach().clone() for n, p in m.named_parameters()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoints_accumulation_and_shard_face(tmp_path):
    out = run(_rest, 2, str(tmp_path), timeout=280)
    ref = _reference(2, 1, accumulate=2, grads=True)
    for r in out:
        assert _close(r["accumulated"], ref) and _close(r["accumulated_synced"], ref)
        assert r["step"] == 2 and r["sp_ckpt_same"] and r["state_types"] == ["DTensor", "Tensor"], r["state_types"]
        assert "layout=\"chunked\"" in r["contiguous"] and "cannot be a DTensor" in r["contiguous"], r["contiguous"]
        assert r["early"] is True and _close(r["early_trained"], _reference(2, 2))
        assert r["scalar"] == ["DTensor", "DTensor", "Parameter", "DTensor", "DTensor"], r["scalar"]
        assert r["scalar_norm"][0] == pytest.approx(r["scalar_norm"][1], rel=1e-5) and r["scalar_trained"]
        assert r["shard_dtensor"] and _close(r["shard_trained"], _reference(2, 2))
        assert r["full_export"] is True
    saved = run(_save_two, 2, str(tmp_path), timeout=200)[0]
    loaded = run(_load_one, 1, str(tmp_path), timeout=200)[0]
    assert _close(loaded, saved)
