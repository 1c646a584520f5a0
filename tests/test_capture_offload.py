"""CPU offload under ``sp.capture``: the captured step is a program of graph segments with the host optimizer
step between them ([Note: a step in segments], runtime/capture/graph.py; [Note: offload under capture],
runtime/offload/). On the CPU the eager backend runs every call as the graph's program would (the host step as
the replay's host call, the copies where the segments hold them): its steps must equal the eager offloaded
steps bit for bit. The CUDA graphs themselves: benchmarks/capture_check.py --parity (offload cases)."""

from __future__ import annotations

import pytest
import torch

import shardplan as sp

from distributed import run
from models import Toy, accumulating_step, batches, toy_rules

UNITS = [r"blocks\.\d+"]


def _system(world, strategy, offload, fraction, clip, overlap_forward, evals, rescale=False):
    model = Toy()
    plan = sp.plan(model, toy_rules(), sp.Mesh(dp=world), strategy=strategy, units=UNITS, min_unit_bytes=0,
                   offload=offload, offload_fraction=fraction)
    sp.shard(model, plan)
    opt = sp.offload_optimizer(model, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, overlap=not rescale,
                               max_grad_norm=0.05 if clip else None, overlap_forward=overlap_forward)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        if rescale:  # gradients changed after their copy to the host (by hand), then clipped
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.25)
            sp.clip_grad_norm_(model, 0.05)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return model, opt, step


def _state(model):
    eng = model._shardplan  # (offload="params": the shards live in host memory; local_value reads them there)
    return {n: eng.local_value(n, p).clone() for n, p in eng.local_params().items()}


def _parity_worker(rank, world, cases):
    data = batches(7, seed=1 + rank)
    out = []
    for case in cases:
        runs = {}
        for mode in ("eager", "captured"):
            model, opt, step = _system(world, **case)
            f = sp.capture(step, backend="eager") if mode == "captured" else step
            losses, evals = [], []
            for i, (x, y) in enumerate(data[:6]):
                losses.append(float(f(x, y)))
                opt.param_groups[0]["lr"] = 1e-2 / (2 + i)  # a Python-number schedule: the host step reads it
                if case["evals"]:
                    opt.synchronize()
                    with torch.no_grad():
                        evals.append(float(model(*data[6])))
            st = opt.state_dict()["state"]
            runs[mode] = (losses, evals, _state(model), {k: {n: v.clone() for n, v in s.items()} for k, s in st.items()},
                          f.replays if mode == "captured" else None, opt.host_stats()["recopied"])
        (le, ee, pe, se, _, _), (lc, ec, pc, sc, replays, recopied) = runs["eager"], runs["captured"]
        out.append(dict(losses=le == lc, evals=ee == ec, params=all(torch.equal(pe[n], pc[n]) for n in pe),
                        state=all(torch.equal(se[k][n], sc[k][n]) for k in se for n in se[k]), replays=replays,
                        recopied=recopied,
                        moved=any(not torch.equal(pe[n], _state(_system(world, **case)[0])[n]) for n in pe)))
    return out


CASES = [dict(strategy=3, offload="optimizer", fraction=1.0, clip=False, overlap_forward=False, evals=False),
         dict(strategy=3, offload="optimizer", fraction=1.0, clip=True, overlap_forward=False, evals=False),
         dict(strategy=1, offload="optimizer", fraction=1.0, clip=False, overlap_forward=True, evals=True),
         dict(strategy=2, offload="optimizer", fraction=0.5, clip=True, overlap_forward=False, evals=True),
         dict(strategy=3, offload="params", fraction=1.0, clip=True, overlap_forward=False, evals=False),
         dict(strategy=3, offload="params", fraction=0.5, clip=False, overlap_forward=True, evals=True),
         dict(strategy=2, offload="optimizer", fraction=1.0, clip=False, overlap_forward=False, evals=False,
              rescale=True)]


@pytest.mark.timeout(300)
def test_an_offloaded_step_captured_equals_the_eager_one_bit_for_bit():
    """ZeRO-1/2/3 with the optimizer or the parameters offloaded, part of them kept on the device
    (offload_fraction=0.5), clipping inside the optimizer, the overlapped forward, a Python learning rate changed
    after every step, evaluations between replays, gradients changed by hand after their copy to the host and
    then clipped: losses, evaluations, parameters and the optimizer's state equal the eager offloaded run's
    exactly.""" 
    for rank_out in run(_parity_worker, 2, CASES, timeout=280):
        for case, r in zip(CASES, rank_out):
            assert r["moved"] and r["replays"] == 3, (case, r)
            assert r["losses"] and r["evals"] and r["params"] and r["state"], (case, r)
            # the graph copies again only gradients changed after their copy ([Note: versions of scaled gradients])
            assert (r["recopied"] > 0) == case.get("rescale", False), (case, r)


