"""A captured step's graph: where a batch signature stands (``Phase``), its record (``Graph``: the graph, static
inputs and outputs, what the capture saw), the graph as segments with host calls between them (``Program``),
and the eager backend's replay (``overwrite``)."""

from __future__ import annotations

import enum
import gc
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import optree
import torch

from ...errors import CaptureError


class Phase(enum.Enum):
    """Where one batch signature stands."""

    WARMUP = "warmup"        # calls run eagerly; parameters used are compared call to call
    CAPTURED = "captured"    # a graph exists; calls replay it
    STALE = "stale"          # something the graph read was replaced (an optimizer's state loaded): capture again


class Program:
    """A captured step as graphs and the host calls between them ([Note: a step in segments]); ``replay()`` runs
    it as one CUDA graph's would run."""

    # [Note: a step in segments] a step whose host must work between two parts of the device's (an offloaded
    # optimizer steps on the CPU the gradients the backward copied out, and the forward after reads the new
    # master shards) cannot be one graph. Its capture ends the graph where the host work begins
    # (``host_call``), keeps that work as a function, and captures the rest into a second graph of the same
    # memory pool; a replay runs graph, host work, graph, ... in capture order (graphs sharing a pool must
    # replay in the order they were captured). The host work runs with nothing recorded: it synchronises with
    # the device itself and is the only Python of the replay.
    def __init__(self, pool, stream):
        self.pool, self.stream = pool, stream
        self.graphs: list = []
        self.hosts: list = []
        self._ctx = None
        self._open = False

    def __enter__(self):
        gc.collect()  # as torch.cuda.graph: what the capture allocates comes from memory freed now
        torch.cuda.empty_cache()
        self._ctx = torch.cuda.stream(self.stream)
        self._ctx.__enter__()
        self._begin()
        return self

    def __exit__(self, *exc):
        try:
            if self._open:
                self._end()
        finally:
            self._ctx.__exit__(*exc)
        return False

    def _begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool)
        self.graphs.append(g)
        self._open = True

    def _end(self) -> None:
        self._open = False  # (a capture_end that raises is not retried: its error is the one to report)
        with warnings.catch_warnings():  # a segment may hold no device work (parameters offloaded: nothing to
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")  # copy back after the host
            self.graphs[-1].capture_end()                                          # step); it replays as nothing

    def split(self, fn: Callable[[], None]) -> None:
        self._end()
        self.hosts.append(fn)
        self._begin()

    def replay(self) -> None:
        for k, g in enumerate(self.graphs):
            g.replay()
            if k < len(self.hosts):
                self.hosts[k]()

    @property
    def segments(self) -> int:
        return len(self.graphs)


@dataclass
class Graph:
    """One captured signature: its graph, static inputs and outputs."""

    phase: Phase
    key: Any = None                                  # (tree structure, a key per leaf): the signature
    calls: int = 0                                   # eager calls so far (warm-up)
    graph: Any = None
    pool: Any = None
    statics: list = field(default_factory=list)      # the graph's tensor inputs, in leaf order
    out: Any = None                                  # the graph's outputs (a tree)
    unused: Optional[dict] = None                    # executor id -> unused indices, the same in every call
    executors: list = field(default_factory=list)
    optimizers: list = field(default_factory=list)
    replays: int = 0
    static_args: Any = None                          # backend="eager": the (args, kwargs) over the static inputs
    grads_at_start: list = field(default_factory=list)
    checks: list = field(default_factory=list)       # (buffer, kind, device index) written by every replay
    checked: Any = None                              # (pinned host indices, event) of the last replay's checks
    ambient: Any = None                              # grad mode and autocast around the capture's call (_ambient)
    hyper: list = field(default_factory=list)        # (optimizer ref, Python-number hyper-parameters per group)
    trained: Any = None                              # (names, parameters, requires_grad flags, param groups): _trained
    ops: Optional[dict] = None                       # executor id -> the schedule ops the last call ran
    held: list = field(default_factory=list)         # what the graph reads in place: tensor inputs and local
    addresses: list = field(default_factory=list)    # parameters, their addresses at the capture, and the inputs'
    paths: list = field(default_factory=list)        # paths in the arguments (None: a parameter)
    buffers: list = field(default_factory=list)      # (name, module, attribute, tensor, address): the models' buffers
    left: list = field(default_factory=list)         # (executor ref, stale, sync, _mode) as the capture left each


def overwrite(out, new) -> None:
    """The eager backend's replay: its outputs written into the capture's, as a graph's replay overwrites them
    (a caller keeping several calls' outputs without cloning sees on the CPU what it would see on a GPU)."""
    leaves, spec = optree.tree_flatten(out, none_is_leaf=True)
    fresh, spec2 = optree.tree_flatten(new, none_is_leaf=True)
    if spec != spec2:
        raise CaptureError(f"shardplan.capture: the step returned another structure than when it was captured "
                           f"({spec2} against {spec}): a graph's replay returns the capture's outputs")
    with torch.no_grad():
        for a, b in zip(leaves, fresh):
            if not isinstance(a, torch.Tensor) and a is not b and (isinstance(b, torch.Tensor) or a != b):
                raise CaptureError(f"shardplan.capture: the step returned {b!r} where its capture returned {a!r}: a "
                                   f"graph's replay returns the capture's outputs, and Python values computed in "
                                   f"the step are computed once. Return tensors (computed on the device)")
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a is not b:
                if a.shape != b.shape or a.dtype != b.dtype:
                    raise CaptureError(f"shardplan.capture: the step returned a {tuple(b.shape)} {b.dtype} tensor "
                                       f"where its capture returned {tuple(a.shape)} {a.dtype}: a graph's replay "
                                       f"returns the capture's outputs")
                a.copy_(b)


# [Note: hyper-parameters a graph bakes in] a torch optimizer's group values reach its kernels as Python numbers
# (baked into the graph at the capture) or as tensors (read in place at every replay): numbers, flags and tuples


_CAPTURE_VIOLATION = ("captur", "cudaErrorStreamCapture", "operation not permitted", "not permitted when stream")


def capture_failed(exc: Exception) -> str:
    """What to say when the step raised while it was being captured: a capture rule broken (a host read, an
    optimizer that is not capturable), or an error of the step itself under capture (the warm-up ran it eagerly,
    so something chose differently: a kernel, a library path), which the hint about host reads would mislead."""
    text = f"shardplan.capture: capturing the step failed: {type(exc).__name__}: {exc}."
    if any(k in str(exc) for k in _CAPTURE_VIOLATION) or "capturable" in str(exc):
        return (f"{text} A captured step must not read device values on the host (.item(), .tolist(), printing a "
                f"CUDA tensor, error_if_nonfinite=True) nor use optimizers without capturable=True "
                f"(torch.optim.AdamW(..., capturable=True), a tensor lr)")
    return (f"{text} The same step ran eagerly in the warm-up, so this is the step's own error under capture "
            f"(a kernel or library path that is not available inside a CUDA graph, e.g. an attention backend "
            f"forced by torch.nn.attention.sdpa_kernel); run it eagerly to see the full traceback, or choose "
            f"another path for the captured step")
