"""The emulated network backend (``shardplan-emulated``: runtime/emulated.py) and rehearsals under it. Each
case runs in a forked process of its own (it makes the default process group); one process plays one rank
of N, its collectives timed by a network model (on a CPU: one comm thread per process group).

GPU versions are marked ``cuda``: ``SHARDPLAN_TEST_GPU=1 python -m pytest -m cuda tests/test_emulated.py``."""

from __future__ import annotations

import time

import pytest
import torch

from distributed import run

# a slow in-node link, so that the modelled times dwarf a loaded host's thread wake-ups (a few ms)
SLOW = {"base": "h100-8x-ib400", "name": "slow-test-link", "intra": {"busbw": 0.02, "alpha_us": 1000.0}}


def _all_gather_time(_rank, _world, nbytes, device):
    import torch.distributed as dist
    import shardplan as sp
    from shardplan.runtime.emulated import ledger
    torch.set_num_threads(1)
    with sp.emulated_network(SLOW, rank=1, world_size=4):
        inp = torch.arange(nbytes // 4 // 4, dtype=torch.float32, device=device)
        out = torch.full((4 * inp.numel(),), -1.0, device=device)
        dist.all_gather_into_tensor(out, inp)  # warm: the comm thread starts, CUDA calibrates
        if device == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        work = dist.all_gather_into_tensor(out, inp, async_op=True)
        issued = time.perf_counter() - t0
        work.wait()
        if device == "cuda":
            b.record()
            b.synchronize()
            took = a.elapsed_time(b) / 1e3
        else:
            took = time.perf_counter() - t0
        filled = bool((out.view(4, -1) == inp).all())  # the fake group's values: this rank's input in every slot
        return took, issued, ledger().to_dict(), filled


def _check_all_gather(device):
    nbytes = 4 << 20  # the gathered output: 4 MiB over 4 ranks
    took, issued, led, filled = run(_all_gather_time, 1, nbytes, device, init=False, timeout=120)[0]
    expected = 3 * 1000e-6 + nbytes * 3 / 4 / 0.02e9  # alpha per ring step + bytes / busbw: 160 ms
    assert filled
    assert abs(took - expected) <= 0.10 * expected, (took, expected)
    assert issued < 0.5 * expected  # async: the caller is not held while the network works
    ag = led["by_kind"]["all_gather"]
    assert ag["count"] == 2 and ag["bytes"] == 2 * nbytes
    assert abs(ag["modelled_s"] - 2 * expected) < 1e-9 and led["network"] == "slow-test-link"


@pytest.mark.timeout(150)
def test_emulated_all_gather_takes_alpha_plus_bytes_over_beta():
    _check_all_gather("cpu")


@pytest.mark.cuda
@pytest.mark.timeout(150)
def test_emulated_all_gather_takes_alpha_plus_bytes_over_beta_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: SHARDPLAN_TEST_GPU=1 on a GPU machine")
    _check_all_gather("cuda")


def _fsdp2_step(_rank, _world, device):
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import shardplan as sp
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with sp.emulated_network("h100-8x-ib400", rank=0, world_size=4) as net:
        mesh = init_device_mesh(device, (4,))
        model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(3))).to(device)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = [p.detach().to_local().clone() for p in model.parameters()]
        loss = model(torch.randn(4, 32, device=device)).square().mean()
        loss.backward()
        opt.step()
        changed = all(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters()))
        return float(loss), changed, net.ledger().to_dict()


def _check_fsdp2(device):
    loss, changed, led = run(_fsdp2_step, 1, device, init=False, timeout=120)[0]
    kinds = led["by_kind"]
    assert loss == loss and changed  # finite, and the optimizer stepped this rank's shards
    # FSDP2's own collectives went through the backend: one all-gather per module in forward and backward
    # (the root's is empty), one reduce-scatter per module with gradients
    assert kinds["all_gather"]["count"] >= 3 and kinds["reduce_scatter"]["count"] >= 3
    assert kinds["all_gather"]["modelled_s"] > 0 and led["network"] == "h100-8x-ib400"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fsdp2_fully_shard_trains_a_step_under_the_backend():
    _check_fsdp2("cpu")


@pytest.mark.cuda
@pytest.mark.timeout(150)
def test_fsdp2_fully_shard_trains_a_step_under_the_backend_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: SHARDPLAN_TEST_GPU=1 on a GPU machine")
    _check_fsdp2("cuda")
