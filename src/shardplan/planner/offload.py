"""CPU offload as planned data: which buffers live (partly) in host memory, and what that costs.

``plan(offload="optimizer")``: each offloaded buffer keeps, in host memory, a master copy of this rank's
shard, a copy of its reduced gradient shard and the optimizer state; the optimizer step of those buffers
runs on the host. ``offload="params"`` (ZeRO-3 only) also keeps the parameter shard itself on the host:
the device holds it only from the ``copy_h2d`` before each of the unit's all-gathers to the gather's wait.

[Note: the fraction rule] ``offload_fraction=f`` offloads a prefix of the trainable buffers in gradient
order (the order their reduce-scatters complete in backward: the last unit of the forward first, the root
last), taken while the offloaded shard bytes stay within ``f`` of the total (at least one buffer). The
buffers whose gradients are ready first are offloaded first: their host copies have the most backward
left to overlap with. A prefix of one fixed order, so a larger fraction offloads a superset.

[Note: the automatic fraction] ``offload_fraction="auto"`` with ``device_memory=B`` (bytes per device)
takes the smallest fraction whose plan fits: ``plan.memory(rank).peak <= B`` on every rank (64 spread over
the mesh beyond 64 ranks; activations
included when the plan is traced). The candidates are the fractions at which the rule above takes one
more buffer (:func:`prefix_fractions`); the device peak does not grow as more is offloaded, so a binary
search over them finds it with a few memory walks. It is a pass over the assembled plan (everything
offloaded): a candidate only re-marks the buffers (:func:`offloaded`) and rebuilds the schedule from them,
nothing before it (``compiler._fit_device``). The plan records the number chosen, so its JSON and
``to_source()`` rebuild the same plan without the budget.

[Note: the balanced fraction] Offloading more saves device memory but the host step grows with the bytes
it steps, and only what overlaps backward is free. :func:`balanced_fraction` takes a measured host step
(seconds per training step at a known fraction; it is linear in the bytes stepped, ~28 bytes of host memory
traffic per fp32 element for AdamW) and the window it can hide in (the backward), and returns the largest
candidate fraction whose host step fits the window, so that the host and the device finish together; never
less than the smallest fraction that fits the device (memory first: the excess is then exposed), never less
than one buffer. ``Plan.balanced_offload_fraction`` applies it to a plan.

>>> choose_offloaded(buffers, units, level=3, offload="optimizer", fraction=0.5)   # {buffer index: "optimizer"}
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

from ..errors import PlanError
from .kinds import Offload, choose
from .values import BufferPlan, UnitPlan


AUTO = "auto"


def check(offload, fraction, level: Optional[int] = None, device_memory=None):
    """``(offload, fraction)`` validated (``fraction`` a number, or ``"auto"``); a :class:`PlanError` naming
    the fix otherwise. ``level``: the strategy's (``None``: not known yet, ``offload="params"`` not checked).

    >>> check("optimizer", 1.0, 3)
    ('optimizer', 1.0)
    """
    if fraction == AUTO:
        if offload is None or offload == "" or offload is False:
            raise PlanError("offload_fraction='auto' chooses how much to offload: it needs offload='optimizer' "
                            "or offload='params'")
        if isinstance(device_memory, bool) or not isinstance(device_memory, (int, float)) or not device_memory > 0:
            raise PlanError(f"offload_fraction='auto' takes the smallest fraction whose plan fits the device: pass "
                            f"device_memory=<bytes per device>, e.g. device_memory=80 * 2**30; got {device_memory!r}")
        return check(offload, 1.0, level)[0], AUTO
    if device_memory is not None:
        raise PlanError("device_memory= is the budget offload_fraction='auto' fits: pass offload_fraction='auto' "
                        "too, or leave device_memory out")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (0 < fraction <= 1) \
            or math.isnan(fraction):
        raise PlanError(f"offload_fraction must be a number with 0 < f <= 1 (the share of the optimizer state "
                        f"moved to host memory); got {fraction!r}")
    if offload is None or offload == "" or offload is False:
        if fraction != 1:
            raise PlanError(f"offload_fraction={fraction!r} needs offload='optimizer' or offload='params'")
        return None, 1.0
    mode = choose(Offload, offload, "offload")
    if mode == Offload.PARAMS and level is not None and level != 3:
        raise PlanError("offload='params' keeps parameter shards in host memory and copies them in before each "
                        "all-gather, so it needs strategy='optim_grads_params' (ZeRO-3); use offload='optimizer' "
                        "with this strategy")
    return mode, float(fraction)


def shard_bytes(b: BufferPlan) -> int:
    return b.shard_numel * b.itemsize


def gradient_order(units: Sequence[UnitPlan]) -> list[str]:
    """Units in the order their gradients are reduced in backward: reverse forward order, the root last."""
    return [u.name for u in reversed(units[1:])] + [units[0].name]


def choose_offloaded(buffers: Sequence[BufferPlan], units: Sequence[UnitPlan], *, level: int, offload: Offload,
                     fraction: float) -> dict[int, str]:
    """``{buffer index: "optimizer" | "params"}`` for the buffers to offload (see the fraction rule above).

    Candidates are the trainable buffers (frozen ones have no optimizer state). Under ``"params"`` a
    candidate whose full parameters are made from its shard by a gather (sharded, not aliased) keeps its
    shard on the host; one used in place (replicated, no cast) offloads its optimizer only.
    """
    by_unit = {u.name: u for u in units}
    cands = [buffers[i] for name in gradient_order(units) for i in by_unit[name].buffers if buffers[i].requires_grad]
    total = sum(shard_bytes(b) for b in cands)
    out: dict[int, str] = {}
    taken = 0
    for b in cands:
        size = shard_bytes(b)
        if out and taken + size > fraction * total * (1 + 1e-12):
            break
        taken += size
        params = offload == Offload.PARAMS and level == 3 and b.sharded and not b.alias
        out[b.index] = Offload.PARAMS.value if params else Offload.OPTIMIZER.value
    return out


def offloaded(buffers: Sequence[BufferPlan], units: Sequence[UnitPlan], *, level: int, offload: Optional[Offload],
              fraction: float) -> tuple[BufferPlan, ...]:
    """``buffers`` with ``BufferPlan.offload`` marking those :func:`choose_offloaded` takes at ``fraction``
    (the others cleared); ``buffers`` as they are without ``offload``."""
    if offload is None:
        return tuple(buffers)
    hosted = choose_offloaded(list(buffers), list(units), level=level, offload=offload, fraction=fraction)
    return tuple(dataclasses.replace(b, offload=hosted.get(b.index, "")) for b in buffers)


def prefix_fractions(buffers: Sequence[BufferPlan], units: Sequence[UnitPlan]) -> list[float]:
    """The fractions at which the fraction rule takes one more buffer, ascending (the last is 1.0)."""
    by_unit = {u.name: u for u in units}
    sizes = [shard_bytes(buffers[i]) for name in gradient_order(units) for i in by_unit[name].buffers
             if buffers[i].requires_grad]
    total = sum(sizes)
    if not sizes or total == 0:
        return [1.0]
    out, taken = [], 0
    for size in sizes:
        taken += size
        f = min(taken / total, 1.0)
        if not out or f > out[-1]:
            out.append(f)
    out[-1] = 1.0
    return out


def smallest_fitting(fractions: Sequence[float], peak: Callable[[float], tuple[int, int]], budget: float) -> float:
    """The smallest of ``fractions`` (ascending) whose plan's device peak fits ``budget`` (see the note);
    ``peak(f)``: ``(largest device peak over the ranks, its rank)``."""
    worst, rank = peak(fractions[-1])
    if worst > budget:
        raise PlanError(f"offload_fraction='auto': even offloading every buffer the device peak on rank {rank} is "
                        f"{worst:,d} B, over device_memory={int(budget):,d} B; offload the parameters too "
                        f"(offload='params', ZeRO-3), use more ranks, or checkpoint activations")
    lo, hi = 0, len(fractions) - 1  # fractions[hi] fits
    while lo < hi:
        mid = (lo + hi) // 2
        if peak(fractions[mid])[0] <= budget:
            hi = mid
        else:
            lo = mid + 1
    return fractions[hi]


def offloaded_share(buffers: Sequence[BufferPlan]) -> float:
    """The share of the trainable shard bytes that a plan's buffers offload (what its host step steps)."""
    total = sum(shard_bytes(b) for b in buffers if b.requires_grad)
    return sum(shard_bytes(b) for b in buffers if b.requires_grad and b.offload) / total if total else 0.0


