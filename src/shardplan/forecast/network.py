"""Networks as data: α–β costs per link class, named presets with their sources, where each collective's
group sits on the nodes, and the time of one collective.

>>> net = network("h100-8x-ib400")
>>> net.inter.all_gather.busbw, net.gpus_per_node          # GB/s per GPU over InfiniBand; GPUs per node
(47.0, 8)
>>> faster = net.with_link("inter", busbw=90.0)            # change one link, forecast again

The model (``collective_time``), per collective kind and link:

* ``busbw`` is the *bus bandwidth* nccl-tests reports: a ring all-gather or reduce-scatter of a ``P``-byte
  payload over ``n`` ranks sends ``P (n-1)/n`` bytes per rank and takes ``P (n-1)/n / busbw``; an all-reduce
  sends twice that. These are exactly the bytes :meth:`Plan.comm_bytes` counts.
* ``alpha_us`` is the latency of one algorithm step. A ring over ``n`` ranks on ``N`` nodes takes ``n-1``
  steps (``2(n-1)`` for all-reduce), ``N-1`` (``2(N-1)``) of them across nodes; a tree all-reduce takes
  ``2(k-1)`` steps inside nodes and ``2 ceil(log2 N)`` across (NCCL's own latency model, src/graph/tuning.cc).
* A group inside one node runs at the in-node link's ``busbw``. A group spanning nodes with ``k`` of its
  ranks on each node moves its cross-node traffic through ``min(k, nics_per_node)`` NICs per node
  (rail-optimised fabrics: one NIC per GPU), so it runs at ``min(intra, min(k, nics) * inter)``: an axis
  of one rank per node (HSDP's replica axis) gets one NIC's bandwidth, a whole-node axis all of them.

Ranks are placed on nodes as torchrun places them: rank ``r`` on node ``r // gpus_per_node``. Meshes are
row-major, so the *last* mesh axis varies fastest and stays inside a node.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from ..errors import ForecastError
from .sources import preset_or_file
from ..mesh import Mesh

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
ALGORITHMS = ("auto", "ring", "tree")


@dataclass(frozen=True)
class Cost:
    """α and β of one collective kind on one link: ``alpha_us`` per algorithm step (µs), ``busbw`` (GB/s,
    10^9 bytes per second, nccl-tests' bus bandwidth)."""

    alpha_us: float
    busbw: float

    def __post_init__(self):
        for name in ("alpha_us", "busbw"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ForecastError(f"link cost {name} must be a finite non-negative number; got {v!r}")
        if self.busbw == 0:
            raise ForecastError("link cost busbw must be positive (GB/s); got 0")


@dataclass(frozen=True)
class Link:
    """One link class (in-node NVLink, inter-node network): a :class:`Cost` per collective kind.

    >>> Link.uniform("nvlink", alpha_us=1.5, busbw=360.0).all_reduce.busbw
    360.0
    """

    name: str
    all_gather: Cost
    reduce_scatter: Cost
    all_reduce: Cost

    @classmethod
    def uniform(cls, name: str, *, alpha_us: float, busbw: float) -> "Link":
        c = Cost(alpha_us, busbw)
        return cls(name, c, c, c)

    def cost(self, kind: str) -> Cost:
        return getattr(self, kind)

    def with_cost(self, *, busbw: Optional[float] = None, alpha_us: Optional[float] = None,
                  kinds: tuple[str, ...] = KINDS) -> "Link":
        """This link with ``busbw`` and/or ``alpha_us`` replaced for ``kinds``."""
        changes = {}
        for k in kinds:
            if k not in KINDS:
                raise ForecastError(f"unknown collective kind {k!r}; kinds: {KINDS}")
            c = self.cost(k)
            changes[k] = Cost(c.alpha_us if alpha_us is None else alpha_us, c.busbw if busbw is None else busbw)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **{k: dataclasses.asdict(self.cost(k)) for k in KINDS}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "Link":
        """``{"name", "all_gather": {"alpha_us", "busbw"}, ...}``, or one ``alpha_us``/``busbw`` for every kind."""
        if not isinstance(d, Mapping):
            raise ForecastError(f"{where} must be a mapping with alpha_us and busbw (per kind or for all); got {d!r}")
        name = str(d.get("name", where))
        shared = {k: d[k] for k in ("alpha_us", "busbw") if k in d}
        costs = {}
        for k in KINDS:
            c = {**shared, **dict(d.get(k, {}))}
            missing = [f for f in ("alpha_us", "busbw") if f not in c]
            if missing:
                raise ForecastError(f"{where}.{k} has no {' and '.join(missing)}; give alpha_us (µs per step) and "
                                    f"busbw (GB/s) for it or for the whole link")
            costs[k] = Cost(float(c["alpha_us"]), float(c["busbw"]))
        return cls(name, **costs)


@dataclass(frozen=True)
class Network:
    """A cluster's links: ``intra`` inside a node, ``inter`` between nodes (``None``: one node only).

    ``algorithm`` picks the all-reduce algorithm (``"auto"``: the faster of ring and tree, as NCCL's tuner
    does; all-gather and reduce-scatter are rings). ``overlap=False`` says collectives use the same cores
    as compute (gloo on CPU), so nothing overlaps. ``device`` names the compute preset used when a forecast
    is given none. ``max_nodes`` bounds the nodes a measured network may be used for (``None``: any).
    """

    name: str
    gpus_per_node: int
    intra: Link
    inter: Optional[Link] = None
    nics_per_node: Optional[int] = None
    max_nodes: Optional[int] = None
    algorithm: str = "auto"
    overlap: bool = True
    device: Optional[str] = None
    source: str = ""

    def __post_init__(self):
        if not isinstance(self.gpus_per_node, int) or isinstance(self.gpus_per_node, bool) or self.gpus_per_node < 1:
            raise ForecastError(f"network {self.name!r}: gpus_per_node must be a positive integer; got {self.gpus_per_node!r}")
        if self.algorithm not in ALGORITHMS:
            raise ForecastError(f"network {self.name!r}: algorithm must be one of {ALGORITHMS}; got {self.algorithm!r}")
        if self.nics_per_node is not None and self.nics_per_node < 1:
            raise ForecastError(f"network {self.name!r}: nics_per_node must be positive; got {self.nics_per_node!r}")

    @property
    def nics(self) -> int:
        return self.nics_per_node or self.gpus_per_node

    def link(self, which: str) -> Link:
        if which not in ("intra", "inter"):
            raise ForecastError(f"a network's links are 'intra' (in a node) and 'inter' (between nodes); got {which!r}")
        got = getattr(self, which)
        if got is None:
            raise ForecastError(f"network {self.name!r} has no inter-node link; give one, e.g. "
                                f"net.with_link('inter', alpha_us=6, busbw=45)")
        return got

    def with_link(self, which: str, *, busbw: Optional[float] = None, alpha_us: Optional[float] = None,
                  kinds: tuple[str, ...] = KINDS) -> "Network":
        """The same network with one link's bandwidth and/or latency changed (for ``kinds``).

        >>> network("h100-8x-ib400").with_link("inter", busbw=90.0).inter.all_gather.busbw
        90.0
        """
        if which == "inter" and self.inter is None:
            if busbw is None or alpha_us is None:
                raise ForecastError(f"network {self.name!r} has no inter-node link to change; give both busbw and "
                                    f"alpha_us to add one")
            new = Link.uniform("inter", alpha_us=alpha_us, busbw=busbw)
        else:
            new = self.link(which).with_cost(busbw=busbw, alpha_us=alpha_us, kinds=kinds)
        return dataclasses.replace(self, **{which: new}, source=_changed(self.source, [which]))

    def scaled(self, bandwidth: float = 1.0) -> "Network":
        """Every link's bandwidth times ``bandwidth`` (a what-if)."""
        def scale(link: Optional[Link]) -> Optional[Link]:
            if link is None:
                return None
            return dataclasses.replace(link, **{k: Cost(link.cost(k).alpha_us, link.cost(k).busbw * bandwidth) for k in KINDS})
        return dataclasses.replace(self, intra=scale(self.intra), inter=scale(self.inter),
                                   source=_changed(self.source, [f"bandwidths x{bandwidth}"]) if bandwidth != 1.0 else self.source)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "gpus_per_node": self.gpus_per_node, "nics_per_node": self.nics_per_node,
                "max_nodes": self.max_nodes, "algorithm": self.algorithm, "overlap": self.overlap,
                "device": self.device, "source": self.source, "intra": self.intra.to_dict(),
                "inter": None if self.inter is None else self.inter.to_dict()}

    def to_json(self, indent: Optional[int] = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Network":
        """A network from its dict; ``{"base": "h100-8x-ib400", ...}`` starts from a preset and overrides it."""
        d = dict(d)
        if "base" in d:
            name = d.pop("base")
            base = network(name).to_dict()
            changed = sorted(k for k in d if k not in ("name", "source"))
            if changed and "source" not in d:  # the base's sources do not vouch for the changed figures
                d["source"] = _changed(base["source"], changed)
            for k in ("intra", "inter"):  # links merge: override one kind or one field
                if k in d and isinstance(d[k], Mapping) and base.get(k):
                    d[k] = _merge_link(base[k], d[k])
            d = {**base, **d}
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ForecastError(f"network has unknown field(s) {sorted(unknown)}; fields: "
                                f"{[f.name for f in dataclasses.fields(cls)]}")
        for need in ("gpus_per_node", "intra"):
            if need not in d:
                raise ForecastError(f"network {d.get('name', '?')!r} has no {need!r}; a network needs gpus_per_node "
                                    f"and an intra link (see docs/forecast.md)")
        d["intra"] = Link.from_dict(d["intra"], "intra")
        d["inter"] = None if d.get("inter") is None else Link.from_dict(d["inter"], "inter")
        d.setdefault("name", "custom")
        return cls(**d)


def _changed(source: str, what) -> str:
    """A network's ``source`` once ``what`` was changed by hand: the cited figures no longer vouch for those."""
    return f"{source} [changed by hand, not from these sources: {', '.join(what)}]"


def _merge_link(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in base.items()}
    for k, v in over.items():
        if k in KINDS:
            out[k] = {**out.get(k, {}), **v}
        elif k in ("alpha_us", "busbw"):
            for kind in KINDS:
                out[kind] = {**out[kind], k: v}
        else:
            out[k] = v
    return out


# -- presets -----------------------------------------------------------------------------------------
# [Note: sources, published nccl-tests bus bandwidths at large sizes (the figures the presets take):
# * NVLink 4 (H100 and H200 SXM, NVSwitch; 450 GB/s line rate per direction): NCCL's maintainer, "360 GB/s
#   is exactly what we'd expect on H100" for all_gather_perf and all_reduce_perf on 8 H100s
#   (https://github.com/NVIDIA/nccl-tests/issues/326), and "with the protocol overhead (~20%) NCCL can get an
#   effective NVLink bandwidth of 370GB/s, which you can observe as BusBw when running non-allreduce
#   operations, or when running with NCCL_ALGO=RING" (https://github.com/NVIDIA/nccl-tests/issues/212): 360
#   taken for all three kinds (rings). NCCL's default in-node all_reduce on NVSwitch is NVLink SHARP (NVLS),
#   peak busbw ~480 GB/s on 8 H100s (same issue 212) and 475 GB/s measured on 8 H200s
#   (https://github.com/NVIDIA/nccl-tests/issues/272): not modelled (an in-node all_reduce is timed as a
#   ring, up to 1.3x slow); shardplan's all-reduces are HSDP's, across nodes.
# * 400 Gb/s NDR InfiniBand, one ConnectX-7 NIC per GPU: "For NDR @ 400Gbps you should see 46-48GB/s per
#   NIC" (NVIDIA, https://github.com/NVIDIA/nccl-tests/issues/290): 47 taken.
# * NVLink 3 (A100): about 230 GB/s on 8 GPUs; 200 Gb/s HDR (DGX A100): about 185 GB/s all_reduce busbw over
#   a node's 8 NICs, i.e. 23 GB/s per NIC.
# Latencies per algorithm step are NCCL's order of magnitude (its tuning tables: about 1-2 µs per NVLink
# hop, 5-8 µs per network hop); they matter only for small collectives.]
_NVLINK4 = Link.uniform("nvlink4", alpha_us=1.5, busbw=360.0)
_NVLINK3 = Link("nvlink3", Cost(2.0, 230.0), Cost(2.0, 230.0), Cost(2.0, 230.0))
_IB400 = Link.uniform("ib-ndr400", alpha_us=6.0, busbw=47.0)
_IB200 = Link.uniform("ib-hdr200", alpha_us=7.0, busbw=23.0)
_NCCL_TESTS = ("busbw from published nccl-tests: NVLink 360 GB/s (NVIDIA/nccl-tests#326, #212; rings, NVLS not "
               "modelled), NDR IB 47 GB/s per NIC (NVIDIA/nccl-tests#290: 46-48)")

PRESETS: dict[str, Network] = {
    "h100-8x-ib400": Network("h100-8x-ib400", 8, _NVLINK4, _IB400, device="h100-sxm-bf16",
                             source="8x H100 SXM per node (NVLink 4 / NVSwitch), 400 Gb/s InfiniBand per GPU; " + _NCCL_TESTS),
    "h200-8x-ib400": Network("h200-8x-ib400", 8, _NVLINK4, _IB400, device="h200-sxm-bf16",
                             source="8x H200 SXM per node (NVLink 4 / NVSwitch, as H100), 400 Gb/s InfiniBand per "
                                    "GPU; " + _NCCL_TESTS),
    "a100-8x-ib200": Network("a100-8x-ib200", 8, _NVLINK3, _IB200, device="a100-sxm-bf16",
                             source="8x A100 SXM per node (NVLink 3), 200 Gb/s HDR InfiniBand per GPU; busbw from "
                                    "published nccl-tests (NVLink ~230 GB/s, ~185 GB/s all_reduce over 8 NICs)"),
}


def network(spec: Union[str, Mapping[str, Any], Network, "os.PathLike[str]"]) -> Network:
    """A :class:`Network` from a preset name, a dict, a JSON file (``benchmarks/collectives.py --out``) or itself.

    >>> network("a100-8x-ib200").intra.name
    'nvlink3'
    """
    if isinstance(spec, Network):
        return spec
    if isinstance(spec, Mapping):
        return Network.from_dict(spec)
    if isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        found = preset_or_file(text, PRESETS, 'network', 'network', '; write one with benchmarks/collectives.py --out FILE')
        if found is not None:
            return found if isinstance(found, Network) else Network.from_dict(found)
        raise ForecastError(f"unknown network {text!r}: use a preset ({', '.join(PRESETS)}), a JSON file "
                            f"(benchmarks/collectives.py --out FILE writes one) or a dict")
    raise ForecastError(f"network must be a preset name, a dict, a JSON file path or a Network; got {type(spec).__name__}")


# -- where groups sit, and what a collective costs ------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """Where one rank's group over ``axes`` sits: its ``size``, over how many ``nodes``, the fewest of its
    ranks on one node (``per_node``), and the link that bounds it (``"local"``, ``"intra"``, ``"inter"``)."""

    axes: tuple[str, ...]
    size: int
    nodes: int
    per_node: int
    link: str


def check_fits(net: Network, mesh: Mesh) -> int:
    """The number of nodes ``mesh`` fills on ``net``; :class:`ForecastError` naming the fix if it does not fit."""
    world, g = mesh.size, net.gpus_per_node
    if world <= g:
        return 1
    if world % g:
        raise ForecastError(f"{mesh!r} has {world} ranks, not whole nodes of {g} GPUs (network {net.name!r}); use a "
                            f"multiple of {g} ranks, or a network whose gpus_per_node divides {world}")
    nodes = world // g
    if net.inter is None:
        raise ForecastError(f"{mesh!r} needs {nodes} nodes but network {net.name!r} describes one node of {g} ranks "
                            f"(no inter-node link); forecast at most {g} ranks, or add a link with "
                            f"net.with_link('inter', alpha_us=..., busbw=...)")
    if net.max_nodes is not None and nodes > net.max_nodes:
        raise ForecastError(f"{mesh!r} needs {nodes} nodes of {g} but network {net.name!r} was measured on at most "
                            f"{net.max_nodes}; forecast at most {net.max_nodes * g} ranks, or raise max_nodes")
    return nodes


def placement(net: Network, mesh: Mesh, rank: int, axes: tuple[str, ...]) -> Placement:
    """Where ``rank``'s group over ``axes`` sits on ``net``'s nodes (rank ``r`` on node ``r // gpus_per_node``)."""
    if not axes:
        return Placement((), 1, 1, 1, "local")
    group = mesh.group_of(rank, axes)
    counts: dict[int, int] = {}
    for r in group:
        counts[r // net.gpus_per_node] = counts.get(r // net.gpus_per_node, 0) + 1
    size, nodes = len(group), len(counts)
    link = "local" if size == 1 else "intra" if nodes == 1 else "inter"
    return Placement(tuple(axes), size, nodes, min(counts.values()), link)


@dataclass(frozen=True)
class Timing:
    """One collective alone on its link: ``latency_s`` (α terms) + ``transfer_s`` (bytes / bus bandwidth)."""

    latency_s: float
    transfer_s: float
    algorithm: str
    busbw: float  # GB/s the transfer ran at

    @property
    def seconds(self) -> float:
        return self.latency_s + self.transfer_s


LOCAL = Timing(0.0, 0.0, "local", 0.0)


def collective_time(net: Network, kind: str, payload: int, where: Placement) -> Timing:
    """α–β time of one ``kind`` collective of ``payload`` bytes (the gathered output, the reduce-scatter's
    input, the all-reduce's tensor) over the group ``where``.

    >>> net = network("h100-8x-ib400")
    >>> t = collective_time(net, "all_gather", 2**30, Placement(("dp",), 8, 1, 8, "intra"))
    >>> round(t.seconds * 1e3, 2)                  # 1 GiB over 8 GPUs of one node, ms
    2.62
    """
    n = where.size
    if kind == "all_to_all":
        # [Note: an all-to-all sends (n-1)/n of its payload, as an all-gather does, and NCCL runs it as n-1
        # concurrent send/recv pairs: the networks have no measured all-to-all rate, so it is timed at the
        # all-gather's α and bus bandwidth under balanced routing (skewed routing is slower)]
        kind = "all_gather"
    if n <= 1 or kind not in KINDS:
        return LOCAL
    factor = 2 if kind == "all_reduce" else 1
    sent = payload * factor * (n - 1) / n
    intra = net.intra.cost(kind)
    if where.nodes <= 1:
        bw = intra.busbw
        options = {"ring": intra.alpha_us * factor * (n - 1)}
    else:
        inter = net.link("inter").cost(kind)
        bw = min(intra.busbw, min(where.per_node, net.nics) * inter.busbw)
        cross = factor * (where.nodes - 1)
        options = {"ring": intra.alpha_us * (factor * (n - 1) - cross) + inter.alpha_us * cross}
        if kind == "all_reduce":
            # [Note: NCCL's trees are chains inside a node and binary trees across nodes; inside one node a
            # tree is no faster than a ring, so it is only offered across nodes]
            options["tree"] = 2 * ((where.per_node - 1) * intra.alpha_us
                                   + math.ceil(math.log2(where.nodes)) * inter.alpha_us)
    if net.algorithm != "auto" and net.algorithm in options:
        algorithm = net.algorithm
    else:
        algorithm = min(options, key=lambda a: (options[a], a != "ring"))
    return Timing(options[algorithm] * 1e-6, sent / (bw * 1e9), algorithm, bw)
