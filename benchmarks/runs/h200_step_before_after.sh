#!/bin/bash
# Issue 21's before/after on one H200: the same benchmark from the tree at the session's start
# (.bench_old: `git archive 285f73f`) and from this tree, one launch each, every system side by side.
#   bash benchmarks/runs/h200_step_before_after.sh OUTDIR
set -u
OUT=${1:-.}
A="--batch 8 --seq 1024 --dtype bf16 --steps 5 --warmup 2 --rounds 2 --systems unsharded,shardplan,functional,fsdp2"
for cfg in tiny200 1B; do
  for tree in old new; do
    dir=.; [ $tree = old ] && dir=.bench_old
    echo "== $tree $cfg"
    python3 $dir/benchmarks/train_step.py --config $cfg $A --out $OUT/train_step_h200_${cfg}_$tree.json 2>&1 | grep -v Warning | tail -12
  done
done
