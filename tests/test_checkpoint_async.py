"""sp.checkpoint.async_save on real gloo groups: the state is copied before it returns (training that goes on
does not reach the checkpoint), publishing waits for every rank, a failed or killed write leaves the previous
checkpoint as ``latest``, a second save waits for the first, and a resumed run is bit-identical."""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch
import torch.distributed as dist

import shardplan as sp
from distributed import run
from models import Toy, batches, toy_rules

LR = 1e-3
DATA = 6
SPLIT = 3


def _make(rank, world, seed=0, strategy="optim_grads_params"):
    model = Toy(seed=seed)
    plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), strategy=strategy, units=[r"blocks\.\d+"], min_unit_bytes=0)
    sp.shard(model, plan)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _steps(model, opt, rank, world, data):
    per = data[0][0].shape[0] // world
    losses = []
    for x, y in data:
        loss = model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _slow_writes(seconds, on_rank=None, action=None):
    """Make the background writer wait ``seconds`` before writing (so training overlaps the write), and on
    ``on_rank`` do ``action`` instead of writing (raise, or kill the process)."""
    from shardplan.runtime.checkpoint import async_io
    real = async_io._Writer.write_data

    def write_data(self, plan, planner):
        time.sleep(seconds)
        if action is not None and dist.get_rank() == on_rank:
            action()
        return real(self, plan, planner)
    async_io._Writer.write_data = write_data


def _optimizer_state(model, opt):
    return {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters() if p in opt.state}


def _save_worker(rank, world, root):
    data = batches(DATA)
    model, opt = _make(rank, world)
    first = _steps(model, opt, rank, world, data[:SPLIT])
    at_save = sp.checkpoint.full_state_dict(model)
    state_at_save = _optimizer_state(model, opt)
    _slow_writes(0.5)
    path = sp.checkpoint.step_dir(root, SPLIT)
    fut = sp.checkpoint.async_save(path, model, opt, step=SPLIT)
    pending = not fut.done()  # the write is still going on (the writer waits 0.5 s)
    pruned = sp.checkpoint.prune(root, keep=1)  # must leave the directory being written alone
    rest = _steps(model, opt, rank, world, data[SPLIT:])  # training changes parameters and moments meanwhile
    published = fut.result()
    latest = sp.checkpoint.latest(root)
    # the checkpoint holds the values at async_save time, not the trained ones
    fresh, fresh_opt = _make(rank, world, seed=11)
    step = sp.checkpoint.load(published, fresh, fresh_opt)
    loaded = sp.checkpoint.full_state_dict(fresh)
    same_params = rank != 0 or (loaded.keys() == at_save.keys() and all(torch.equal(loaded[n], t) for n, t in at_save.items()))
    loaded_state = _optimizer_state(fresh, fresh_opt)
    same_state = loaded_state.keys() == state_at_save.keys() and all(
        torch.equal(loaded_state[n][k], v) for n, st in state_at_save.items() for k, v in st.items())
    return dict(losses=first + rest, pending=pending, pruned=pruned, published=published, latest=latest, step=step,
                same_params=same_params, same_state=same_state, tmp_left=glob.glob(path + ".tmp-*"))


def _resume_worker(rank, world, root):
    data = batches(DATA)
    model, opt = _make(rank, world, seed=5)
    step = sp.checkpoint.load(sp.checkpoint.latest(root), model, opt)
    return step, _steps(model, opt, rank, world, data[step:])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_async_save_copies_state_before_returning_and_resume_is_bit_identical(tmp_path):
    root = str(tmp_path / "ckpt")
    out = run(_save_worker, 2, root)
    for r in out:
        assert r["pending"], "the write should still be in flight when async_save returns"
        assert r["pruned"] == [] and r["tmp_left"] == []
        assert r["published"] == r["latest"] == sp.checkpoint.step_dir(root, SPLIT)
        assert r["step"] == SPLIT
        assert r["same_params"], "parameters in the checkpoint differ from those at async_save time"
        assert r["same_state"], "optimizer states in the checkpoint differ from those at async_save time"
    losses = out[0]["losses"]
    assert out[1]["losses"] == losses
    info = sp.checkpoint.checkpoint_info(sp.checkpoint.step_dir(root, SPLIT))
    assert info["step"] == SPLIT and info["world_size"] == 2
    for step, rest in run(_resume_worker, 2, root):
        assert step == SPLIT
        assert rest == losses[SPLIT:], "a run resumed from an asynchronous checkpoint must be bit-identical"


