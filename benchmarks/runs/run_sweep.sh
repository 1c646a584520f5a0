#!/usr/bin/env bash
# The outside-model sweep: models shardplan was not written for, trained 3 steps on 2/4 gloo CPU ranks and
# compared with unsharded data-parallel training (fp32: losses rel 1e-5, parameters abs 1e-5; bf16: against
# torch FSDP2 with the same MixedPrecisionPolicy). About 25 minutes on 2 cores. Logs into ${OUT:-/tmp/sweep}.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/sweep}
mkdir -p "$OUT"
export PYTHONPATH=src:tests
keep='^\[(ok|error)\]|^    '
python benchmarks/runs/sweep_outside.py --json "$OUT/outside.json" 2>&1 | grep --line-buffered -E "$keep" | tee "$OUT/outside.log"
python benchmarks/runs/sweep_outside.py --ckpt --json "$OUT/ckpt.json" 2>&1 | grep --line-buffered -E "$keep" | tee "$OUT/ckpt.log"
python benchmarks/runs/sweep_edges.py 2>&1 | grep --line-buffered -E "$keep" | tee "$OUT/edges.log"
python benchmarks/runs/sweep_parallel.py 2>&1 | grep --line-buffered -E "$keep" | tee "$OUT/parallel.log"
python benchmarks/runs/sweep_misc.py 2>&1 | grep --line-buffered -E "$keep" | tee "$OUT/misc.log"
python benchmarks/runs/sweep_misc.py --gp 2>&1 | grep --line-buffered -E "$keep" | tee -a "$OUT/misc.log"