def balanced_fraction(buffers: Sequence[BufferPlan], units: Sequence[UnitPlan], host_s: float, window_s: float,
                      at_least: float = 0.0) -> float:
    """The fraction whose host step just fits the window it can hide in ([Note: the balanced fraction]).

    ``buffers``: those of the plan the host step was measured with; ``host_s``: the seconds it took per
    training step (``opt.host_stats()["kernel_s"]`` per step); ``window_s``: the seconds it can overlap (the
    backward); ``at_least``: the smallest fraction that fits the device (``offload_fraction="auto"``'s choice).
    """
    offloaded = offloaded_share(buffers)
    if not (offloaded > 0 and host_s > 0 and window_s >= 0):
        raise PlanError(f"balanced offload fraction: needs a measured host step (host_s={host_s!r} > 0 with "
                        f"offloaded={offloaded!r} > 0 of the state on the host) and window_s={window_s!r} >= 0")
    rate = host_s / offloaded  # seconds per unit of fraction: the host step is linear in the bytes it steps
    fractions = prefix_fractions(buffers, units)
    hidden = [f for f in fractions if f * rate <= window_s * (1 + 1e-9)]
    best = hidden[-1] if hidden else fractions[0]
    if best < at_least:  # memory needs more on the host than the window hides: fit first
        best = next(f for f in fractions if f >= at_least * (1 - 1e-12))
    return best


