"""A checkpoint carries the whole run: the lr scheduler, the data loader's position, every rank's generators and
user state (``extra=``) beside the model and optimizer, through save, async_save and load; what does not fit
raises before anything loads; and a run killed mid-way resumes bit for bit (tests/run_state_script.py)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import shardplan as sp
from distributed import run
from models import Toy, toy_rules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_state_script as script  # noqa: E402


def _make(world):
    model = Toy(seed=0)
    plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0)
    sp.shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    return model, opt, sched, plan


def _loader(plan, rank):
    from torch.utils.data import DistributedSampler, TensorDataset
    data = TensorDataset(torch.arange(40).view(20, 2))
    sampler = DistributedSampler(data, num_replicas=plan.data_size, rank=plan.data_index(rank), shuffle=True, seed=1)
    return script.Loader(data, sampler, 2)


def _state(sched, loader):
    return (sched.state_dict()["last_epoch"], loader.state_dict(), random.random(), torch.rand(3).tolist())


def _round_trip_worker(rank, world, root, use_async):
    model, opt, sched, plan = _make(world)
    loader = _loader(plan, rank)
    it = iter(loader)
    for _ in range(3):
        next(it)
        sched.step()
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    train_state = script.TrainState()
    train_state.epoch, train_state.tokens = 2, 4096
    ema = torch.full((2,), 0.25 + rank)  # a plain tensor: rank 0's value is the run's
    extra = {"train_state": train_state, "ema": ema, "note": f"rank {rank}", "losses": [1.5, 1.25]}
    save = sp.checkpoint.async_save if use_async else sp.checkpoint.save
    fut = save(os.path.join(root, "ck"), model, opt, step=3, lr_scheduler=sched, dataloader=loader, rng=True,
               extra=extra)
    if use_async:
        fut.result()
    expected = _state(sched, loader)  # what the run does next: the generators and the loader's position go on
    info = sp.checkpoint.checkpoint_info(os.path.join(root, "ck"))

    model2, opt2, sched2, plan2 = _make(world)
    loader2 = _loader(plan2, rank)
    torch.manual_seed(999)
    random.seed(999)
    state2, ema2 = script.TrainState(), torch.zeros(2)
    extra2 = {"train_state": state2, "ema": ema2, "note": None, "losses": None}
    step = sp.checkpoint.load(os.path.join(root, "ck"), model2, opt2, lr_scheduler=sched2, dataloader=loader2,
                              rng=True, extra=extra2)
    got = _state(sched2, loader2)
    rest = [b[0].tolist() for b in loader2]  # resumes after the 3 batches the saved loader had yielded
    later = [b[0].tolist() for b in list(iter(loader))[3:]]
    return dict(step=step, expected=expected, got=got, rest=rest, later=later, lr=opt2.param_groups[0]["lr"],
                state=(state2.epoch, state2.tokens), ema=ema2.tolist(), note=extra2["note"], losses=extra2["losses"],
                info=info["run"])


@pytest.mark.parametrize("use_async", [False, True], ids=["save", "async_save"])
def test_the_run_state_round_trips_on_every_rank(tmp_path, use_async):
    out = run(_round_trip_worker, 2, str(tmp_path), use_async)
    for rank, r in enumerate(out):
        assert r["step"] == 3
        assert r["got"] == r["expected"]  # lr scheduler, loader position, Python's and torch's generators
        assert r["rest"] == r["later"] and len(r["rest"]) == 2  # 5 batches per epoch on each of 2 ranks
        assert r["lr"] == pytest.approx(1e-2 * 0.5 ** 3)
        assert r["state"] == (2, 4096) and r["losses"] == [1.5, 1.25]
        assert r["ema"] == [0.25, 0.25] and r["note"] == "rank 0"  # one value per run: rank 0's
        assert r["info"] == {"lr_scheduler": "LambdaLR", "dataloader": "Loader", "data_slices": 2, "rng": True,
                             "extra": ["ema", "losses", "note", "train_state"]}
    assert out[0]["got"] != out[1]["got"]  # each rank got its own generators and loader back


def _mismatch_worker(rank, world, root):
    model, opt, sched, plan = _make(world)
    loader = _loader(plan, rank)
    path = os.path.join(root, "ck")
    if world == 2:
        sched.step()
        sched.step()
        sp.checkpoint.save(path, model, opt, step=5, lr_scheduler=sched, dataloader=loader, rng=True,
                           extra={"n": 1, "t": torch.ones(3)})
        sp.checkpoint.save(os.path.join(root, "bare"), model, opt, step=5)
        return None
    out = {}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, kw in [("rng", dict(rng=True)), ("loader", dict(dataloader=loader)),
                     ("extra", dict(extra={"missing": 0})), ("shape", dict(extra={"t": torch.zeros(4)})),
                     ("kind", dict(extra={"n": torch.zeros(1)}))]:
        try:
            sp.checkpoint.load(path, model, opt, **kw)
            out[name] = "loaded"
        except sp.errors.CheckpointError as exc:
            out[name] = str(exc)
    try:
        sp.checkpoint.load(os.path.join(root, "bare"), model, opt, lr_scheduler=sched)
    except sp.errors.CheckpointError as exc:
        out["bare"] = str(exc)
    out["unchanged"] = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = torch.zeros(3)
        out["lenient"] = sp.checkpoint.load(path, model, opt, rng=True, dataloader=loader, strict=False,
                                            lr_scheduler=sched, extra={"t": t})
        out["t"] = t.tolist()
    out["warned"] = [str(w.message) for w in caught if "keep their current state" in str(w.message)]
    out["epoch"] = sched.last_epoch
    return out


def test_parts_that_do_not_fit_raise_before_anything_loads(tmp_path):
    run(_mismatch_worker, 2, str(tmp_path))
    (r,) = run(_mismatch_worker, 1, str(tmp_path))
    assert "rng: saved by 2 ranks, this run has 1" in r["rng"] and "rng=False" in r["rng"]
    assert "dataloader: saved by 2 data-parallel slices, this run has 1" in r["loader"]
    assert "dataloader=None" in r["loader"]
    assert "extra['missing']: not in the checkpoint (it holds extra keys ['n', 't'])" in r["extra"]
    assert "extra['t']: shape (4,) here, (3,) in the checkpoint" in r["shape"]
    assert "extra['n']: a tensor here, a Python value in the checkpoint" in r["kind"]
    assert "lr_scheduler: not in the checkpoint (it was saved without lr_scheduler=)" in r["bare"]
    assert all("strict=False" in r[k] for k in ("rng", "loader", "extra", "shape", "kind", "bare"))
    assert r["unchanged"]  # every refused load left the model as it was
    # strict=False: what fits loads (the model, the scheduler, extra's tensor), the rest warns
    assert r["lenient"] == 5 and r["t"] == [1.0, 1.0, 1.0] and r["epoch"] == 2
    assert len(r["warned"]) == 1 and "rng: saved by 2 ranks" in r["warned"][0]


def test_a_loader_without_state_is_refused_with_the_fix(tmp_path):
    def worker(rank, world, root):
        model, opt, _, _ = _make(world)
        loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
        try:
            sp.checkpoint.save(os.path.join(root, "ck"), model, opt, dataloader=loader)
        except sp.errors.CheckpointError as exc:
            return str(exc), os.path.exists(os.path.join(root, "ck"))
    (msg, written), = run(worker, 1, str(tmp_path))
    assert msg.startswith("dataloader=DataLoader: it has no state_dict()/load_state_dict() to save and restore.")
    assert "StatefulDataLoader" in msg and "pip install torchdata" in msg and not written


# -- a real run, killed and resumed ------------------------------------------------------------------------

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDPLAN_FORCE_CPU": "1"}


def _torchrun(*args, ok=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "tests", "run_state_script.py"), *args]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=240)
    if ok:
        assert out.returncode == 0, out.stdout[-4000:]
    return out


def _losses(path):
    import json
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if "event" not in r}, [r for r in records if "event" in r]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_run_resumes_bit_identically(tmp_path):
    # (async_save carries the same state: test_the_run_state_round_trips_on_every_rank; the killed run saves
    # in the background, the resumed one synchronously)
    _torchrun("--steps", "12", "--metrics", str(tmp_path / "full.jsonl"))
    reference, _ = _losses(tmp_path / "full.jsonl")
    assert sorted(reference) == list(range(1, 13))
    ck = str(tmp_path / "ck")
    killed = _torchrun("--steps", "12", "--ckpt", ck, "--every", "4", "--die-at", "10", "--async-save",
                       "--metrics", str(tmp_path / "a.jsonl"), ok=False)
    assert killed.returncode != 0  # every rank left through os._exit after step 10
    first, _ = _losses(tmp_path / "a.jsonl")
    assert sorted(first) == list(range(1, 11))
    assert sp.checkpoint.latest(ck).endswith("step_00000008")
    shutil.copytree(ck, tmp_path / "ck8")  # the resumed run below saves step 12 into ck
    _torchrun("--steps", "12", "--ckpt", ck, "--every", "4", "--resume", "--metrics", str(tmp_path / "b.jsonl"))
    resumed, events = _losses(tmp_path / "b.jsonl")
    assert [(e["event"], e["step"]) for e in events] == [("restart", 8)]
    assert sorted(resumed) == [9, 10, 11, 12]
    assert {**first, **resumed} == reference  # every step's loss, bit for bit (steps 9 and 10 run twice)
    # a resume that leaves out a part of the run's state gives other losses: the test can fail (each of
    # "lr_scheduler", "train_state" and "loss_ema" does too; two here, to keep the suite's time)
    for part in ("rng", "dataloader"):
        out = tmp_path / f"without-{part}.jsonl"
        _torchrun("--steps", "11", "--ckpt", str(tmp_path / "ck8"), "--every", "100", "--resume", "--leave-out", part, "--metrics", str(out))
        partial, _ = _losses(out)
        # (the optimizer's own learning rate is restored: a scheduler left out first shows in step 11's loss)
        assert sorted(partial) == [9, 10, 11]
        assert partial != {s: reference[s] for s in (9, 10, 11)}, part
