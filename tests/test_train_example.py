"""examples/train_gpt.py as a user runs it under torchrun: the metrics log, checkpoints kept and resumed after
a real kill (SIGKILL, mid-save and mid-step) with bit-identical losses, and one clear error message per run."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDPLAN_FORCE_CPU": "1",
       "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")])}


def _cmd(n, *args, script="examples/train_gpt.py"):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), script, *args]


def _run(n, *args, timeout=240, ok=True, script="examples/train_gpt.py"):
    out = subprocess.run(_cmd(n, *args, script=script), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if ok:
        assert out.returncode == 0, out.stdout[-4000:]
    return out


def _records(path):
    """The JSON objects of a metrics file (a line a killed run left half written is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _losses(path):
    """``{step: loss}`` of the logged steps (steps numbered from 1; event records such as a restart marker left out)."""
    return {r["step"]: r["loss"] for r in _records(path) if "event" not in r}


# A slow file system for the killed runs: publishing a checkpoint (its completion marker, then the rename of
# its directory into place) takes a moment, so that a kill lands inside the save, not after it
SLOW_PUBLISH = """
import os, time
_rename, _replace = os.rename, os.replace
def rename(a, b, *args, **kw):
    if ".tmp-" in str(a):
        time.sleep(0.3)
    return _rename(a, b, *args, **kw)
def replace(a, b, *args, **kw):
    if str(a).endswith(".shardplan-complete.part"):
        time.sleep(0.3)
    return _replace(a, b, *args, **kw)
os.rename, os.replace = rename, replace
"""


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own, so a process group
    kill misses them; a scheduler's kill takes them all)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_all(pid: int) -> None:
    for p in [pid, *_descendants(pid)]:
        try:
            os.kill(p, signal.SIGSTOP)  # freeze first, so no process moves on while the others die
        except ProcessLookupError:
            pass
    for p in [pid, *_descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _killed(args, when, slow_dir, timeout=240):
    """Start a 2-rank run, SIGKILL torchrun and every rank as soon as ``when()`` is true; returns whether it
    was killed (False: it finished first)."""
    os.makedirs(slow_dir, exist_ok=True)
    with open(os.path.join(slow_dir, "sitecustomize.py"), "w") as f:
        f.write(SLOW_PUBLISH)
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(slow_dir), ENV["PYTHONPATH"]])}
    p = subprocess.Popen(_cmd(2, *args), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while p.poll() is None:
            if when():
                _kill_all(p.pid)
                p.wait(30)
                return True
            if time.monotonic() > deadline:
                raise TimeoutError(f"{args} did not finish in {timeout}s")
            time.sleep(0.002)
        return False
    finally:
        if p.poll() is None:
            _kill_all(p.pid)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_runs_resume_with_the_losses_of_an_uninterrupted_run(tmp_path):
    steps = ["--steps", "12", "--quiet-plan", "--lr-schedule", "warmup_cosine", "--warmup", "3"]
    full = tmp_path / "full.jsonl"
    _run(2, *steps, "--metrics", str(full))
    reference = _losses(full)
    assert sorted(reference) == list(range(1, 13))

    ck = tmp_path / "ck"
    ckpt = [*steps, "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--keep", "2", "--resume", "auto"]
    # 1. killed while saving the checkpoint of step 6 (its .tmp- directory exists, the save has not finished)
    killed = _killed([*ckpt, "--metrics", str(tmp_path / "a.jsonl")],
                     lambda: glob.glob(str(ck / "step_00000006.tmp-*")), tmp_path / "slow")
    assert killed, "the run finished before its save could be interrupted"
    assert not os.path.exists(ck / "step_00000006") and glob.glob(str(ck / "step_00000006.tmp-*"))
    # 2. resumed from the newest complete checkpoint (step 4), killed mid-training after step 8 was logged
    b = tmp_path / "b.jsonl"
    killed = _killed([*ckpt, "--metrics", str(b)],
                     lambda: os.path.exists(b) and any(r["step"] >= 8 for r in _records(b)), tmp_path / "slow")
    assert killed, "the resumed run finished before it could be killed"
    first_b = min(_losses(b))
    assert first_b == 5, f"resumed after step {first_b - 1}, expected the newest complete checkpoint (step 4)"
    marker = _records(b)[0]  # the resumed run's metrics start with the restart marker
    assert marker["event"] == "restart" and marker["step"] == 4 and marker["checkpoint"].endswith("step_00000004")
    # 3. resumed again (from step 8 or later, whatever was complete when it died), to the end
    c = tmp_path / "c.jsonl"
    out = _run(2, *ckpt, "--metrics", str(c))
    assert "resumed from" in out.stdout
    assert [r["event"] for r in _records(c) if "event" in r] == ["restart"]
    tokens = {r["step"]: r["tokens_seen"] for part in (b, c) for r in _records(part) if "event" not in r}
    assert all(t == s * 8 * 64 for s, t in tokens.items()), tokens  # the checkpoint's extra= state, restored
    seen = set()
    for part in (tmp_path / "a.jsonl", b, c):  # exactly: every step's mean loss, bit for bit
        losses = _losses(part)
        assert losses == {s: reference[s] for s in losses}, part.name
        seen |= set(losses)
    assert seen == set(reference)
    left = sorted(os.path.basename(p) for p in glob.glob(str(ck / "*")))
    assert left == ["step_00000010", "step_00000012"], left  # the last --keep 2; no unfinished directories


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_metrics_jsonl_log_fields_eval_profile_and_missing_tensorboard(tmp_path):
    metrics = tmp_path / "m.jsonl"
    t0 = time.time()
    out = _run(2, "--steps", "6", "--quiet-plan", "--log-every", "2", "--metrics", str(metrics),
               "--tensorboard", str(tmp_path / "tb"), "--progress", "none", "--eval-every", "3", "--flops", "count",
               "--profile-steps", "2:3", "--profile-dir", str(tmp_path / "prof"))
    records = _records(metrics)
    assert [r["step"] for r in records] == [2, 3, 4, 6]  # steps from 1; step 3 for the evaluation hook
    fields = {"time", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "tokens_per_s_per_device", "tflops",
              "mfu", "mem_gib", "mem_source", "mem_frac", "tokens_seen", "eta_s"}
    assert all(fields <= set(r) for r in records)
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
    assert all(t0 <= r["time"] <= time.time() for r in records)
    r = records[-1]
    assert r["mfu"] is None and r["mem_source"] == "plan" and r["mem_frac"] is None and r["eta_s"] == 0
    assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 2)
    assert r["tokens_per_s"] == pytest.approx(8 * 64 / r["step_time_s"])
    # --flops count: torch's FlopCounterMode on the first step, every rank's share summed: the count of the
    # whole global batch on one unsharded model
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import gpt
    import train_gpt
    import shardplan as sp
    model = gpt.build("tiny", max_seq=64)
    x, y = train_gpt.global_batch(train_gpt.corpus(200_000), 8, 64, 0, 0)
    _, flops = sp.metrics.count_flops(lambda: model(x, y).backward())
    assert r["tflops"] == pytest.approx(flops / x.numel() * r["tokens_per_s"] / 2 / 1e12, rel=1e-6)
    formula = sp.metrics.flops_per_token(model, seq=64, layers=model.config.layers, dim=model.config.dim)
    assert flops / x.numel() > formula  # (the CPU attention's backward recomputes the scores: more than the formula)
    assert sorted(os.listdir(tmp_path / "prof")) == ["rank0.trace.json", "rank1.trace.json"]
    with open(tmp_path / "prof" / "rank0.trace.json") as f:
        steps = {e["name"] for e in json.load(f)["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 4 and "tok/s" in lines[0] and "mfu n/a" in lines[0] and "eta" in lines[0]
    assert "eval_loss" in lines[1] and "TFLOP/s" in lines[0]
    if importlib.util.find_spec("tensorboard") is not None:
        assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    else:
        assert out.stdout.count("tensorboard is not installed (pip install tensorboard)") == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_shardplan_error_on_every_rank_prints_once_and_exits_nonzero(tmp_path):
    # Mesh(dp=3) on 2 processes: sp.shard raises RuntimeShardingError on both ranks
    t0 = time.monotonic()
    out = _run(2, "--mesh", "dp=3", "--quiet-plan", ok=False, timeout=120)
    assert time.monotonic() - t0 < 120
    assert out.returncode != 0
    text = out.stdout
    agent = re.search(r"^[EWI]\d{4} .*elastic", text, re.M)  # torchrun's own log and summary come last
    workers, summary = (text[:agent.start()], text[agent.start():]) if agent else (text, "")
    message = "has 3 ranks but the world size is 2"
    assert workers.count("shardplan: error on every rank") == 1, text[-4000:]
    assert workers.count("RuntimeShardingError") == 1 and workers.count(message) == 2, text[-4000:]  # both ranks named
    assert "Traceback" not in workers and "[rank1]" not in workers, text[-4000:]
    assert text.count("Traceback") <= 1  # torchrun's own, for its ChildFailedError
    assert "RuntimeShardingError" in summary and "the same error as rank 0" in summary, text[-4000:]
    root = summary[summary.index("Root Cause"):]
    assert "rank      : 0" in root and "exitcode  : 1 " in root and "RuntimeShardingError" in root, text[-4000:]
    # an argument error (SystemExit with a message) is printed once too
    out = _run(2, "--checkpoint-every", "2", "--quiet-plan", ok=False, timeout=120)
    workers = out.stdout[:re.search(r"^[EWI]\d{4} .*elastic", out.stdout, re.M).start()]
    assert out.returncode != 0 and workers.count("--checkpoint-every needs --checkpoint-dir") == 1, out.stdout[-3000:]


ONE_RANK_FAILS = """
import torch.distributed as dist, shardplan as sp

def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise sp.errors.PlanError("rank 1 alone is wrong; fix rank 1")
    dist.barrier()  # rank 0 waits here for a rank that will never come

sp.run_main(main)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_error_on_one_rank_is_printed_by_that_rank_and_nothing_hangs(tmp_path):
    script = tmp_path / "one_rank_fails.py"
    script.write_text(ONE_RANK_FAILS)
    t0 = time.monotonic()
    out = _run(2, script=str(script), ok=False, timeout=120)
    assert out.returncode != 0 and time.monotonic() - t0 < 120
    agent = re.search(r"^[EWI]\d{4} .*elastic", out.stdout, re.M)
    workers = out.stdout[:agent.start()] if agent else out.stdout
    assert workers.count("[rank1]: shardplan: error on rank 1") == 1, out.stdout[-3000:]
    assert workers.count("PlanError: rank 1 alone is wrong; fix rank 1") == 1 and "Traceback" not in workers, workers
    # rank 0's barrier fails when rank 1 leaves: at most one line that points at rank 1 (torchrun may stop
    # rank 0 before it gets to say it), no traceback
    assert workers.count("[rank0]: shardplan: stopped because rank 1 failed") <= 1, workers
