"""FP8 compute through torchao (``sp.plan(..., fp8="torchao")``, docs/low_precision.md#fp8-compute).

The planning tests and the missing-torchao error run everywhere (CI has no torchao); the conversion and the
training parity need torchao and skip cleanly without it (``pip install shardplan[fp8]``).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

import shardplan as sp
from distributed import run
from shardplan import fp8 as FP8
from shardplan.errors import FP8UnavailableError

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/examples")
import gpt  # noqa: E402

RULES = [(r".*", sp.P("dp"))]
UNITS = [r"layers\.\d+"]
try:
    import torchao.float8  # noqa: F401
    HAVE_TORCHAO = True
except ImportError:
    HAVE_TORCHAO = False
needs_torchao = pytest.mark.skipif(not HAVE_TORCHAO, reason="torchao is not installed (pip install shardplan[fp8])")


def _meta(config):
    with torch.device("meta"):
        return gpt.build(config)


# -- planning (no torchao) ---------------------------------------------------------------------------

def test_the_plan_picks_every_block_linear_but_the_head():
    plan = sp.plan(_meta("1B"), RULES, sp.Mesh(dp=8), compute_dtype="bf16", fp8="torchao")
    paths = {m.path for m in plan.fp8_modules}
    assert len(paths) == 16 * 7 and "output" not in paths
    assert all(m.unit == m.path.rsplit(".", 2)[0].rsplit(".", 1)[0] or m.unit.startswith("layers.")
               for m in plan.fp8_modules)
    m = next(m for m in plan.fp8_modules if m.path == "layers.3.feed_forward.w1")
    assert (m.in_features, m.out_features, m.unit, m.weight) == (2048, 5632, "layers.3", "layers.3.feed_forward.w1.weight")
    assert any("output: the output head" in n for n in plan.notes)
    # fp8_gather=False changes no byte of the plan: the weights are gathered in bf16 (torchao casts after the gather)
    bf16 = sp.plan(_meta("1B"), RULES, sp.Mesh(dp=8), compute_dtype="bf16")
    cast = sp.plan(_meta("1B"), RULES, sp.Mesh(dp=8), compute_dtype="bf16", fp8="torchao", fp8_gather=False)
    assert cast.comm_bytes() == bf16.comm_bytes() and cast.memory() == bf16.memory()
    assert not any(b.tensorwise for b in cast.buffers)
    # the tiny GPT's head is tied to the embedding: excluded by name, and its 64-wide Linears all convert
    tiny = sp.plan(gpt.tiny(), RULES, sp.Mesh(dp=2), units=UNITS, fp8="torchao")
    assert len(tiny.fp8_modules) == 14


def test_float8_gathers_in_the_plan():
    """Under ZeRO-3 the float8 Linears' weights get buffers of their own, gathered as float8 codes (1 byte per
    element, no block scales) after an all-reduce of one fp32 absmax per weight; the plan's bytes say so."""
    bf16 = sp.plan(_meta("1B"), RULES, sp.Mesh(dp=8), compute_dtype="bf16")
    plan = sp.plan(_meta("1B"), RULES, sp.Mesh(dp=8), compute_dtype="bf16", fp8="torchao")
    tw = [b for b in plan.buffers if b.tensorwise]
    assert {n for b in tw for n in b.params} == {m.weight for m in plan.fp8_modules}
    assert all(b.gather_bytes == b.shard_numel * b.group_size and b.scale_bytes == 0 for b in tw)
    assert all(b.amax_bytes == 4 * 7 for b in tw)                       # 7 weights per block
    c, c0 = plan.comm_bytes(), bf16.comm_bytes()
    gathers = sum(1 for o in plan.ops() if o.kind == "all_gather" and o.what == "params" and any(
        plan.buffers[i].tensorwise for i in o.buffers))
    assert c["fp8_amax"] == gathers * 2 * 28 * 7 // 8 and c["all_reduce"] == c0["all_reduce"] + c["fp8_amax"]
    linear = sum(p.numel for p in plan.params if p.name in {m.weight for m in plan.fp8_modules})
    saved = c0["all_gather"] - c["all_gather"]                         # one byte per element instead of two
    assert abs(saved - gathers // 16 * 0 - 2 * linear * 7 // 8) < 0.01 * saved, (saved, linear)
    m, m0 = plan.memory(), bf16.memory()
    assert m.gathered_peak < m0.gathered_peak                           # the gathered weights are float8 codes
    text = str(plan)
    assert "all-gathered as float8 codes" in text and "absmax all-reduce" in text
    from shardplan.planner.render import render_schedule
    sched = render_schedule(plan)
    # the absmax all-reduce is an op of its own (every collective is), just before its unit's all-gather
    assert "absmax (max) of float8 weights, then their scales: all_reduce scales layers.0 over dp, 28 B" in sched
    assert "quantize float8 (one scale per weight), all_gather params layers.0" in sched
    ops = plan.ops()
    scales = [k for k, o in enumerate(ops) if o.what == "scales"]
    assert scales and all(ops[k + 1].kind == "all_gather" and ops[k + 1].unit == ops[k].unit for k in scales)
    # a hand-edited schedule is checked: a float8 gather without its scales, or scales over another group
    import dataclasses
    i = next(i for i, o in enumerate(plan.schedule) if o.what == "scales")
    with pytest.raises(sp.errors.PlanError, match="no all_reduce of their scales"):
        plan.with_schedule(plan.schedule[:i] + plan.schedule[i + 1:])
    edited = list(plan.schedule)
    edited[i] = dataclasses.replace(edited[i], axes=())
    with pytest.raises(sp.errors.PlanError, match="gathered over"):
        plan.with_schedule(edited)
    assert "float8 weights to torchao as they are (no dequantize)" in sched
    for kw in (dict(strategy="optim_grads"), dict(offload="optimizer")):  # no per-step gather, or not supported
        other = sp.plan(_meta("1B"), RULES, sp.Mesh(dp=8), fp8="torchao", **kw)
        assert not any(b.tensorwise for b in other.buffers) and other.fp8_modules


def test_per_module_rules_and_refusals():
    plan = sp.plan(_meta("1B"), RULES, sp.Mesh(dp=8), fp8=[(r".*attention.*", None), (r".*feed_forward.*", "torchao")])
    assert {m.path.rsplit(".", 1)[1] for m in plan.fp8_modules} == {"w1", "w2", "w3"}
    head = sp.plan(_meta("1B"), RULES, sp.Mesh(dp=8), fp8=[(r"output", "torchao")])
    assert [m.path for m in head.fp8_modules] == ["output"]         # a rule may take the head
    odd = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 10))
    assert [m.path for m in sp.plan(odd, RULES, sp.Mesh(dp=2), fp8="torchao").fp8_modules] == ["0"]
    with pytest.raises(sp.errors.PlanError, match="divisible by 16"):
        sp.plan(odd, RULES, sp.Mesh(dp=2), fp8=[(r".*", "torchao")])  # named explicitly: refused, not skipped
    with pytest.raises(sp.errors.PlanError, match="tied"):
        sp.plan(gpt.tiny(), RULES, sp.Mesh(dp=2), fp8=[(r"output", "torchao")])
    with pytest.raises(sp.errors.PlanError, match="fp8 must be"):
        sp.plan(odd, RULES, sp.Mesh(dp=2), fp8="e4m3")
    with pytest.raises(sp.errors.PlanError, match="no nn.Linear"):
        sp.plan(nn.Sequential(nn.Linear(10, 10)), RULES, sp.Mesh(dp=2), fp8="torchao")


