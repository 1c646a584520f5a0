"""A recorded training step equals ``plan.ops()`` op for op, with tensor parallelism, gradient
accumulation and activation checkpointing all on (the schedule is the whole program)."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import shardplan as sp
from distributed import run

sys.path.insert(0, "examples")
import gpt  # noqa: E402
import gpt_rules_tp  # noqa: E402


def _checkpointed(model, early_stop=True):
    """Every block's forward under non-reentrant activation checkpointing: as torch runs it by default (early
    stop: a recompute ends once backward has every tensor it saves, before a block's last row-parallel
    all-reduce; ``plan.ops(recompute=True)``), or recomputed whole (``set_checkpoint_early_stop(False)``;
    ``plan.ops(recompute="whole")``)."""
    for block in model.layers:
        f = block.forward

        def run(*a, _f=f, **k):
            if early_stop:
                return checkpoint(_f, *a, use_reentrant=False, **k)
            with set_checkpoint_early_stop(False):
                return checkpoint(_f, *a, use_reentrant=False, **k)
        block.forward = run
    return model


def _worker(rank, world):
    out = {}
    g = torch.Generator().manual_seed(1)
    trace = torch.randint(0, 96, (4, 16), generator=g)
    cases = [("optim_grads_params", True, None), ("optim", True, None), ("optim_grads_params", True, (trace, trace)),
             ("optim_grads_params", False, None)]
    for strategy, early_stop, traced in cases:  # (planned on an unwrapped copy: the trace runs a meta copy of it)
        torch.manual_seed(0)
        model = _checkpointed(gpt.build("tiny"), early_stop)
        plan = sp.plan(gpt.build("tiny"), gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2), compute_axes=("tp",),
                       units=gpt_rules_tp.UNITS, min_unit_bytes=0, strategy=strategy, trace=traced)
        sp.shard(model, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        recorded, expected = [], []
        accum = 2
        for _ in range(2):
            x = torch.randint(0, 96, (8, 17), generator=g)
            xs = x.chunk(plan.data_size)[plan.data_index(rank)]
            with sp.record_ops(model) as ops:
                for i, part in enumerate(xs.chunk(accum)):
                    ctx = sp.no_sync(model) if i < accum - 1 else contextlib.nullcontext()
                    with ctx:
                        (model(part[:, :-1], part[:, 1:]) / accum).backward()
                    expected += plan.ops(stale=i == 0, sync=i == accum - 1, recompute=True if early_stop else "whole")
            recorded += ops
            opt.step()
            opt.zero_grad()
        kinds = {o.kind for o in recorded} | {o.what for o in recorded}
        whole = sum(o.when == "recompute_whole" for o in recorded)
        out[(strategy, early_stop, traced is not None)] = (
            recorded == expected, len(recorded), len(expected), sorted(kinds),
            [(str(a), str(b)) for a, b in zip(recorded, expected) if a != b][:3], whole)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_recorded_step_equals_plan_ops_with_tp_accumulation_and_checkpointing():
    for out in run(_worker, 4):
        for case, (equal, n_rec, n_exp, kinds, first_diff, whole) in out.items():
            assert equal, (case, n_rec, n_exp, first_diff)
            # early stop leaves each block's last all-reduce (w2's) out of the recompute: 2 blocks x 4 backwards
            assert whole == (0 if case[1] else 2 * 4), (case, whole)
            assert "prepare" in kinds and "reduce_scatter" in kinds and "all_gather" in kinds, kinds
            assert "activations" in kinds, kinds  # the tensor-parallel collectives are schedule ops too
