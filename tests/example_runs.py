"""Run an example under torchrun on CPU and read its per-step losses from its --metrics file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def losses(tmp_path, n: int, script: str, *args: str, timeout: float = 300) -> list[float]:
    metrics = os.path.join(str(tmp_path), f"m{n}-{abs(hash(args))}.jsonl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDPLAN_FORCE_CPU": "1",
           "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), script,
           "--quiet-plan", "--progress", "none", "--metrics", metrics, *args]
    out = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-4000:]
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r["loss"] for r in records if "event" not in r]  # (a resumed run's restart marker has no loss)
