"""torch's own ``clip_grad_norm_`` / ``get_total_norm`` over a sharded model's local gradients return the global
norm (as over FSDP2's DTensors), for the contiguous layout (``"auto"``, packing) and the chunked one, through torch's
extension point for tensor types (runtime/norms.py), with nothing of torch's replaced: a name bound before shardplan
was imported answers alike."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from torch.nn.utils import get_total_norm as early_total_norm  # bound before shardplan is imported

import shardplan as sp
from distributed import run
from models import Toy, batches, toy_rules

CLIP = 0.05


def _reference(data, world):
    model = Toy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    norms = []
    for x, y in data:
        model(x, y).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append([early_total_norm(grads, 2.0).item(), early_total_norm(grads, float("inf")).item(),
                      torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()])
        opt.step()
        opt.zero_grad()
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank, world, layout):
    data = batches(3)
    model = Toy()
    plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0, layout=layout)
    sp.shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per = data[0][0].shape[0] // world
    norms = []
    for x, y in data:
        model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append([early_total_norm(grads, 2.0).item(),
                      torch.nn.utils.get_total_norm(grads, float("inf"), foreach=True).item(),
                      torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()])
        opt.step()
        opt.zero_grad()
    full = sp.checkpoint.full_state_dict(model)
    plain = [type(p.grad) for p in model.parameters()]  # (None after zero_grad)
    return dict(norms=norms, full=full, plain=plain)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["auto", "chunked"])
def test_torch_clip_grad_norm_and_get_total_norm_are_global(layout):
    want_norms, want_params = _reference(batches(3), 2)
    for rank, out in enumerate(run(_worker, 2, layout)):
        for got, want in zip(out["norms"], want_norms):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (rank, got, want)
        if rank == 0:
            for n, p in want_params.items():
                torch.testing.assert_close(out["full"][n], p, rtol=1e-5, atol=1e-5, msg=n)


def test_nothing_of_torch_is_replaced():
    """No function's code swapped, no stack walk: torch's contracts through its own extension points."""
    src = pathlib.Path(__file__).parent.parent / "src" / "shardplan"
    found = [f"{p.relative_to(src)}:{i}" for p in src.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\.__code__\s*=|sys\._getframe|inspect\.stack\(", line)]
    assert not found, found
    from torch.nn.utils import clip_grad
    assert early_total_norm is torch.nn.utils.get_total_norm
    assert clip_grad._get_total_norm.__wrapped__.__code__.co_filename == clip_grad.__file__


def _scaler_worker(rank, world, face):
    """torch.amp.GradScaler over a sharded model, an inf in one rank's gradient shard only."""
    model = Toy()
    if face == "shard":
        plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0)
        sp.shard(model, plan)
    else:  # DTensor parameters and gradients: DTensor's own global check
        for block in model.blocks:
            sp.fully_shard(block)
        sp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    out = []
    for i, (x, y) in enumerate(batches(3, seed=rank + 1)):
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(model(x, y)).backward()
        if i == 1 and rank == 0:  # an overflow that landed in rank 0's shard only
            g = next(p.grad for p in model.parameters() if p.grad is not None and p.grad.numel())
            g = g.to_local() if hasattr(g, "to_local") else g
            g.view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.append((scaler.get_scale(), any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("face", ["shard", "fully_shard"])
def test_grad_scaler_skips_a_step_on_every_rank_when_one_shard_overflows(face):
    """torch.amp.GradScaler's found-inf check ran on this rank's shards only: the rank holding an overflow
    skipped its step and halved its scale while the others stepped and kept theirs (ranks then scaled their
    gradients differently: a wrong sum, silently). Over local shards it is global, as DTensor makes it for
    FSDP2's gradients: every rank skips the step and halves the scale."""
    outs = run(_scaler_worker, 2, face)
    assert outs[0] == outs[1], outs
    (s0, moved0), (s1, moved1), (s2, moved2) = outs[0]
    assert moved0 and not moved1 and moved2  # step 2 skipped everywhere
    assert s1 == s0 / 2 and s2 == s1


def _adafactor_worker(rank, world, face):
    data = batches(3, seed=1)  # every rank the same batch: the reference is one process on it
    ref = Toy()
    ref_opt = torch.optim.Adafactor(ref.parameters(), lr=1e-2)
    model = Toy()
    rules = toy_rules(odd=False) if face == "shard" else [(r".*", sp.P())]  # or every parameter replicated
    sp.shard(model, sp.plan(model, rules, sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0))
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    for x, y in data:
        ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(x, y).backward()
        try:
            opt.step()
        except sp.ShardingError as exc:
            return str(exc)
        opt.zero_grad()
    full = sp.checkpoint.full_state_dict(model)  # (on rank 0)
    return max([(full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters() if n in full] or [0.0])


@pytest.mark.slow
@pytest.mark.parametrize("face", ["shard", "replicated"])
def test_a_non_elementwise_optimizer_is_refused_over_local_shards(face):
    """torch's Adafactor (row and column means of a matrix's second moment) over shard()'s local pieces would
    update each piece from its own rows only, silently; it is refused at the first step, naming the parameter
    and the ways out. Over parameters every rank holds whole it computes what one process does."""
    for out in run(_adafactor_worker, 2, face):
        if face == "shard":
            assert isinstance(out, str) and "Adafactor updates a parameter from more than its own elements" in out, out
            assert "'emb.weight'" in out and "rule" in out and "P()" in out
        else:
            assert out < 1e-5, out