@pytest.mark.slow  # 1B and 8B traces; FP8 plans: the fast cases above
def test_print_plan_says_where_fp8_pays_and_warns_where_it_does_not():
    small = sp.plan(_meta("1B"), RULES, sp.Mesh(dp=8), compute_dtype="bf16", fp8="torchao")
    text = str(small)
    assert "fp8 compute (torchao Float8Linear" in text and "never for 64" in text
    assert any("64 of 112 float8 Linear(s) are too small" in w for w in small.warnings)
    # the 8B shape at 1 x 8192 tokens per rank: its 4096 x 4096 and MLP matmuls pay, the 4096 -> 1024 k/v do not
    big = sp.plan(_meta("8B"), RULES, sp.Mesh(dp=8), compute_dtype="bf16", fp8="torchao",
                  trace=(torch.zeros(1, 8192, dtype=torch.long, device="meta"),))
    assert not any("tokens per rank" in w for w in big.warnings)
    assert any("64 of 224" in w for w in big.warnings)          # wk, wv: 4096 -> 1024 (torchao's own filter)
    short = sp.plan(_meta("8B"), RULES, sp.Mesh(dp=8), compute_dtype="bf16", fp8="torchao",
                    trace=(torch.zeros(1, 2048, dtype=torch.long, device="meta"),))
    assert any("at 2,048 tokens per rank per step (traced), 160 float8 Linear(s)" in w for w in short.warnings)


