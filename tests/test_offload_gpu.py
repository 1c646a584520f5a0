"""CPU offload on a GPU, where the copies to the host run on a side stream: what the CPU suite (copies in order)
cannot show. Skipped without a GPU; run with ``SHARDPLAN_TEST_GPU=1 python -m pytest -m cuda tests/test_offload_gpu.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a GPU (the copies' side stream); SHARDPLAN_TEST_GPU=1")]

_CLIP = r"""
import os, torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ["MASTER_PORT"] = "29583"
dist.init_process_group("nccl", rank=0, world_size=1)
import shardplan as sp
from shardplan.models import gpt
dev = torch.device("cuda")
torch.manual_seed(0)
model = gpt.build("small", vocab=131072, dim=512, layers=2).to(dev)  # a 256 MiB embedding: its copy takes ms
plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=1), units=[r"layers\.\d+"], offload="optimizer")
sp.shard(model, plan)
opt = sp.offload_optimizer(model, lr=1e-3, overlap=False)
host = model._shardplan.offload
worst = 0.0
for step in range(4):
    t = torch.randint(0, 131072, (4, 65), device=dev)  # (next-token targets: a tied model fed its inputs as
    x, y = t[:, :-1], t[:, 1:]                           # targets saturates to a loss of 0 and no gradient)
    with torch.cuda.stream(host.d2h_stream):  # every gradient copy waits behind this: without the clipping's wait
        torch.cuda._sleep(200_000_000)        # for the copies, each would read the gradients already scaled
    model(x, y).backward()
    norm = float(sp.clip_grad_norm_(model, 1e-3))
    print("COEF", 1e-3 / norm)  # far from 1: a gradient scaled twice is far off
    opt.step()
    torch.cuda.synchronize()
    for hb in host.hosts.values():  # the host gradient the step used equals the device gradient the clip left
        for m in hb.trainable:
            if m.held and m.local.grad is not None:
                dev_g = m.local.grad.detach().reshape(-1).cpu()
                worst = max(worst, float((hb.grad[m.shard] - dev_g).abs().max() / dev_g.abs().max().clamp_min(1e-30)))
    opt.zero_grad()
print("WORST", worst)
"""


_OVERLAP = r"""
import os, torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ["MASTER_PORT"] = "29584"
dist.init_process_group("nccl", rank=0, world_size=1)
import shardplan as sp
from shardplan.models import gpt
dev = torch.device("cuda")
V = gpt.CONFIGS["small"].vocab

def run(captured, clip):
    torch.manual_seed(0)
    model = gpt.build("small").to(dev)
    plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=1), units=[r"layers\.\d+"], offload="optimizer")
    sp.shard(model, plan)
    opt = sp.offload_optimizer(model, lr=1e-3, overlap=clip != "hand", max_grad_norm=0.5 if clip == "opt" else None)
    def step(x, y):
        for i in range(2):  # two micro-batches, the first under no_sync
            with (sp.no_sync(model) if i == 0 else torch.enable_grad()):
                loss = model(x[i], y[i]) / 2
                loss.backward()
        if clip == "hand":
            sp.clip_grad_norm_(model, 0.5)
        opt.step(); opt.zero_grad()
        return loss.detach()
    f = sp.capture(step) if captured else step
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(8):
        t = torch.randint(0, V, (2, 4, 65), generator=g).to(dev)
        losses.append(float(f(t[..., :-1], t[..., 1:])))
    params = {n: p.detach().cpu().clone() for n, p in sp.checkpoint.full_state_dict(model, cpu=False).items()}
    return losses, params, opt.host_stats()["overlapped"]

for clip in ("none", "opt", "hand"):
    (le, pe, _), (lc, pc, overlapped) = run(False, clip), run(True, clip)
    same = le == lc and all(torch.equal(pe[k], pc[k]) for k in pe)
    print("CASE", clip, same, overlapped, flush=True)
"""


@pytest.mark.timeout(300)
def test_a_replayed_offloaded_step_equals_the_eager_one_and_overlaps_its_host_step():
    """[Note: the replay's host step overlaps] a captured step with an offloaded optimizer: without clipping the
    host steps each buffer as its gradient copy lands (an external event in the graph) while the replay's backward
    goes on; with clipping (in the optimizer, or by hand) it waits for the whole segment. Each equals the eager
    step bit for bit over 8 steps of two micro-batches; without clipping some host steps overlapped."""
    p = subprocess.run([sys.executable, "-c", _OVERLAP], cwd=ROOT, capture_output=True, text=True, timeout=280,
                       env=dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=os.pathsep.join(
                           [os.path.join(ROOT, "src")] + [q for q in [os.environ.get("PYTHONPATH")] if q])))
    assert p.returncode == 0, p.stderr[-3000:]
    cases = {c: (same == "True", int(n)) for c, same, n in
             (line.split()[1:] for line in p.stdout.splitlines() if line.startswith("CASE"))}
    assert set(cases) == {"none", "opt", "hand"}, p.stdout
    assert all(same for same, _ in cases.values()), cases
    assert cases["none"][1] > 0, cases  # the replay's host steps began while its graph still ran


@pytest.mark.timeout(300)
def test_clipping_waits_for_the_gradients_copies_to_the_host():
    """``sp.clip_grad_norm_`` scales the device gradients in place while their copies to the host may still run on
    the side copy stream: a copy that read them scaled, then scaled again by the host step, stepped with the
    coefficient squared. The clipping waits for the copies: the host gradients equal the clipped device ones.
    (A sleep queued on the copy stream before each backward makes every copy run late: without the wait, the
    race is certain, not left to the copies' timing.)"""
    p = subprocess.run([sys.executable, "-c", _CLIP], cwd=ROOT, capture_output=True, text=True, timeout=280,
                       env=dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=os.pathsep.join(
                           [os.path.join(ROOT, "src")] + [q for q in [os.environ.get("PYTHONPATH")] if q])))
    assert p.returncode == 0, p.stderr[-3000:]
    coefs = [float(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("COEF")]
    assert len(coefs) == 4 and max(coefs) < 0.1, coefs  # (the check is vacuous where clipping scales nothing)
    worst = float(p.stdout.split("WORST")[-1])
    assert worst == 0.0, worst
