"""The test suite is the CPU / gloo suite on every host: CI has no GPU, and on a GPU host torch FSDP2's
default mesh and forked workers would otherwise reach for CUDA (a forked child cannot initialise it).
GPU behaviour is checked by benchmarks/gpu_check.py and the benchmarks, not here. Set before torch loads."""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""
