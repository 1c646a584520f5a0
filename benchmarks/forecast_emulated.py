"""The forecast against the emulated network: for each (model, N) of a grid, this rank's step under
``sp.rehearse(..., network=NET)`` (rank 0 of N on this device, every collective taking NET's time on its
stream: docs/emulated.md) beside ``plan.forecast(NET, ...)`` of the same plan (docs/forecast.md).

    python benchmarks/forecast_emulated.py --out benchmarks/results/forecast_emulated_h100.json   # GPU grid
    python benchmarks/forecast_emulated.py --tiny                                                 # CPU, < 1 min
    python benchmarks/forecast_emulated.py --models gpt:1B@4x2048 --worlds 8 --bandwidth 0.5

The plan is benchmarks/emulated.py's (one unit per block, bf16 compute, fp32 reduce, ``--prefetch``); the
models and their builders are that script's too (``gpt:NAME``, ``hf:NAME[:LAYERS]``), written here
``SPEC@BxT[:ac]`` (``:ac``: activation checkpointing, ``rehearse(checkpoint=True)``). Per grid point:

1. ``compute``: a rehearsal of the plan with no network (torch's fake group: every collective free): this
   rank's measured unit times, what ``shardplan forecast --compute rehearsal.json`` reads;
2. ``emulated``: the rehearsal under NET (``r.network``: the median step with the network, the baseline with
   it off, the exposed communication, the ledger's modelled seconds per op kind);
3. the forecast of the plan on NET with the compute model (a) the network's device preset (achievable rates;
   ``backward_factor`` 3 under checkpointing), (b) step 1's measured unit times, and (b') the unit times of
   step 2's own rehearsal, as its JSON gives them (``forecast --compute`` refuses that JSON: each wait on
   a collective sits in its root unit's time, so the forecast would count it twice; shown to say how much),
   and (b~): (b) with its unit times scaled by one factor to the network rehearsal's baseline step (on a
   shared CPU the machine's speed drifts between two rehearsals; on a GPU the factor is about 1).

Reported: emulated step, forecast (a), (b), (b~), (b'), the ratios to the emulated step, exposed
communication emulated vs forecast (b~), and the ledger's modelled seconds per kind beside the forecast's (they share
``forecast/network.py``'s ``collective_time``: a mismatch there is a different collective, not a different
model). Everything is EMULATED: one device playing rank 0; nothing ran on several GPUs.

This script extends benchmarks/forecast_check.py's question (is the forecast within its tolerance of a step
measured here?) from a real gloo world on this CPU to the emulated network at any N; it reuses
benchmarks/emulated.py's model builders and plan rather than its own copies.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

GRID = "gpt:1B@4x2048,hf:llama3_8b@1x8192:ac,hf:llama3_70b:8@1x8192:ac"
TINY = "gpt:tiny@2x32,gpt:tiny@2x32:ac"


@dataclasses.dataclass(frozen=True)
class Point:
    spec: str     # benchmarks/emulated.py's --model
    batch: int
    seq: int
    ac: bool

    @classmethod
    def parse(cls, text: str) -> "Point":
        spec, _, rest = text.partition("@")
        shape, _, ac = rest.partition(":")
        if not spec or "x" not in shape or ac not in ("", "ac"):
            raise SystemExit(f"--models {text!r}: write SPEC@BxT or SPEC@BxT:ac, e.g. gpt:1B@4x2048")
        b, t = shape.split("x")
        return cls(spec, int(b), int(t), ac == "ac")

    @property
    def name(self) -> str:
        return f"{self.spec}@{self.batch}x{self.seq}{':ac' if self.ac else ''}"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma-separated SPEC@BxT[:ac] (default: {GRID})")
    ap.add_argument("--worlds", default=None, help="comma-separated N (default 8,64,512; --tiny 8,64)")
    ap.add_argument("--network", default="h100-8x-ib400", help="a preset, dict JSON or benchmarks/collectives.py file")
    ap.add_argument("--bandwidth", type=float, default=None,
                    help="scale every link's bandwidth (Network.scaled; default 1; --tiny 1e-5: comm-heavy)")
    ap.add_argument("--compute", default=None, help="compute model (a) (default: the network's device preset)")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="rehearsal steps (default 4)")
    ap.add_argument("--block-ms", type=float, default=None,
                    help="each block also sleeps this long in forward, twice in backward (default 0; --tiny 20)")
    ap.add_argument("--comm-ctas", type=int, default=1,
                    help="GPU: SMs each emulated collective holds (NCCL's channels; benchmarks/emulated.py's)")
    ap.add_argument("--tiny", action="store_true",
                    help=f"the CPU grid: {TINY} at N=8,64, bandwidth x1e-5, --block-ms 20")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    args.models = args.models or (TINY if args.tiny else GRID)
    args.worlds = [int(w) for w in (args.worlds or ("8,64" if args.tiny else "8,64,512")).split(",")]
    args.bandwidth = args.bandwidth if args.bandwidth is not None else (1e-5 if args.tiny else 1.0)
    args.block_ms = args.block_ms if args.block_ms is not None else (20.0 if args.tiny else 0.0)
    args.steps = args.steps or 4
    return args


def the_plan(p: Point, world: int, prefetch: int):
    import emulated as E
    return E.shardplan_plan(argparse.Namespace(model=p.spec, prefetch=prefetch, layout="auto", min_unit_bytes=None), world)


class _Hold:
    """An identity whose forward holds the thread ``ms`` milliseconds and whose backward ``2 ms``."""

    @staticmethod
    def apply(x, ms: float):
        import torch

        class Hold(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                time.sleep(ms / 1e3)
                return t.view_as(t)

            @staticmethod
            def backward(ctx, g):
                time.sleep(2 * ms / 1e3)
                return g
        return Hold.apply(x)


def slowed(build, block_ms: float):
    """``build`` whose repeated blocks (benchmarks/emulated.py's ``blocks_of``) also hold the compute thread
    ``block_ms`` in their forward and twice that in their backward: a sleep, time that a loaded CPU does not
    stretch, so a CPU run compares the timelines rather than the machine's load."""
    import emulated as E
    if not block_ms:
        return build

    def hold(m, a, out):
        if isinstance(out, tuple):
            return (_Hold.apply(out[0], block_ms),) + tuple(out[1:])
        return _Hold.apply(out, block_ms)

    def built():
        model = build()
        for block in E.blocks_of(model)[1]:
            block.register_forward_hook(hold)
        return model
    return built


def the_model_fn(p: Point, block_ms: float = 0.0):
    """benchmarks/emulated.py's builder of ``p.spec``, :func:`slowed` by ``block_ms``."""
    import emulated as E
    return slowed(E.model_fn(p.spec), block_ms)


def preset_compute(spec, net, ac: bool):
    """Compute model (a): ``spec`` or the network's device preset; full checkpointing re-runs each forward."""
    from shardplan.forecast import compute_model
    cm = compute_model(spec or net.device)
    return dataclasses.replace(cm, backward_factor=3.0) if ac else cm


def run_point(p: Point, world: int, net, args) -> dict:
    """One grid point: the two rehearsals and the three forecasts (see the module's docstring)."""
    plan = the_plan(p, world, args.prefetch)
    out = compare(the_model_fn(p, args.block_ms), plan, (p.batch, p.seq), p.ac, net, args.steps,
                  preset_compute(args.compute, net, p.ac))
    return {"model": p.name, **out}


def compare(model_fn, plan, batch: tuple, ac: bool, net, steps: int, preset) -> dict:
    """``plan``'s rank 0 rehearsed without a network and under ``net``, and forecast on ``net`` with the
    ``preset`` compute model (a), the first rehearsal's unit times (b) and the second's (b')."""
    import torch
    import shardplan as sp
    from shardplan.forecast import ComputeModel

    t0 = time.perf_counter()
    base = sp.rehearse(model_fn, plan, batch=batch, steps=steps, checkpoint=ac)
    r = sp.rehearse(model_fn, plan, batch=batch, steps=steps, checkpoint=ac, network=net)
    took = time.perf_counter() - t0
    n = r.network
    fa = plan.forecast(net, preset, batch=batch)
    cm = ComputeModel.from_dict(base.to_dict())
    fb = plan.forecast(net, cm, batch=batch)
    # [Note: drift. On a shared CPU the machine's speed drifts between the two rehearsals (seen: 45%); the
    # network rehearsal's baseline (its steps with the network off, interleaved with those with it on) is
    # the compute its emulated step saw. (b~) is (b) with every unit time scaled by one factor so that its
    # compute equals that baseline: what is left to compare is the communication and the overlap. On a GPU
    # the factor is about 1]
    k = n.baseline_step_s / fb.compute_s if fb.compute_s > 0 else 1.0
    cmk = dataclasses.replace(cm, name=cm.name + " (rescaled)", units=tuple((u, f * k, b * k) for u, f, b in cm.units),
                              optimizer_s=(cm.optimizer_s or 0.0) * k)
    fbk = plan.forecast(net, cmk, batch=batch)
    fbk_serial = plan.forecast(dataclasses.replace(net, overlap=False), cmk, batch=batch)
    fb2 = plan.forecast(net, ComputeModel.from_dict(r.compute_model()), batch=batch)  # (b'): bypasses the refusal
    forecast_kinds: dict = {}
    for c in fb.collectives:
        forecast_kinds[c.kind] = forecast_kinds.get(c.kind, 0.0) + c.latency_s + c.transfer_s
    out = {
        "world": plan.mesh.size, "batch": list(batch), "checkpoint": ac, "device": r.device,
        "emulated_step_s": n.step_s, "emulated_baseline_s": n.baseline_step_s, "emulated_exposed_s": n.exposed_s,
        "emulated_steps_s": list(r.step_s), "compute_rehearsal_step_s": base.median_step_s,
        "forecast_a_s": fa.step_s, "forecast_b_s": fb.step_s, "forecast_b_net_units_s": fb2.step_s,
        "forecast_a_exposed_s": fa.exposed_s, "forecast_b_exposed_s": fb.exposed_s,
        "forecast_b_compute_s": fb.compute_s, "rescale": k, "forecast_b_rescaled_s": fbk.step_s,
        "forecast_b_rescaled_exposed_s": fbk.exposed_s, "forecast_b_rescaled_no_overlap_s": fbk_serial.step_s,
        "ratio_b_rescaled": fbk.step_s / n.step_s,
        "ratio_a": fa.step_s / n.step_s, "ratio_b": fb.step_s / n.step_s, "ratio_b_net_units": fb2.step_s / n.step_s,
        "ledger_modelled_s": dict(n.modelled_s), "ledger_ops": dict(n.ops), "ledger_bytes": dict(n.bytes),
        "forecast_modelled_s": forecast_kinds,
        "forecast_ops": {kind: sum(1 for c in fb.collectives if c.kind == kind) for kind in forecast_kinds},
        "compute_model": base.compute_model(), "seconds": took,
    }
    del base, r
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


_B2 = "(b')/em"
HEAD = (f"{'model':<28} {'N':>4} {'emulated':>9} {'fc (a)':>9} {'fc (b)':>9} {'(a)/em':>7} {'(b)/em':>7} "
        f"{'(b~)/em':>7} {_B2:>7} {'exp em':>8} {'exp fc':>8}")


def row(x: dict) -> str:
    ms = lambda s: f"{s * 1e3:8.2f}"  # noqa: E731
    return (f"{x['model']:<28} {x['world']:>4} {ms(x['emulated_step_s'])} {ms(x['forecast_a_s'])} {ms(x['forecast_b_s'])} "
            f"{x['ratio_a']:7.3f} {x['ratio_b']:7.3f} {x['ratio_b_rescaled']:7.3f} {x['ratio_b_net_units']:7.3f} {ms(x['emulated_exposed_s'])} "
            f"{ms(x['forecast_b_rescaled_exposed_s'])}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    from shardplan.forecast import network

    from shardplan.runtime.emulated import configure

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # the comm thread gets the other core
    configure(None, comm_ctas=args.comm_ctas)  # (the rehearsal configures the network, keeping this)
    net = network(args.network)
    net = net.scaled(args.bandwidth) if args.bandwidth != 1.0 else net
    result = {"network": net.to_dict(), "bandwidth_scale": args.bandwidth, "prefetch": args.prefetch,
              "block_ms": args.block_ms, "comm_ctas": args.comm_ctas,
              "emulated": "one device playing rank 0 of N; every figure is EMULATED under the network model named here",
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "points": []}
    print(f"network {net.name} (bandwidth x{args.bandwidth:g}), EMULATED; times in ms; (b~): (b) rescaled to the "
          f"network rehearsal's baseline; (b'): its own unit times (waits included); exp fc: (b~)'s\n{HEAD}", flush=True)
    for text in args.models.split(","):
        for world in args.worlds:
            x = run_point(Point.parse(text), world, net, args)
            result["points"].append(x)
            print(row(x), flush=True)
            if args.out:  # after every point: a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    ratios = [x["ratio_b"] for x in result["points"]]
    result["max_abs_error_b"] = max(abs(r - 1) for r in ratios) if ratios else None
    result["max_abs_error_b_rescaled"] = max(abs(x["ratio_b_rescaled"] - 1) for x in result["points"]) if ratios else None
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"forecast (b) / emulated: {min(ratios):.3f} .. {max(ratios):.3f}; (b~): within "
          f"{result['max_abs_error_b_rescaled']:.1%}")
    return result


if __name__ == "__main__":
    main()
