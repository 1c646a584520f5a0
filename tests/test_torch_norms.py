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
    full = sp.full_state_dict(model)
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
