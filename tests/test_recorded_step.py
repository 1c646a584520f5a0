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


def _checkpointed(model):
    """Every block's forward under non-reentrant activation checkpointing, recomputed whole in backward
    (torch's early stop would end a recompute once backward has what it needs, before a block's last
    row-parallel all-reduce; ``plan.ops(recompute=True)`` lists a whole recompute)."""
    for block in model.layers:
        f = block.forward

        def run(*a, _f=f, **k):
            with set_checkpoint_early_stop(False):
                return checkpoint(_f, *a, use_reentrant=False, **k)
        block.forward = run
    return model


def _worker(rank, world):
    torch.manual_seed(0)
    model = _checkpointed(gpt.build("tiny"))
    out = {}
    for strategy in ("optim_grads_params", "optim"):
        torch.manual_seed(0)
        model = _checkpointed(gpt.build("tiny"))
        plan = sp.plan(model, gpt_rules_tp.rules, sp.Mesh(dp=2, tp=2), compute_axes=("tp",),
                       units=gpt_rules_tp.UNITS, min_unit_bytes=0, strategy=strategy)
        sp.shard(model, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
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
                    expected += plan.ops(stale=i == 0, sync=i == accum - 1, recompute=True)
            recorded += ops
            opt.step()
            opt.zero_grad()
        kinds = {o.kind for o in recorded} | {o.what for o in recorded}
        out[strategy] = (recorded == expected, len(recorded), len(expected), sorted(kinds),
                         [(str(a), str(b)) for a, b in zip(recorded, expected) if a != b][:3])
    return out


@pytest.mark.timeout(300)
def test_recorded_step_equals_plan_ops_with_tp_accumulation_and_checkpointing():
    for out in run(_worker, 4):
        for strategy, (equal, n_rec, n_exp, kinds, first_diff) in out.items():
            assert equal, (strategy, n_rec, n_exp, first_diff)
            assert "prepare" in kinds and "reduce_scatter" in kinds and "all_gather" in kinds, kinds
            assert "activations" in kinds, kinds  # the tensor-parallel collectives are schedule ops too