def test_offloading_plans_can_be_captured():
    model = Toy()
    for offload, fraction in (("optimizer", 1.0), ("params", 0.5)):
        plan = sp.plan(model, toy_rules(), sp.Mesh(dp=2), units=UNITS, min_unit_bytes=0, offload=offload,
                       offload_fraction=fraction)
        assert plan.capturable and "capture: yes" in str(plan)


def _constant_worker(rank, world):
    data = batches(5, seed=1 + rank)
    model, opt, step = _system(world, 3, "optimizer", 1.0, True, False, False)
    f = sp.capture(step, backend="eager")
    for x, y in data[:3]:
        f(x, y)
    opt.max_grad_norm = 1.0  # baked into the graph (the clipping runs on the device)
    try:
        f(*data[3])
    except sp.errors.CaptureError as exc:
        return str(exc)
    return None


def test_a_clipping_threshold_changed_after_the_capture_is_refused():
    for msg in run(_constant_worker, 2, timeout=120):
        assert msg and "OffloadAdamW.max_grad_norm" in msg and "step.reset()" in msg, msg


def _rehearse_worker(_rank, _world):
    from shardplan.models import gpt
    torch.set_num_threads(1)
    plan = sp.plan(gpt.build("tiny"), [(r".*", sp.P("dp"))], sp.Mesh(dp=4), units=[r"layers\.\d+"], offload="optimizer")
    r = sp.rehearse(lambda: gpt.build("tiny"), plan, rank=1, batch=(2, 16), steps=2, capture=True)
    return r.to_dict()


@pytest.mark.timeout(120)
def test_rehearse_captures_an_offloaded_step():
    """``rehearse(capture=True)`` of an offloading plan: one rank's step captured with the offloading optimizer
    (the host step between the segments) and replayed."""
    d = run(_rehearse_worker, 1, init=False, timeout=110)[0]
    assert d["captured"] and len(d["step_s"]) == 2


def _outside_worker(rank, world):
    data = batches(4, seed=1 + rank)
    model, opt, _ = _system(world, 3, "optimizer", 1.0, False, False, False)

    def backward_only(x, y):
        loss = model(x, y)
        loss.backward()
        return loss.detach()
    f = sp.capture(backward_only, backend="eager")
    try:
        for x, y in data:
            f(x, y)
            opt.step()
            opt.zero_grad()
    except sp.errors.CaptureError as exc:
        return str(exc)
    return None


def test_an_offloaded_optimizer_stepping_outside_the_captured_step_is_refused():
    """The captured step copies the gradients to the host; a replay's copies land asynchronously, so an
    ``opt.step()`` outside the step would read the host gradients before them: refused at the capture."""
    for msg in run(_outside_worker, 2, timeout=120):
        assert msg and "opt.step()" in msg and "inside the captured step" in msg, msg


def _python_output_worker(rank, world):
    data = batches(5, seed=1 + rank)
    model, opt, step = _system(world, 3, "optimizer", 1.0, False, False, False)
    calls = []

    def counted(x, y):
        calls.append(1)
        return step(x, y), len(calls)  # a Python value: a graph returns the capture's at every replay
    f = sp.capture(counted, backend="eager")
    try:
        for x, y in data:
            f(x, y)
    except sp.errors.CaptureError as exc:
        return str(exc)
    return None


def test_a_python_output_that_changes_between_replays_is_refused_by_the_eager_backend():
    for msg in run(_python_output_worker, 2, timeout=120):
        assert msg and "returned 4 where its capture returned 3" in msg, msg


def _cut_short_worker(rank, world):
    from shardplan.runtime.offload import kernels
    data = batches(6, seed=1 + rank)
    model, opt, step = _system(world, 3, "optimizer", 1.0, False, False, False)
    f = sp.capture(step, backend="eager")
    for x, y in data[:3]:
        f(x, y)  # two warm-ups, the capture
    compute, seen = kernels._host_compute, []

    def failing(hb, *a, **k):  # the second buffer's host step fails in the next replay
        seen.append(hb)
        if len(seen) == 2:
            raise MemoryError("host out of memory (injected)")
        return compute(hb, *a, **k)
    kernels._host_compute = failing
    try:
        f(*data[3])
    except MemoryError:
        pass
    finally:
        kernels._host_compute = compute
    g = next(iter(f.graphs.values()))
    phase = g.phase.value
    opt.synchronize()
    host = model._shardplan.offload
    same = all(torch.equal(hb.b.shard.detach(), hb.master) for hb in host.hosts.values())
    f(*data[4])  # captured again
    return phase, same, g.phase.value, f.replays


