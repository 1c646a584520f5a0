#!/bin/bash
# Issue 23 (CPU offload) on one H200, every figure the issue asks for, one launch per case.
#   bash benchmarks/runs/h200_offload.sh OUTDIR fits   # 1B and 3B: full offload, balanced and fitting fraction
#   bash benchmarks/runs/h200_offload.sh OUTDIR 8b        # Llama-3 8B shape on one GPU (needs ~140 GiB of host memory)
# The host AdamW alone first (its per-element cost by thread count), then the training runs.
set -u
OUT=${1:-.}
WHAT=${2:-fits}
A="--dtype bf16 --steps 5 --warmup 2 --rounds 2 --breakdown"
run() { echo "== $*"; python3 benchmarks/train_step.py "$@" 2>&1 | grep -v Warning | tail -14; }
if [ "$WHAT" = fits ]; then
  python3 benchmarks/host_adamw.py --numel 200000000 --threads 1,8,15,16 --variants fused,foreach --worker \
    --out $OUT/host_adamw_h200.json
  run --config 1B --batch 8 --seq 1024 $A --systems shardplan,shardplan_offload --offload optimizer \
    --out $OUT/train_step_h200_1B_w1_offload_optimizer.json
  run --config 1B --batch 8 --seq 1024 $A --systems shardplan,shardplan_offload --offload balance \
    --out $OUT/train_step_h200_1B_w1_offload_balance.json
  run --config 1B --batch 8 --seq 1024 $A --systems shardplan,shardplan_offload --offload auto=24 --trace-plan \
    --out $OUT/train_step_h200_1B_w1_offload_auto24.json
  run --config 3B --batch 4 --seq 1024 $A --systems shardplan,shardplan_offload --offload optimizer \
    --out $OUT/train_step_h200_3B_w1_offload_optimizer.json
  run --config 3B --batch 4 --seq 1024 $A --systems shardplan,shardplan_offload --offload balance \
    --out $OUT/train_step_h200_3B_w1_offload_balance.json
else
  # one GPU of a host with >= 256 GiB (the 8B's host state is 120 GiB, pinned in one slab rounded to 128 GiB);
  # planned device peak (traced, recomputed): 124.5 GiB without offload (states alone 120 GiB), 64.4 GiB with it
  CUDA_VISIBLE_DEVICES=0 run --config 8B --batch 1 --seq 8192 --dtype bf16 --steps 3 --warmup 1 --rounds 1 --breakdown \
    --act-ckpt --trace-plan --systems shardplan,shardplan_offload --offload optimizer --forecast h200-8x-ib400:8 \
    --out $OUT/train_step_h200_8B_w1_offload_optimizer.json
fi