HOST_GBPS = 100.0  # host memory bandwidth assumed by estimates (benchmarks/host_adamw.py measures a host's)


def host_step_bytes(buffers: Sequence[BufferPlan], optimizer_states: int) -> int:
    """Host memory traffic of one host step over the offloaded buffers: AdamW reads the master, the gradient
    and the states and writes the master and the states (28 bytes per fp32 element).

    [Note: the host step's bound] The fused CPU AdamW is bound by the host's memory bandwidth, so the host
    step takes about ``host_step_bytes / bandwidth``; it overlaps backward and the next forward
    (runtime/offload/, [Note: the host step overlaps the next forward]) but cannot shrink: a training step
    takes at least ``max(device step, host step)``."""
    return sum(shard_bytes(b) * (3 + 2 * optimizer_states) for b in buffers if b.offload and b.requires_grad)


STEP_BYTES = 4  # AdamW's step count per trainable parameter: a 0-dim float32 host tensor (torch's "step")


def host_bytes(b: BufferPlan, optimizer_states: int, trainable_params: int = 0) -> int:
    """Host bytes of one offloaded buffer: the master shard, the gradient shard and ``optimizer_states``
    state tensors, each a flat shard in the parameters' dtype, and the step count of each of its
    ``trainable_params`` (``0`` for a buffer not offloaded)."""
    if not b.offload:
        return 0
    per = shard_bytes(b)
    return per * (1 + (1 + optimizer_states if b.requires_grad else 0)) + STEP_BYTES * trainable_params


def slab_layout(need: dict, pinned: bool) -> tuple:
    """``((slab bytes, ((key, offset), ...)), ...)``: where the runtime puts the offloaded buffers' host
    tensors (``need``: key -> bytes, one dtype; the runtime's keys are ``(buffer index, k)``, one per tensor:
    master, gradient, moments), one allocation per slab.

    [Note: slabs] torch's pinned (CUDA host) allocator rounds every block up to a power of two and keeps it:
    per host tensor that wastes up to half of it (an 8B model's 2 GB embedding shards would take 4 GiB each,
    four times over), and one slab for everything wastes as much at once (71.5 GiB of state would pin 128
    GiB). So pinned slabs are powers of two themselves: buffers, largest first, go into the first slab with
    room, and a new slab is the largest power of two the unplaced bytes fill (at least the tensor's own size
    rounded up); where one slab of the total rounded up pins no more, that one slab is used. Each tensor is
    placed on its own (a buffer's four need not share a slab): finer pieces pack tighter (the 8B at fraction
    0.6: 73 GiB pinned for 71.5 GiB of state, against 76 GiB placing each buffer's four together). Unpinned
    (a CPU-only run): one exact slab.

    >>> slab_layout({0: 3 << 20, 1: 1 << 20}, pinned=True)    # 4 MiB in one slab of 4 MiB
    ((4194304, ((0, 0), (1, 3145728))),)
    """
    need = {i: n for i, n in need.items() if n}
    if not need:
        return ()
    total, offsets, at = sum(need.values()), [], 0
    for i, n in need.items():
        offsets.append((i, at))
        at += n
    one = ((total if not pinned else 1 << max(0, (total - 1).bit_length()), tuple(offsets)),)
    if not pinned:
        return one
    left, slabs = total, []  # [size, used, placed]
    for index, n in sorted(need.items(), key=lambda kv: -kv[1]):
        room = next((sl for sl in slabs if sl[0] - sl[1] >= n), None)
        if room is None:
            room = [max(1 << (left.bit_length() - 1), 1 << max(0, (n - 1).bit_length())), 0, []]
            slabs.append(room)
        room[2].append((index, room[1]))
        room[1] += n
        left -= n
    packed = tuple((size, tuple(placed)) for size, _, placed in slabs)
    return one if one[0][0] <= sum(size for size, _ in packed) else packed


def pinned_host_bytes(buffers: Sequence[BufferPlan], optimizer_states: int, trainable: dict) -> int:
    """Host bytes a CUDA run allocates for the offloaded buffers: the pinned slabs of :func:`slab_layout`
    per dtype (each buffer's ``2 + optimizer_states`` shard tensors) and the step counts (pageable);
    ``trainable``: buffer index -> its trainable parameters."""
    by_dtype: dict = {}
    for b in buffers:
        if b.offload and b.shard_numel:
            for k in range(host_bytes(b, optimizer_states) // shard_bytes(b)):
                by_dtype.setdefault(b.dtype, {})[b.index, k] = shard_bytes(b)
    slabs = sum(size for need in by_dtype.values() for size, _ in slab_layout(need, pinned=True))
    return slabs + sum(STEP_BYTES * trainable.get(b.index, 0) for b in buffers if b.offload)
