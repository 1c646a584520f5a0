"""The README's main command, examples/train_gpt.py --save / --resume across world sizes, the functional and
the FSDP x TP examples."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def torchrun(n, *args, timeout=240, script="examples/train_gpt.py"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDPLAN_FORCE_CPU": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           script, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def losses(text):
    return [float(x) for x in re.findall(r"step\s+\d+(?:/\d+)?\s+loss ([\d.]+)", text)]


@pytest.mark.timeout(300)
def test_readme_main_command_trains():
    out = torchrun(2)
    assert "shardplan optim_grads_params on Mesh(dp=2)" in out and "memory on rank 0" in out
    ls = losses(out)
    assert len(ls) == 40 and all(l == l and l < 100 for l in ls)
    assert ls[-1] < 0.7 * ls[0], f"loss did not fall: {ls[0]} -> {ls[-1]}"


@pytest.mark.timeout(300)
def test_save_at_2_resume_at_1_matches_uninterrupted(tmp_path):
    ck = str(tmp_path / "ck")
    full = losses(torchrun(2, "--steps", "12", "--quiet-plan"))
    torchrun(2, "--steps", "12", "--stop-after", "6", "--save", ck, "--quiet-plan")  # the schedule spans 12 steps
    resumed = losses(torchrun(1, "--steps", "12", "--resume", ck, "--strategy", "no_shard", "--quiet-plan"))
    assert resumed == pytest.approx(full[6:], abs=2e-4)


@pytest.mark.timeout(400)
def test_functional_and_tensor_parallel_examples_train_like_the_module_example():
    functional = losses(torchrun(2, "--steps", "12", script="examples/train_functional.py"))
    module = losses(torchrun(2, "--steps", "12", "--quiet-plan"))
    assert len(functional) == 12 and functional[-1] < 0.7 * functional[0]
    assert functional == pytest.approx(module, abs=1e-4)
    # FSDP x TP on 4 processes: the batch is split over dp=2 as above, so the losses are the same run's
    out = torchrun(4, "--steps", "12", "--mesh", "dp=2,tp=2", "--rules", "examples/gpt_rules_tp.py")
    assert "Mesh(dp=2, tp=2)" in out and "compute axes tp" in out
    assert losses(out) == pytest.approx(module, abs=2e-4)