def test_a_replay_cut_short_by_its_host_step_is_captured_again():
    """A host step that raises between the segments leaves the step half done (some masters stepped, their
    copies to the device never issued): the graph is stale (the next call captures again) and the stepped masters
    reach the device when the host settles (without: the device kept the old shards under the new masters)."""
    for phase, same, after, replays in run(_cut_short_worker, 2, timeout=120):
        assert phase == "stale" and same and after == "captured" and replays == 0, (phase, same, after, replays)


def _hf_offload_worker(rank, world, name, offload, ckpt_dir):
    import transformers
    g = torch.Generator().manual_seed(rank + 11)
    data = [(torch.randint(1, 97, (4, 8), generator=g), torch.randint(1, 97, (4, 5), generator=g)) for _ in range(6)]

    def build():
        torch.manual_seed(0)
        if name == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64))
            units = [r"model\.layers\.\d+"]
        else:
            model = transformers.T5ForConditionalGeneration(transformers.T5Config(
                vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0))
            units = [r"encoder\.block\.\d+", r"decoder\.block\.\d+"]
        sp.shard(model, sp.plan(model, [(r".*(norm|layer_norm).*", sp.P()), (r".*", sp.P("dp"))], sp.Mesh(dp=world),
                                units=units, min_unit_bytes=0, offload=offload))
        opt = sp.offload_optimizer(model, lr=1e-2, weight_decay=0.1, overlap=False)

        def loss_of(x, y):
            return model(input_ids=x, labels=y if name == "t5" else x).loss

        step = accumulating_step(model, opt, loss_of)  # two micro-batches, clipped: one optimizer step a call
        return model, opt, step, loss_of

    def train(f, opt, loss_of, batches, start):
        losses, evals = [], []
        for i, (x, y) in enumerate(batches):
            losses.append(float(f(x, y)))
            opt.param_groups[0]["lr"] = 1e-2 / (2 + start + i)
            with torch.no_grad():
                evals.append(float(loss_of(*data[0])))
        return losses, evals

    model, opt, step, loss_of = build()
    eager = train(step, opt, loss_of, data, 0)
    eager_state = {n: v.clone() for n, v in sp.checkpoint.full_state_dict(model).items()}
    model, opt, step, loss_of = build()
    f = sp.capture(step, backend="eager")
    first = train(f, opt, loss_of, data[:4], 0)  # warm-ups, the capture, one replay; then a checkpoint
    sp.checkpoint.save(ckpt_dir, model, opt, step=4)
    rest = train(f, opt, loss_of, data[4:], 4)
    captured_state = sp.checkpoint.full_state_dict(model)
    model, opt, step, loss_of = build()  # the checkpoint written between replays, resumed eagerly
    sp.checkpoint.load(ckpt_dir, model, opt)
    resumed = train(step, opt, loss_of, data[4:], 4)
    resumed_state = sp.checkpoint.full_state_dict(model)
    return (eager[0] == first[0] + rest[0] and eager[1] == first[1] + rest[1],
            all(torch.equal(eager_state[n], captured_state[n]) for n in eager_state),
            resumed == rest and all(torch.equal(eager_state[n], resumed_state[n]) for n in eager_state), f.replays)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name,offload", [("llama", "optimizer"), ("t5", "params")])
def test_hf_models_offloaded_and_captured_equal_eager(name, offload, tmp_path):
    """Llama (optimizer offloaded) and T5 (parameters offloaded), ZeRO-3: two micro-batches under no_sync,
    clipping, a Python learning rate changed between calls, an evaluation after every call, a checkpoint written
    between replays: the captured run's losses, evaluations and parameters equal the eager run's bit for bit, and
    the checkpoint resumes eagerly into the same steps."""
    pytest.importorskip("transformers")
    for losses, params, resumed, replays in run(_hf_offload_worker, 2, name, offload, str(tmp_path / "ckpt"),
                                                timeout=180):
        assert losses and params and resumed and replays == 3, (losses, params, resumed, replays)
