#!/bin/bash
# Issue 23 (CPU offload) on one H200, every figure the issue asks for, one launch per case.
#   bash benchmarks/runs/h200_offload.sh OUTDIR fits   # 1B and 3B: full offload, balanced and fitting fraction
#   bash benchmarks/runs/h200_offload.sh OUTDIR 8b        # Llama-3 8B shape on one GPU, 60% offloaded (72 GiB of host)
#   bash benchmarks/runs/h200_offload.sh OUTDIR 8b-full   # the same fully offloaded (a host with >= 160 GiB)
#   bash benchmarks/runs/h200_offload.sh OUTDIR overlap   # 1B full offload at batch 8 (host-bound) and 32 (device-bound)
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
elif [ "$WHAT" = overlap ]; then
  # the host step (~295 ms for the 1B at ~91 GB/s) overlaps backward and the next forward: at batch 8 the device
  # step (130 ms) is shorter, so the step is host-bound; at batch 32 (device ~440 ms forecast) it can hide
  for B in 8 32; do
    run --config 1B --batch $B --seq 1024 $A --systems shardplan,shardplan_offload --offload optimizer \
      --out $OUT/train_step_h200_1B_b${B}_w1_offload_optimizer.json
  done
elif [ "$WHAT" = 8b ]; then
  # Llama-3 8B shape, batch 1 x 8192, no activation checkpointing: planned (traced) device peak 158.6 GiB without
  # offload (does not fit a 139 GiB H200); offload_fraction 0.6: 122.8 GiB on the device, 71.5 GiB of host
  # state (plan.memory().host_pinned: 73 GiB of power-of-two slabs), which a 128 GiB host holds. Full offload (120 GiB of host
  # state) needs a host with more memory: `8b-full`.
  run --config 8B --batch 1 --seq 8192 --dtype bf16 --steps 3 --warmup 1 --rounds 1 --breakdown \
    --trace-plan --systems shardplan_offload --offload fraction=0.6 --forecast h200-8x-ib400:8 \
    --out $OUT/train_step_h200_8B_w1_offload_f06.json
else
  # 8b-full: one GPU of a host with >= 160 GiB (the 8B's host state is 120 GiB, pinned in 123 GiB of slabs);
  # planned device peak (traced, recomputed): 124.5 GiB without offload (states alone 120 GiB), 64.4 GiB with it
  CUDA_VISIBLE_DEVICES=0 run --config 8B --batch 1 --seq 8192 --dtype bf16 --steps 3 --warmup 1 --rounds 1 --breakdown \
    --act-ckpt --trace-plan --systems shardplan,shardplan_offload --offload optimizer --forecast h200-8x-ib400:8 \
    --out $OUT/train_step_h200_8B_w1_offload_optimizer.json
fi