def test_the_plan_round_trips_with_its_fp8_modules():
    plan = sp.plan(gpt.tiny(), RULES, sp.Mesh(dp=2), units=UNITS, fp8="torchao")
    again = sp.Plan.from_json(plan.to_json())
    assert again.fp8_modules == plan.fp8_modules and again.fingerprint() == plan.fingerprint()
    assert sp.plan(gpt.tiny(), **plan.declarative()).fp8_modules == plan.fp8_modules
    assert "fp8_modules" not in sp.plan(gpt.tiny(), RULES, sp.Mesh(dp=2), units=UNITS).to_json()  # old JSON unchanged


# -- the clear errors (no torchao needed) ---------------------------------------------------------------

def test_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)           # import torchao now raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    plan = sp.plan(gpt.tiny(), RULES, sp.Mesh(dp=1), units=UNITS, fp8="torchao")
    with pytest.raises(FP8UnavailableError, match=r"pip install 'shardplan\[fp8\]'"):
        FP8.convert(gpt.tiny(), plan)
    assert FP8.converted(gpt.tiny()) == []
    FP8.convert(gpt.tiny(), sp.plan(gpt.tiny(), RULES, sp.Mesh(dp=1)))  # no FP8 in the plan: nothing needed


def _shard_without_torchao(rank, world):
    if rank == 1:
        sys.modules["torchao"] = None    # one rank lacks torchao: every rank must raise, none may hang
        sys.modules["torchao.float8"] = None
    plan = sp.plan(gpt.tiny(), RULES, sp.Mesh(dp=world), units=UNITS, fp8="torchao")
    sp.shard(gpt.tiny().init_weights(0), plan, timeout_s=30)


def test_shard_without_torchao_raises_on_every_rank():
    got = run(_shard_without_torchao, 2, expect_errors=True, timeout=120)
    assert got[1][0] == "error" and "FP8UnavailableError" in got[1][1] and "shardplan[fp8]" in got[1][1]
    if HAVE_TORCHAO:  # rank 0 converted fine and learns of rank 1's problem at the start-up exchange
        assert got[0][0] == "error" and "rank 1" in got[0][1] and "shardplan[fp8]" in got[0][1]


def test_a_device_without_float8_matmuls_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    why = FP8._why_not(torch.device("cuda", 0))
    assert "compute capability 8.6" in why and "8.9 or newer" in why

    def no_fp8(*a, **k):
        raise RuntimeError("_scaled_mm is not implemented for this device")
    monkeypatch.setattr(torch, "_scaled_mm", no_fp8)
    monkeypatch.setattr(FP8, "_probed", {})
    with pytest.raises(FP8UnavailableError, match="has no float8 matmul on cpu.*Plan with fp8=None"):
        FP8.check_device("cpu")


# -- with torchao ------------------------------------------------------------------------------------

@needs_torchao
def test_convert_swaps_exactly_the_planned_modules():
    from torchao.float8.float8_linear import Float8Linear
    model = gpt.tiny().init_weights(0)
    plan = sp.plan(model, RULES, sp.Mesh(dp=1), units=UNITS, fp8=[(r".*feed_forward.*", "torchao")])
    w = model.layers[0].feed_forward.w1.weight
    FP8.convert(model, plan)
    assert FP8.converted(model) == [m.path for m in plan.fp8_modules]
    assert isinstance(model.layers[1].feed_forward.w2, Float8Linear)
    assert not isinstance(model.layers[0].attention.wq, Float8Linear)
    assert model.layers[0].feed_forward.w1.weight is w                  # the same Parameter: optimizers keep it
    FP8.convert(model, plan)                                               # again: nothing left to do
    with pytest.raises(sp.errors.RuntimeShardingError, match="build the plan from this model"):
        FP8.convert(nn.Sequential(nn.Linear(32, 32)), plan)
    # a module the user converted with another recipe would be cast by shardplan's float8 gather as if it had
    # the default one: refused (fp8_gather=False lets torchao cast with the module's own config)
    from torchao.float8 import Float8LinearConfig
    other = gpt.tiny().init_weights(0)
    own = Float8LinearConfig(round_scales_to_power_of_2=True)
    other.layers[0].feed_forward.w1 = Float8Linear.from_float(other.layers[0].feed_forward.w1, config=own)
    with pytest.raises(sp.errors.RuntimeShardingError, match="already a torchao Float8Linear with a config other"):
        FP8.convert(other, plan)
    cast = sp.plan(gpt.tiny(), RULES, sp.Mesh(dp=1), units=UNITS, fp8=[(r".*feed_forward.*", "torchao")],
                   fp8_gather=False)
    FP8.convert(other, cast)


