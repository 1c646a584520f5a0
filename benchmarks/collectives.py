"""Measure α and β of all_gather / reduce_scatter / all_reduce on this machine and write a network preset
that ``plan.forecast(network=FILE)`` and ``shardplan forecast --network FILE`` accept.

    torchrun --nproc-per-node 2 benchmarks/collectives.py --out net_cpu_w2.json            # CPU, gloo
    torchrun --nproc-per-node 8 benchmarks/collectives.py --out net_8gpu.json              # one node, NCCL
    torchrun --nnodes 2 --nproc-per-node 8 ... benchmarks/collectives.py --out net.json     # also the network

Each kind runs over a range of payload sizes (the gathered output, the reduce-scatter's input, the
all-reduce's tensor, as the plan counts them), through shardplan's own wrappers
(shardplan.runtime.collectives); a size's time is the median over iterations of the slowest rank. A fit of
``t = a + b * payload`` (least squares on relative error) gives, with ``n`` ranks, ``busbw = f / b`` where
``f = (n-1)/n`` (twice that for all_reduce) and ``alpha_us = a / steps`` where a ring takes ``n-1`` steps
(``2(n-1)``): the numbers the forecast's α–β model uses (shardplan/forecast/network.py). Over several nodes
the in-node link is measured on each node's ranks and the network from the whole world, inverted through
the same model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
from shardplan.forecast.network import KINDS, Network  # noqa: E402
from shardplan.runtime import collectives as C  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the preset file to write (JSON)")
    ap.add_argument("--name", default=None, help="the network's name (default: measured-<backend>-<world>)")
    ap.add_argument("--min-bytes", type=int, default=None, help="smallest payload (default 16 KiB CPU, 64 KiB GPU)")
    ap.add_argument("--max-bytes", type=int, default=None, help="largest payload (default 16 MiB CPU, 1 GiB GPU)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per size (default 20 CPU, 10 GPU)")
    ap.add_argument("--warmup", type=int, default=3)
    return ap.parse_args(argv)


def sizes(lo: int, hi: int, n: int) -> list[int]:
    """Payload sizes from ``lo`` to ``hi``, 4x apart, each a multiple of 4 bytes x ``n`` (splits evenly)."""
    out, s = [], lo
    q = 4 * n
    while s <= hi:
        out.append(max(q, s // q * q))
        s *= 4
    return out


def time_one(kind: str, payload: int, group: C.Group, dev, iters: int, warmup: int, world_group: C.Group) -> float:
    """Median over iterations of the slowest rank's time for one ``kind`` of ``payload`` bytes over ``group``."""
    n = group.size
    numel = payload // 4
    full = torch.ones(numel, dtype=torch.float32, device=dev)
    part = torch.ones(numel // n, dtype=torch.float32, device=dev)
    cuda = dev.type == "cuda"

    def once():
        if kind == "all_gather":
            C.all_gather(full, part, group, async_op=False).wait()
        elif kind == "reduce_scatter":
            C.reduce_scatter(part, full, group, async_op=False).wait()
        else:
            C.all_reduce(full, group, async_op=False).wait()
        if cuda:
            torch.cuda.synchronize()

    for _ in range(warmup):
        once()
    times = []
    for _ in range(iters):
        C.barrier(world_group)
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    mine = torch.tensor([statistics.median(times)], dtype=torch.float64, device=dev)
    C.all_reduce(mine, world_group, async_op=False, op=dist.ReduceOp.MAX).wait()
    return float(mine.item())


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``t = a + b p`` minimising the squared *relative* error (small sizes fix a, large ones b); a, b >= 0."""
    w = [1.0 / (t * t) for _, t in points]
    sw = sum(w)
    sp_ = sum(wi * p for wi, (p, _) in zip(w, points))
    st = sum(wi * t for wi, (_, t) in zip(w, points))
    spp = sum(wi * p * p for wi, (p, _) in zip(w, points))
    spt = sum(wi * p * t for wi, (p, t) in zip(w, points))
    det = sw * spp - sp_ * sp_
    b = (sw * spt - sp_ * st) / det
    a = (st - b * sp_) / sw
    if a < 0:  # the latency is below what the sizes resolve: through the origin instead
        a, b = 0.0, spt / spp
    return a, max(b, 1e-18)


def alpha_beta(kind: str, a: float, b: float, n: int) -> dict:
    factor = (2 if kind == "all_reduce" else 1) * (n - 1) / n
    steps = (2 if kind == "all_reduce" else 1) * (n - 1)
    return {"alpha_us": a / steps * 1e6, "busbw": factor / b / 1e9}


def measure(group: C.Group, dev, args, world_group: C.Group, lo: int, hi: int) -> tuple[dict, dict]:
    """({kind: {alpha_us, busbw}}, {kind: [[payload, seconds], ...]}) over ``group``."""
    link, raw = {}, {}
    for kind in KINDS:
        pts = [(p, time_one(kind, p, group, dev, args.iters, args.warmup, world_group)) for p in sizes(lo, hi, group.size)]
        raw[kind] = [[p, t] for p, t in pts]
        link[kind] = alpha_beta(kind, *fit(pts), group.size)
    return link, raw


def device_preset(dev) -> str | None:
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev).lower()
    for key in ("h200", "h100", "a100"):
        if key in name:
            return f"{key}-sxm-bf16"
    return None


def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run this under torchrun, e.g.: torchrun --nproc-per-node 2 benchmarks/collectives.py --out net.json")
    cuda = torch.cuda.is_available() and os.environ.get("SHARDPLAN_FORCE_CPU") != "1"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world < 2:
        raise SystemExit("measure with at least 2 ranks: torchrun --nproc-per-node 2 benchmarks/collectives.py --out ...")
    if world % local:
        raise SystemExit(f"the world ({world}) is not whole nodes of LOCAL_WORLD_SIZE={local}")
    iters = args.iters or (10 if cuda else 20)
    args.iters = iters
    lo = args.min_bytes or (64 * 1024 if cuda else 16 * 1024)
    hi = args.max_bytes or (2 ** 30 if cuda else 16 * 2 ** 20)
    world_group = C.world()
    nodes = world // local
    raw: dict = {}
    if nodes == 1:
        intra, raw["intra"] = measure(world_group, dev, args, world_group, lo, hi)
        inter = None
    else:
        # [Note: every rank creates every node's group, in the same order, as torch.distributed requires]
        mine = None
        for k in range(nodes):
            ranks = list(range(k * local, (k + 1) * local))
            pg = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                mine = C.Group(pg, local, ranks.index(rank))
        intra, raw["intra"] = (measure(mine, dev, args, world_group, lo, hi) if local > 1 else
                               ({k: {"alpha_us": 0.0, "busbw": 1e6} for k in KINDS}, {}))
        whole, raw["world"] = measure(world_group, dev, args, world_group, lo, hi)
        inter = {}
        for kind in KINDS:  # invert network.collective_time for a whole-node group: busbw = min(intra, k x inter)
            factor = 2 if kind == "all_reduce" else 1
            cross, steps = factor * (nodes - 1), factor * (world - 1)
            a_inter = (whole[kind]["alpha_us"] * steps - intra[kind]["alpha_us"] * (steps - cross)) / cross
            inter[kind] = {"alpha_us": max(a_inter, 0.0), "busbw": whole[kind]["busbw"] / local}
    net = Network.from_dict({
        "name": args.name or f"measured-{backend}-{world}", "gpus_per_node": local, "max_nodes": None if nodes > 1 else 1,
        "overlap": backend == "nccl", "device": device_preset(dev), "algorithm": "ring",
        "intra": {"name": f"{backend} in-node", **intra},
        "inter": None if inter is None else {"name": f"{backend} network", **inter},
        "source": f"benchmarks/collectives.py, {backend}, {world} ranks ({nodes} node(s) of {local}) on "
                  f"{platform.node()}, {datetime.date.today().isoformat()}"})
    if rank == 0:
        out = {"network": net.to_dict(), "measured": {"backend": backend, "world": world, "ranks_per_node": local,
                                                      "iters": iters, "seconds": raw,
                                                      "device": torch.cuda.get_device_name(dev) if cuda else platform.processor()}}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        for k in KINDS:
            c = net.intra.cost(k)
            print(f"{k:<15} intra alpha {c.alpha_us:8.2f} us/step  busbw {c.busbw:9.3f} GB/s"
                  + (f"   inter alpha {net.inter.cost(k).alpha_us:8.2f}  busbw {net.inter.cost(k).busbw:9.3f}"
                     if net.inter else ""))
        print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