def _failing_worker(rank, world, root):
    from shardplan.runtime.checkpoint import async_io
    model, opt = _make(rank, world)
    _steps(model, opt, rank, world, batches(1))
    sp.checkpoint.async_save(sp.checkpoint.step_dir(root, 1), model, opt, step=1).result()
    _steps(model, opt, rank, world, batches(1, seed=5))
    real = async_io._Writer.write_data

    def boom():
        raise OSError("disk full (simulated)")
    _slow_writes(0.0, on_rank=1, action=boom)
    fut = sp.checkpoint.async_save(sp.checkpoint.step_dir(root, 2), model, opt, step=2)
    try:
        fut.result()
        err = None
    except sp.errors.CheckpointError as exc:
        err = str(exc)
    latest_after_failure = sp.checkpoint.latest(root)
    # an unchecked failure is reported by the next save of the process
    fut = sp.checkpoint.async_save(sp.checkpoint.step_dir(root, 2), model, opt, step=2)
    try:
        fut.result()
    except sp.errors.CheckpointError:
        pass
    try:
        sp.checkpoint.save(sp.checkpoint.step_dir(root, 2), model, opt, step=2)
        unchecked = None
    except sp.errors.CheckpointError as exc:
        unchecked = str(exc)
    async_io._Writer.write_data = real
    # fut above was checked by result(): the next one goes ahead
    third = sp.checkpoint.async_save(sp.checkpoint.step_dir(root, 3), model, opt, step=3)
    second_waits = sp.checkpoint.async_save(sp.checkpoint.step_dir(root, 4), model, opt, step=4)
    third_done_when_fourth_started = third.done()
    last = second_waits.result()
    return err, latest_after_failure, unchecked, third.result(), third_done_when_fourth_started, last


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_failed_write_leaves_previous_checkpoint_latest(tmp_path):
    root = str(tmp_path / "ckpt")
    for err, latest, unchecked, third, waited, last in run(_failing_worker, 2, root):
        assert err and "disk full (simulated)" in err and "rank 1" in err and "previous checkpoint is intact" in err
        assert latest == sp.checkpoint.step_dir(root, 1)
        assert unchecked is None, "a failure that result() reported must not be raised again"
        assert third == sp.checkpoint.step_dir(root, 3) and waited
        assert last == sp.checkpoint.step_dir(root, 4) == sp.checkpoint.latest(root)
    assert not glob.glob(os.path.join(root, "*.tmp-*")), "a failed save's directory is removed"
    assert sorted(os.listdir(root)) == [f"step_0000000{i}" for i in (1, 2, 3, 4)]  # 2: the synchronous save


def _unchecked_worker(rank, world, root):
    model, opt = _make(rank, world)
    _steps(model, opt, rank, world, batches(1))

    def boom():
        raise OSError("simulated")
    _slow_writes(0.0, on_rank=0, action=boom)
    sp.checkpoint.async_save(sp.checkpoint.step_dir(root, 1), model, opt, step=1)  # never checked
    try:
        sp.checkpoint.save(sp.checkpoint.step_dir(root, 2), model, opt, step=2)
        return None
    except sp.errors.CheckpointError as exc:
        return str(exc)


def _kill_worker(rank, world, root):
    model, opt = _make(rank, world)
    _steps(model, opt, rank, world, batches(1))
    sp.checkpoint.async_save(sp.checkpoint.step_dir(root, 1), model, opt, step=1).result()
    _steps(model, opt, rank, world, batches(1, seed=5))
    _slow_writes(0.2, on_rank=1, action=lambda: os._exit(3))  # rank 1 dies in the middle of the write
    fut = sp.checkpoint.async_save(sp.checkpoint.step_dir(root, 2), model, opt, step=2)
    try:
        fut.result(timeout=60)
    except sp.errors.CheckpointError as exc:
        return str(exc)
    return "published"


def _load_latest_worker(rank, world, root):
    model, opt = _make(rank, world, seed=3)
    return sp.checkpoint.load(sp.checkpoint.latest(root), model, opt)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_unchecked_failure_is_raised_by_next_save_and_killed_rank_leaves_previous(tmp_path):
    for msg in run(_unchecked_worker, 2, str(tmp_path / "unchecked")):
        assert msg and "never checked" in msg and "simulated" in msg
    root = str(tmp_path / "killed")
    out = run(_kill_worker, 2, root, expect_errors=True, timeout=150)
    assert out[1][0] == "error"  # rank 1 exited
    assert sp.checkpoint.latest(root) == sp.checkpoint.step_dir(root, 1)
    assert not os.path.exists(sp.checkpoint.step_dir(root, 2))
    assert run(_load_latest_worker, 2, root) == [1, 1]


# -- examples/train_gpt.py --async-checkpoint ---------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp_path, name, *args):
    import json
    import subprocess
    import sys
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDPLAN_FORCE_CPU": "1",
           "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")])}
    metrics = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "examples/train_gpt.py", "--steps", "8", "--quiet-plan", "--progress", "none", "--metrics", str(metrics), *args]
    out = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-4000:]
    with open(metrics) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "event" not in r}, out.stdout  # (not the restart marker)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_example_async_checkpoints_resume_bit_identical(tmp_path):
    reference, _ = _train(tmp_path, "full")
    ck = tmp_path / "ck"
    ckpt = ["--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--keep", "2", "--resume", "auto", "--async-checkpoint"]
    first, log = _train(tmp_path, "a", *ckpt, "--stop-after", "5")  # checkpoints of steps 2 and 4, then 5 at the end
    assert "saving checkpoint" in log and "in the background" in log
    assert sorted(os.listdir(ck)) == ["step_00000004", "step_00000005"]  # the last --keep 2, all published
    rest, log = _train(tmp_path, "b", *ckpt)
    assert "resumed from" in log and min(rest) == 6  # steps numbered from 1: the first after the checkpoint of 5
    assert {**first, **rest} == reference, "a run resumed from asynchronous checkpoints must be bit-identical"
    assert sorted(os.listdir(ck)) == ["step_00000006", "step_00000008"]
