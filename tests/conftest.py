"""The test suite is the CPU / gloo suite on every host: CI has no GPU, and on a GPU host torch FSDP2's
default mesh and forked workers would otherwise reach for CUDA (a forked child cannot initialise it).
GPU behaviour is checked by benchmarks/gpu_check.py and the benchmarks, not here. Set before torch loads."""

import os
import sys

# SHARDPLAN_TEST_GPU=1 keeps the GPU visible for the tests marked ``cuda`` (run on a GPU machine:
# SHARDPLAN_TEST_GPU=1 python -m pytest -m cuda tests); every other test stays on the CPU either way.
if os.environ.get("SHARDPLAN_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# [Note: the checkout under test] The tests import this checkout's src/, even where another copy of
# shardplan is installed (an editable install of another worktree, a wheel): sys.path for this process
# and PYTHONPATH for the processes it starts (spawned ranks, torchrun, the CLI).
_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
sys.path.insert(0, _SRC)
os.environ["PYTHONPATH"] = os.pathsep.join([_SRC] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