STEPS, EXACT, TOL = 20, 1e-5, 1e-2


def _parity(rank, world, steps):
    """Loss curves of: the sharded model with float8 gathers, the sharded model with fp32 gathers (fp8_gather=False),
    the unsharded converted model, the unsharded unconverted one; and, for the float8-gather run, the Float8Linear
    count, the bytes all_gather sent per step against the plan's, and the absmax all-reduces against the plan's."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor
    from shardplan.runtime import collectives as C
    kw = dict(units=UNITS, min_unit_bytes=0, fp8="torchao")
    plan = sp.plan(gpt.tiny(), RULES, sp.Mesh(dp=world), **kw)
    model = sp.shard(gpt.tiny().init_weights(0), plan)
    cast = sp.shard(gpt.tiny().init_weights(0), sp.plan(gpt.tiny(), RULES, sp.Mesh(dp=world), fp8_gather=False, **kw))
    ref = FP8.convert(gpt.tiny().init_weights(0), plan)
    plain = gpt.tiny().init_weights(0)
    models = (model, cast, ref, plain)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
    seen = []  # the weight a float8 Linear computes with, in the float8-gather run
    model.layers[0].feed_forward.w1.register_forward_pre_hook(lambda m, a: seen.append(type(m.weight)))
    sent, amaxes, orig, orig_max = [0], [0], C.all_gather, C.all_reduce_max

    def counted(out, inp, group, async_op=True):
        if group.pg is not None:
            sent[0] += out.numel() * out.element_size() * (group.size - 1) // group.size
        return orig(out, inp, group, async_op)

    def counted_max(t, group):
        amaxes[0] += 1
        return orig_max(t, group)
    g = torch.Generator().manual_seed(1)
    curves, per_step = tuple([] for _ in models), []
    batch, seq = 4, 32
    for _ in range(steps):
        start = torch.randint(0, 256, (batch * world, 1), generator=g)
        stride = torch.randint(1, 4, (batch * world, 1), generator=g)
        x = (start + stride * torch.arange(seq + 1)) % 256
        for i, (m, opt) in enumerate(zip(models, opts)):
            if i == 0:
                C.all_gather, C.all_reduce_max, before = counted, counted_max, sent[0]
            if i < 2:
                xs = x[rank * batch:(rank + 1) * batch]
                loss = m(xs[:, :-1], xs[:, 1:])
            else:  # [Note: per-rank batches] torchao scales activations and output gradients by their absmax, so
                # the unsharded models run each rank's batch apart (as the ranks do) and average the losses
                parts = [x[r * batch:(r + 1) * batch] for r in range(world)]
                loss = sum(m(xs[:, :-1], xs[:, 1:]) for xs in parts) / world
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i == 0:
                C.all_gather, C.all_reduce_max = orig, orig_max
                per_step.append(sent[0] - before)
            t = loss.detach().clone()
            if i < 2:
                torch.distributed.all_reduce(t)
                t /= world
            curves[i].append(t.item())
    gathers = sum(1 for o in plan.ops() if o.kind == "all_gather" and o.what == "params"
                  and any(plan.buffers[i].tensorwise for i in o.buffers))
    return curves + (len(FP8.converted(model)), per_step, plan.comm_bytes()["all_gather"], amaxes[0],
                     gathers * steps, all(t is Float8TrainingTensor for t in seen) and len(seen) == steps)


@needs_torchao
@pytest.mark.slow
def test_sharded_fp8_training_matches_the_unsharded_fp8_model():
    """2 ranks (gloo, CPU float8 _scaled_mm): 20 AdamW steps of the tiny GPT with its 14 Linears in float8.

    * float8 gathers and fp32 gathers cast after the gather give the same curve to the bit (fp32 compute: the codes
      are the same, from the same absmax of the whole weight);
    * against the same model converted and not sharded, run on the same per-rank batches, the first 5 steps are
      equal; then the fp32 reduction's summation order (5e-7) flips float8 roundings and the curves drift apart by
      up to 2.4e-3 (measured), under the spread between fp8 and fp32 compute itself (5.5e-3);
    * the bytes all_gather sends per step equal the plan's, and one absmax all-reduce runs per float8 gather."""
    f8, cast, ref, plain, n, per_step, planned, amaxes, gathers, bound = run(_parity, 2, STEPS)[0]
    assert n == 14 and bound
    assert f8 == cast
    assert set(per_step) == {planned} and amaxes == gathers, (per_step, planned, amaxes, gathers)
    diffs = [abs(a - b) for a, b in zip(f8, ref)]
    off = max(abs(a - b) for a, b in zip(ref, plain))
    print(f"max |sharded fp8 - unsharded fp8| over {STEPS} steps: {max(diffs):.3g} (first 5: {max(diffs[:5]):.3g}); "
          f"fp8 vs fp32 compute: {off:.3g}; final {f8[-1]:.4f} / {ref[-1]:.4f} / {plain[-1]:.4f}")
    assert max(diffs[:5]) < EXACT and max(diffs) < TOL, diffs
    assert off > 0 and f8[-1] < f8[0] - 1


