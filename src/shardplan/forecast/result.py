"""The forecast as a value: step time and its parts, every collective with its predicted times, the
network and compute model it assumed; printed as a table, written as JSON or a Chrome trace.

>>> f = plan.forecast(network="h100-8x-ib400", batch=(1, 4096))
>>> f.step_s, f.exposed_s, f.tokens_per_s, f.mfu
>>> print(f); f.to_chrome_trace("forecast.json")
>>> plan.forecast(network=f.network.with_link("inter", busbw=90.0), batch=(1, 4096))   # one link changed
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from ..mesh import Mesh
from ..planner.render import fmt_bytes, write_trace
from .compute import ComputeModel
from .network import Network, Placement
from .timeline import Span

KIND_ORDER = ("all_gather", "reduce_scatter", "all_reduce")

# printed beside the step time and MFU it predicts: the model has been checked against one GPU's compute
# (docs/forecast.md), never against a multi-GPU run, and it leaves out what slows real runs (stragglers, NCCL's
# contention with compute, the data loader); the Llama-3-8B check in docs/forecast.md came out 56% above torchtitan
CAVEAT = "an upper bound, not calibrated against a multi-GPU run"


@dataclass(frozen=True)
class CollectiveForecast:
    """One collective of the step: what it moves, over which link, alone and in the timeline.

    ``index``: its position in ``plan.schedule`` (-1: not a schedule op: a tensor-parallel activation, the
    gradient-norm all-reduce). ``alone_s``: latency + transfer with the link to itself; ``start_s``/
    ``end_s``: in the predicted timeline (later when its stream or link was busy).
    """

    index: int
    kind: str
    what: str
    unit: str
    axes: tuple[str, ...]
    stream: str
    link: str
    group: int
    algorithm: str
    busbw: float
    payload: int
    sent: int
    latency_s: float
    transfer_s: float
    issued_s: float
    start_s: float
    end_s: float

    @property
    def alone_s(self) -> float:
        return self.latency_s + self.transfer_s


@dataclass(frozen=True)
class Forecast:
    """Predicted step time of one rank of a plan (see :func:`shardplan.forecast.forecast`).

    ``step_s`` = ``compute_s`` (forward + backward + optimizer) + ``exposed_s`` (time the compute stream
    waits on collectives). ``tokens_per_s`` counts every rank's tokens (ranks of one tensor-parallel group
    share theirs); ``mfu`` is model FLOPs (``flops_per_step``, per rank) over step time and the peak rate.
    """

    network: Network
    compute: ComputeModel
    batch: tuple[int, int]
    rank: int
    mesh: Mesh
    strategy: str
    prefetch: int
    fingerprint: str
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    exposed_s: float
    tokens_per_step: int
    flops_per_step: float
    collectives: tuple[CollectiveForecast, ...]
    spans: tuple[Span, ...]
    placements: tuple[Placement, ...]
    bytes: tuple[tuple[str, Optional[int]], ...]
    notes: tuple[str, ...] = ()
    # how forward + backward split (None: measured unit times): matmuls at the FLOP rate, the model's
    # memory-bound ops (``memory_bytes`` of them, ``traffic``: "traced" op by op or "estimated" from the
    # units' widths) and the runtime's own copies and casts, both at the memory bandwidth
    matmul_s: Optional[float] = None
    memory_s: Optional[float] = None
    copies_s: Optional[float] = None
    memory_bytes: Optional[float] = None
    traffic: str = "measured"

    # -- figures ------------------------------------------------------------------------------------
    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else float("inf")

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.mesh.size

    @property
    def mfu(self) -> Optional[float]:
        peak = self.compute.peak_tflops
        if not peak or self.step_s <= 0 or not self.flops_per_step:
            return None
        return self.flops_per_step / self.step_s / (peak * 1e12)

    def comm_bytes(self) -> dict[str, Optional[int]]:
        """Bytes this rank sends per step, by kind: equal to ``plan.comm_bytes()``."""
        return dict(self.bytes)

    def comm_s(self) -> dict[str, float]:
        """Seconds of each kind of schedule collective, each alone on its link (not the exposed part)."""
        out = {k: 0.0 for k in KIND_ORDER}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.alone_s
        return out

    def exposed_by_kind(self) -> dict[str, float]:
        """Exposed seconds, each stall charged to the kind of the collective that ended last in it."""
        by_id = {i: c for i, c in enumerate(self.collectives)}
        out = {k: 0.0 for k in KIND_ORDER}
        for s in self.spans:
            if s.kind != "stall" or not s.waits_for:
                continue
            last = max((by_id[i] for i in s.waits_for), key=lambda c: c.end_s)
            tag = {"activations": "tensor parallel", "kv": "context parallel", "tokens": "expert parallel"}.get(last.what)
            key = f"{last.kind} ({tag})" if tag else last.kind
            out[key] = out.get(key, 0.0) + (s.end_s - s.start_s)
        return out

    # -- views ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s, "compute_s": self.compute_s, "forward_s": self.forward_s,
            "backward_s": self.backward_s, "optimizer_s": self.optimizer_s, "exposed_s": self.exposed_s,
            "matmul_s": self.matmul_s, "memory_bound_s": self.memory_s, "copies_s": self.copies_s,
            "memory_bound_bytes": self.memory_bytes, "memory_traffic": self.traffic,
            "exposed_by_kind_s": self.exposed_by_kind(), "comm_alone_s": self.comm_s(),
            "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "flops_per_step": self.flops_per_step, "mfu": self.mfu,
            "comm_bytes_per_step": self.comm_bytes(), "batch": list(self.batch), "rank": self.rank,
            "mesh": self.mesh.to_dict(), "strategy": str(self.strategy), "prefetch": self.prefetch,
            "plan_fingerprint": self.fingerprint, "network": self.network.to_dict(), "compute": self.compute.to_dict(),
            "placements": [{"axes": list(p.axes), "size": p.size, "nodes": p.nodes, "per_node": p.per_node,
                            "link": p.link} for p in self.placements],
            "collectives": [{"index": c.index, "kind": c.kind, "what": c.what, "unit": c.unit, "axes": list(c.axes),
                             "stream": c.stream, "link": c.link, "group": c.group, "algorithm": c.algorithm,
                             "busbw_gbs": c.busbw, "payload": c.payload, "sent": c.sent, "latency_s": c.latency_s,
                             "transfer_s": c.transfer_s, "issued_s": c.issued_s, "start_s": c.start_s,
                             "end_s": c.end_s} for c in self.collectives],
            "notes": list(self.notes),
        }

    def to_json(self, indent: Optional[int] = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_chrome_trace(self, path: str) -> None:
        """The predicted timeline for ui.perfetto.dev: compute (and its stalls) on one track, each collective
        stream on its own, as in ``plan.to_chrome_trace`` and a real run's profile."""
        tracks = {"compute": 1, "all_gather (gather stream)": 2, "reductions (reduce stream)": 3,
                  "used-parameter exchange": 4}
        tid = {"gather": 2, "reduce": 3, "used": 4, "compute": 1}
        us = 1e6
        events = []
        for s in self.spans:
            events.append({"name": s.name, "cat": "stall" if s.kind == "stall" else s.phase, "ph": "X", "pid": 0,
                           "tid": 1, "ts": s.start_s * us, "dur": (s.end_s - s.start_s) * us,
                           "args": {"unit": s.unit, "kind": s.kind}})
        for i, c in enumerate(self.collectives):
            if c.stream == "compute":
                continue  # blocking: already a stall slice on the compute track
            events.append({"name": f"{c.kind} {c.what} {c.unit}".strip(), "cat": c.kind, "ph": "X", "pid": 0,
                           "tid": tid[c.stream], "ts": c.start_s * us, "dur": (c.end_s - c.start_s) * us,
                           "args": {"index": c.index, "axes": list(c.axes), "link": c.link, "group": c.group,
                                    "algorithm": c.algorithm, "payload": c.payload, "sent": c.sent,
                                    "alone_us": c.alone_s * us, "issued_us": c.issued_s * us}})
        write_trace(path, tracks, events)

    def __str__(self) -> str:
        return render(self)


