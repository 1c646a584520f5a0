"""HF models under tensor / expert parallelism, HSDP and optimizer offload on 4 (or 2) gloo CPU ranks,
against data-parallel semantics computed in one process (see sweep_outside.py).

    PYTHONPATH=src:tests python benchmarks/runs/sweep_parallel.py [--only SUBSTR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import sweep_outside as S  # noqa: E402
import shardplan as sp  # noqa: E402
from shardplan import P  # noqa: E402
from distributed import run  # noqa: E402

LLAMA_TP = [
    (r".*self_attn\.[qkv]_proj\.weight", P(("tp", "dp"))),
    (r".*self_attn\.o_proj\.weight", P("dp", "tp")),
    (r".*mlp\.(gate|up)_proj\.weight", P(("tp", "dp"))),
    (r".*mlp\.down_proj\.weight", P("dp", "tp")),
    (r".*", P("dp")),
]

T5_TP = [
    (r".*(SelfAttention|EncDecAttention)\.[qkv]\.weight", P(("tp", "dp"))),
    (r".*(SelfAttention|EncDecAttention)\.o\.weight", P("dp", "tp")),
    (r".*DenseReluDense\.wi\.weight", P(("tp", "dp"))),
    (r".*DenseReluDense\.wo\.weight", P("dp", "tp")),
    (r".*", P("dp")),
]
BERT_TP = [
    (r".*attention\.self\.(query|key|value)\.weight", P(("tp", "dp"))),
    (r".*attention\.output\.dense\.weight", P("dp", "tp")),
    (r".*intermediate\.dense\.weight", P(("tp", "dp"))),
    (r".*layer\.\d+\.output\.dense\.weight", P("dp", "tp")),
    (r".*", P("dp")),
]
GPT2_TP = [
    (r".*attn\.c_attn\.weight", P(None, ("tp", "dp"))),
    (r".*attn\.c_proj\.weight", P(("tp", "dp"))),
    (r".*", P("dp")),
]
MIXTRAL_EP = [
    (r".*experts\.(gate_up|down)_proj", P("ep", None, None)),
    (r".*", P("dp")),
]

CASES = {
    "t5_tp2": ("t5", 2, dict(dp=1, tp=2), T5_TP, dict(compute_axes=("tp",)), {}),
    "bert_tp2": ("bert", 2, dict(dp=1, tp=2), BERT_TP, dict(compute_axes=("tp",)), {}),
    "gpt2_tp2_conv1d": ("gpt2", 2, dict(dp=1, tp=2), GPT2_TP, dict(compute_axes=("tp",)), {}),
    "mixtral_ep2_explicit": ("mixtral", 2, dict(dp=1, ep=2), MIXTRAL_EP, {}, {}),
    "mixtral_ep2_dp2_explicit": ("mixtral", 4, dict(dp=2, ep=2), MIXTRAL_EP, {}, {}),
    # name: (model, world, mesh axes, rules or "auto", plan kwargs, opts)
    "llama_tp2_dp2": ("llama", 4, dict(dp=2, tp=2), LLAMA_TP, dict(compute_axes=("tp",)), {}),
    "llama_tp2_dp1": ("llama", 2, dict(dp=1, tp=2), LLAMA_TP, dict(compute_axes=("tp",)), {}),
    "llama_tp2_auto": ("llama", 2, dict(dp=1, tp=2), "auto", dict(compute_axes=("tp",)), {}),
    "mixtral_ep2_auto": ("mixtral", 2, dict(dp=1, ep=2), "auto", {}, {}),
    "mixtral_ep2_dp2_auto": ("mixtral", 4, dict(dp=2, ep=2), "auto", {}, {}),
    "llama_hsdp": ("llama", 4, dict(replica=2, dp=2), [(r".*", P("dp"))], {}, {}),
    "t5_hsdp": ("t5", 4, dict(replica=2, dp=2), [(r".*", P("dp"))], {}, {}),
    "llama_offload_optim": ("llama", 2, dict(dp=2), [(r".*", P("dp"))], dict(offload="optimizer"), {"offload": True}),
    "gpt2_tp2_auto": ("gpt2", 2, dict(dp=1, tp=2), "auto", dict(compute_axes=("tp",)), {}),
    "bert_tp2_auto": ("bert", 2, dict(dp=1, tp=2), "auto", dict(compute_axes=("tp",)), {}),
    "t5_tp2_auto": ("t5", 2, dict(dp=1, tp=2), "auto", dict(compute_axes=("tp",)), {}),
}


def worker(rank, world, case):
    name, _, axes, rules, kw, opts = CASES[case]
    model, _, loss_fn, units = S.build(name)
    mesh = sp.Mesh(**axes)
    if rules == "auto":
        rules = sp.auto_rules(model, mesh)
    plan = sp.plan(model, rules, mesh, units=units, min_unit_bytes=0, **kw)
    sp.shard(model, plan)
    if opts.get("offload"):
        opt = sp.offload_optimizer(model, lr=S.LR, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=S.LR, weight_decay=0.01)
    n, i = plan.data_size, plan.data_index(rank)
    losses = []
    for (mb,) in S.batches(name):
        loss = loss_fn(model, S.chunk(mb, i, n))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(S.mean_loss(loss))
    full = sp.checkpoint.full_state_dict(model)
    if rank != 0:
        return None
    ref, ref_losses, _ = S.reference(name, n, {})
    res = S.compare(ref, ref_losses, [{}] * n, losses, full, [{}] * n, n)
    res["styles"] = sorted({m.style for m in plan.axis("tp").modules}) if plan.axis("tp") else None
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    for case, spec in CASES.items():
        if args.only and args.only not in case:
            continue
        t0 = time.time()
        try:
            res = run(worker, spec[1], case, timeout=180)[0]
            status = "ok"
        except BaseException as exc:  # noqa: BLE001
            res, status = {"error": str(exc)[-1200:]}, "error"
        brief = {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in res.items()
                 if k in ("loss_rel", "param_abs", "worst_param", "styles")}
        flag = "" if status != "ok" or (res["loss_rel"] < 1e-5 and res["param_abs"] < 1e-5) else " <-- MISMATCH"
        print(f"[{status}] {case} {brief} {time.time() - t0:.1f}s{flag}", flush=True)
        if status != "ok":
            print("   ", res["error"][-900:].replace("\n", "\n    "), flush=True)


if __name__ == "__main__":
    main()