def _toy_and_memory(rank, world):
    """The Toy model (a weight sharded over dim 1: interleaved, copied out after its gather) with float8 gathers
    against fp8_gather=False: (their gradients, equal?), and the runtime's peak against the plan's, per case."""
    from models import Toy, batches, toy_rules
    out = {}
    grads = []
    for gather in (True, False):
        model = Toy(d=16, h=32)
        plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), units=[r"blocks\.\d+"], min_unit_bytes=0,
                       fp8="torchao", fp8_gather=gather)
        assert not gather or any(b.tensorwise and b.copy_out for b in plan.buffers)
        sp.shard(model, plan)
        x, y = batches(1, batch=2)[0]
        sp.reset_peak(model)
        model(x, y).backward()
        torch.optim.SGD(model.parameters(), lr=1.0).step()  # the gradients, whole, in the updated weights
        grads.append(sp.checkpoint.full_state_dict(model))
        out[("toy", gather)] = (sp.memory_stats(model)["peak"], plan.memory(rank).peak - plan.memory(rank).optimizer)
    out["toy grads equal"] = grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][k], grads[1][k])
                                                                          for k in grads[0])
    for compute in (None, torch.bfloat16):
        plan = sp.plan(gpt.tiny(), RULES, sp.Mesh(dp=world), units=UNITS, min_unit_bytes=0, fp8="torchao",
                       compute_dtype=compute)
        model = sp.shard(gpt.tiny().init_weights(0), plan)
        x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(rank))
        sp.reset_peak(model)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
        out[("gpt", str(compute))] = (sp.memory_stats(model)["peak"], plan.memory(rank).peak - plan.memory(rank).optimizer)
    return out


@needs_torchao
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_float8_gathers_memory_and_copy_out(world):
    """Float8 gathers of an interleaved weight (copied out after its gather, as bytes) give the gradients of fp32
    gathers to the bit (fp32 compute); the runtime's peak equals the plan's (fp32 and bf16 compute)."""
    for rank, r in enumerate(run(_toy_and_memory, world)):
        assert r.pop("toy grads equal"), rank
        for case, (measured, planned) in r.items():
            assert measured == planned, (rank, case, measured, planned)


def _fp8_nan_worker(rank, world, deferred=False, holder=1, weight="w2"):
    model = gpt.tiny().init_weights(0)
    plan = sp.plan(model, RULES, sp.Mesh(dp=world), units=UNITS, min_unit_bytes=0, fp8="torchao")
    sp.shard(model, plan)
    if deferred:  # the GPU's check (no host sync): found at the buffer's next gather
        for b in model._shardplan.buffer.values():
            b.defer_check = True
    x = torch.randint(0, 256, (2, 9))
    model(x[:, :-1], x[:, 1:]).backward()
    if rank == holder:
        with torch.no_grad():
            getattr(model.layers[1].feed_forward, weight).weight.view(-1)[3] = float("nan")
    for _ in range(2 if deferred else 1):
        model(x[:, :-1], x[:, 1:]).backward()
    return "no error"


@needs_torchao
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("deferred,holder,weight", [(False, 1, "w2"), (True, 1, "w2"), (False, 0, "w1"),
                                                     (False, 1, "w1"), (True, 0, "w1")])
def test_a_nan_in_a_float8_weight_raises_on_every_rank_naming_it(deferred, holder, weight):
    """The absmax is all-reduced before the cast: every rank sees the NaN of one rank's shard (as inf: a max
    all-reduce may drop a NaN) and raises at the same gather (at once on the host; at the buffer's next gather
    with the GPU's deferred check). w1's weight spans both ranks' shards."""
    for status, message in run(_fp8_nan_worker, 2, deferred, holder, weight, expect_errors=True):
        assert status == "error", message
        assert "RuntimeShardingError" in message and f"layers.1.feed_forward.{weight}.weight" in message, message
        assert "casting it to float8" in message, message