def _ms(s: float) -> str:
    return f"{s * 1e3:,.2f} ms"


def render(f: Forecast) -> str:
    """The human table: what was assumed, where each axis runs, the step and its parts."""
    net, cm = f.network, f.compute
    rate = (f"{cm.tflops:g} TFLOP/s achievable" if cm.tflops else "no FLOP rate") + \
        (f" (peak {cm.peak_tflops:g})" if cm.peak_tflops else "") + \
        (f", measured units at batch {cm.batch[0]}x{cm.batch[1]}" if cm.units and cm.batch else
         ", measured units" if cm.units else "")
    out = [f"forecast: {f.strategy} on {f.mesh!r}, prefetch {f.prefetch}, batch {f.batch[0]}x{f.batch[1]} per rank, "
           f"rank {f.rank}; plan {f.fingerprint}",
           f"network {net.name}: {net.gpus_per_node} GPUs per node"
           + (f", {f.mesh.size // net.gpus_per_node} nodes" if f.mesh.size > net.gpus_per_node else ", one node")
           + f", all_reduce algorithm {net.algorithm}" + ("" if net.overlap else ", collectives do not overlap compute"),
           f"compute {cm.name}: {rate}, backward {cm.backward_factor:g}x forward", "",
           "axes:"]
    for p in f.placements:
        if p.link == "local":
            desc = "1 rank: no communication"
        elif p.link == "intra":
            desc = f"{p.size} ranks in one node: {net.intra.name}"
        else:
            desc = (f"{p.size} ranks over {p.nodes} nodes, {p.per_node} per node: {net.inter.name} "
                    f"x{min(p.per_node, net.nics)} NICs")
        out.append(f"  {','.join(p.axes) or '-':<16} {desc}")
    out.append("")
    exposed = {k: v for k, v in f.exposed_by_kind().items() if v > 0}
    alone = f.comm_s()
    rows = [("step", _ms(f.step_s), f"{f.tokens_per_s:,.0f} tokens/s, {f.tokens_per_s_per_gpu:,.0f} per GPU"
             + (f", MFU {100 * f.mfu:.1f}% ({CAVEAT})" if f.mfu is not None else f" ({CAVEAT})")),
            ("  compute", _ms(f.compute_s), f"forward {_ms(f.forward_s)}, backward {_ms(f.backward_s)}, "
                                            f"optimizer {_ms(f.optimizer_s)}"),
            *([("    of which", "", f"matmuls {_ms(f.matmul_s)} at {cm.tflops:g} TFLOP/s, memory-bound "
                                  f"{_ms(f.memory_s)} ({fmt_bytes(int(f.memory_bytes or 0))} {f.traffic}"
                                  + (f" at {cm.elementwise_gbs or cm.memory_gbs:,.0f} GB/s"
                                     if (cm.elementwise_gbs or cm.memory_gbs) else "") + ")"
                                  + (f", runtime copies {_ms(f.copies_s)}" if f.copies_s else ""))]
              if f.matmul_s is not None else []),
            ("  exposed comm", _ms(f.exposed_s), ", ".join(f"{k} {_ms(v)}" for k, v in exposed.items()) or "none"),
            ("communication", _ms(sum(alone.values())), "each alone on its link: "
             + ", ".join(f"{k} {_ms(v)}" for k, v in alone.items() if v)),
            ("bytes sent", fmt_bytes(dict(f.bytes).get("total") or 0), ", ".join(
                f"{k} {fmt_bytes(v)}" for k, v in f.bytes if k != "total" and v)),
            ]
    w = max(len(r[0]) for r in rows)
    out += [f"{a:<{w}}  {b:>12}   {c}" for a, b, c in rows]
    if f.notes:
        out.append("")
        out += [f"note: {n}" for n in f.notes]
    return "\n".join(out)
