"""``shardplan.capture``: a whole training step captured once and replayed, as JAX's ``jit``.

>>> step = sp.capture(train_step)          # train_step(batch...) -> loss: forward, backward, clip, opt.step()
>>> for x, y in data:
...     loss = step(x, y)                 # warm-up calls run eagerly; then one capture; then replays

The first ``warmup`` calls for a batch signature run ``fn`` eagerly (they are real training steps: the
optimizer's state is created, kernels are chosen). The next call captures ``fn`` into a CUDA graph (every op
of every sharded model's schedule, on its streams, the loss, the backward, the optimizer) and replays it; every
later call with the same signature copies the batch into the graph's static inputs and replays, running no
Python per unit. Nothing falls back silently: a plan that cannot be captured (``plan.capture_blockers``), a
step that reads the host, or a step that uses other parameters from one warm-up step to the next raises
:class:`~shardplan.errors.CaptureError` naming why and the fix.

What changes between steps must live on the device: torch optimizers with ``capturable=True`` and a tensor
``lr`` (``sp.optim.as_lr_scheduler`` and torch's schedulers update it in place), ``sp.optim`` optimizers keep
their step count on the parameters' device and evaluate schedules there.

Outputs are the graph's own tensors, overwritten by the next replay (clone what you keep; the eager backend
writes its replays' outputs into the same tensors), as
``torch.cuda.make_graphed_callables``' are. Arguments in ``donate_argnums`` become the graph's inputs
themselves (no copy: a functional step that returns them updated in place, ``opt.update(..., donate=True)``,
needs no copy per step); the others are copied into static buffers before each replay, skipped when the
caller passes the buffer itself back. ``backend="eager"`` runs every call eagerly with the same checks and
buffers (CPU, debugging): it is never chosen for you.
"""

from __future__ import annotations

import enum
import gc
import operator
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import optree
import torch

from ..errors import CaptureError
from ..hf import capture_problem
from .dtensor_params import plain
from .seams import replaced_local

RECAPTURE, ERROR = "recapture", "error"
_GRAD = operator.attrgetter("grad")
_PTR = torch.Tensor.data_ptr
_RG = operator.attrgetter("requires_grad")
_TRAINING = operator.attrgetter("training")
BACKENDS = ("cuda_graph", "eager")


class Phase(enum.Enum):
    """Where one batch signature stands."""

    WARMUP = "warmup"        # calls run eagerly; parameters used are compared call to call
    CAPTURED = "captured"    # a graph exists; calls replay it
    STALE = "stale"          # something the graph read was replaced (an optimizer's state loaded): capture again


@dataclass
class _Session:
    """What one eager or capturing call of a captured step saw: the executors that ran, their unused parameters."""

    executors: list = field(default_factory=list)       # weak references, in first-seen order
    unused: dict = field(default_factory=dict)           # id(executor) -> tuple of unused parameter indices
    optimizers: list = field(default_factory=list)       # weak references to torch optimizers that stepped
    capturing: bool = False                              # a CUDA graph is being captured
    checks: list = field(default_factory=list)           # (buffer, kind, device index): non-finite checks to read
    records: dict = field(default_factory=dict)          # id(executor) -> (its op record, start, ours)
    force_stale: bool = False                            # executors begin this call stale ([Note: stale shards
                                                         # at the capture])
    as_graph: bool = False                               # the call runs as its graph replays (the capture; the
                                                         # eager backend's capture and replays): host_call
    program: Any = None                                  # the _Program being captured (CUDA graphs), else None

    def saw(self, exe) -> None:
        if not any(r() is exe for r in self.executors):
            self.executors.append(weakref.ref(exe))
            if self.force_stale:
                exe.stale = True
            # [Note: the same ops every step] record the ops each executor runs in this call (a list the
            # executor appends to; a caller's own recording is shared, from where it stands now)
            record, ours = exe.record, exe.record is None
            if ours:
                record = exe.record = []
            self.records[id(exe)] = (record, len(record), ours)

    def offloads(self) -> list:
        """The host sides (CPU offload) of the executors this call ran."""
        return _offloads(self.executors)

    def join_side_streams(self) -> None:
        """Before a graph's segment ends: every offloaded model's copy streams joined (a capture ends joined)."""
        for host in self.offloads():
            host.join_streams()

    def ops_run(self) -> dict:
        """What each executor ran in this call (``id -> tuple of ops``); stops the recordings it started."""
        out = {}
        for r in self.executors:
            exe = r()
            if exe is None or id(exe) not in self.records:
                continue
            record, start, ours = self.records[id(exe)]
            out[id(exe)] = tuple(record[start:])
            if ours and exe.record is record:
                exe.record = None
        return out


def _offloads(refs) -> list:
    """The host sides (CPU offload: ``exe.offload``) of the executors behind the weak references ``refs``."""
    return [h for h in (getattr(r(), "offload", None) for r in refs) if h is not None]


_ACTIVE: Optional[_Session] = None  # the session of the captured call running now (None: plain eager code)


def note_forward(exe) -> None:
    """The executor's ``before_forward``, under a captured step: refuse a plan or runtime that cannot be captured
    (before any op of the step runs)."""
    s = _ACTIVE
    if s is None or any(r() is exe for r in s.executors):
        return
    s.saw(exe)
    bs = list(exe.plan.capture_blockers)
    if bs:
        raise CaptureError("shardplan.capture: this step cannot be captured: " + "; ".join(str(b) for b in bs)
                           + ". Run it eagerly (call the step function itself), or change the plan as said")
    problem = capture_problem(exe.root()) if s.capturing else None
    if problem:  # the model would compute otherwise under capture than eagerly (hf.py)
        raise CaptureError("shardplan.capture: " + problem)


def loads_afresh(exe) -> bool:
    """Whether the functional face of ``exe`` must load every leaf into its shards now, whatever it loaded before:
    its first load in a call of a captured step after the first ([Note: stale shards at the capture]; a model
    first used in a later call too)."""
    s = _ACTIVE
    return s is not None and s.force_stale and not any(r() is exe for r in s.executors)


def as_graph() -> bool:
    """Whether the call running now runs as its captured graph will (the capture itself, or a call of the eager
    backend after its capture): host work between the device's goes through :func:`host_call`."""
    s = _ACTIVE
    return s is not None and s.as_graph


def host_call(fn: Callable[[], None]) -> None:
    """Run ``fn`` (host work that reads what the device computed so far: an offloaded optimizer step) between
    the step's device work: now in an eager call, and between the graph's segments at every replay when the
    step is being captured ([Note: a step in segments])."""
    s = _ACTIVE
    if s is not None and s.program is not None:
        s.join_side_streams()
        s.program.split(fn)
    else:
        fn()


def capturing() -> bool:
    """Whether a CUDA graph of a captured step is being recorded now (host reads must wait for the replay)."""
    s = _ACTIVE
    return s is not None and s.capturing


def note_check(buffer, kind: str, index: torch.Tensor) -> None:
    """A buffer's non-finite check inside the capture: ``index`` (a device tensor, -1 when all is finite) is read
    after each replay ([Note: the non-finite check in a captured step], runtime/scales.py)."""
    _ACTIVE.checks.append((buffer, kind, index))


def note_unused(exe, unused: Sequence[int]) -> None:
    """The executor's used-parameter exchange finished: record which parameters no rank used this pass."""
    s = _ACTIVE
    if s is not None:
        note_forward(exe)
        s.unused[id(exe)] = s.unused.get(id(exe), ()) + tuple(unused)


def _optimizer_stepped(opt, _args, _kwargs) -> None:
    s = _ACTIVE
    if s is not None and not any(r() is opt for r in s.optimizers):
        s.optimizers.append(weakref.ref(opt))


_STEP_HOOK = None


def _watch_optimizers() -> None:
    """One global optimizer-step hook (torch's extension point), installed once: which optimizers a step uses."""
    global _STEP_HOOK
    if _STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _STEP_HOOK = register_optimizer_step_pre_hook(_optimizer_stepped)


class _Program:
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
class _Graph:
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


class CapturedStep:
    """A step function captured once and replayed; built by :func:`capture`."""

    def __init__(self, fn: Callable, *, warmup: int = 2, donate_argnums: Sequence[int] = (),
                 on_new_shape: str = RECAPTURE, backend: str = "cuda_graph"):
        if not callable(fn):
            raise CaptureError(f"shardplan.capture: expected the step function, got {type(fn).__name__}")
        if backend not in BACKENDS:
            raise CaptureError(f"shardplan.capture: backend={backend!r}; choose one of {', '.join(BACKENDS)}")
        if on_new_shape not in (RECAPTURE, ERROR):
            raise CaptureError(f"shardplan.capture: on_new_shape={on_new_shape!r}; choose 'recapture' (capture the new "
                               f"signature too) or 'error'")
        if not isinstance(warmup, int) or warmup < 1:
            raise CaptureError(f"shardplan.capture: warmup={warmup!r}; at least one eager step must run before the "
                               f"capture (it creates the optimizer's state)")
        self.fn, self.warmup, self.backend, self.on_new_shape = fn, warmup, backend, on_new_shape
        self.donate = frozenset(donate_argnums)
        self.graphs: dict = {}
        self.host_seconds = 0.0       # host time spent in replays (copies of the inputs and the launch)
        self.replays = 0
        self.calls = 0                # eager, capturing and eager-backend calls so far
        self._side = None             # the warm-up stream, one per captured step
        self._stream = None           # the capture stream
        self._last: Optional[_Graph] = None  # the graph replayed or captured last ([Note: a replay's signature])
        _watch_optimizers()

    # -- signatures --------------------------------------------------------------------------------------
    def _signature(self, args, kwargs):
        leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        return (spec, tuple(map(_leaf_key, leaves))), leaves, spec

    # [Note: a replay's signature] a functional step passes every parameter and optimizer state back in (5,400
    # tensors on the 200-block model): building and comparing each one's key took most of a replay's host time
    # (15 ms of 58 on one H100). A call whose tree has the last replayed graph's structure and whose leaves are
    # that graph's inputs themselves (donated tensors passed back) or have their keys is that graph's call; only
    # the leaves that are not the graph's own are keyed. The graph's own tensors are checked by their storage
    # before every replay instead (``_check_addresses``): a donated tensor whose storage was replaced would have
    # the graph read freed memory.
    def _same_call(self, g: "_Graph", leaves: list, spec) -> bool:
        statics = g.statics
        if len(leaves) != len(statics) or spec != g.key[0]:
            return False
        keys = g.key[1]
        others = [i for i, same in enumerate(map(operator.is_, leaves, statics)) if not same]
        return all(_leaf_key(leaves[i]) == keys[i] for i in others)

    def _donated(self, args, kwargs) -> set:
        """The leaf indices that belong to donated positional arguments."""
        if not self.donate:
            return set()
        out, k = set(), 0
        for i, a in enumerate(args):
            n = len(optree.tree_leaves(a, none_is_leaf=True))
            if i in self.donate:
                out.update(range(k, k + n))
            k += n
        return out

    # -- calls -------------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        g = self._last
        try:
            if g is not None and g.phase is Phase.CAPTURED and self._same_call(g, leaves, spec):
                return self._replay(g, leaves)  # [Note: a replay's signature]
            key = (spec, tuple(map(_leaf_key, leaves)))
        except _Unhashable as exc:
            raise CaptureError(_unhashable(exc.value, leaves, (args, kwargs))) from None
        g = self.graphs.get(key)
        if g is None:
            if self.graphs and self.on_new_shape == ERROR:
                raise CaptureError(f"shardplan.capture: a call with a new signature (shapes, dtypes or other "
                                   f"arguments) and on_new_shape='error'; captured: {len(self.graphs)} signature(s). "
                                   f"Pad batches to one shape, or capture with on_new_shape='recapture'")
            g = self.graphs[key] = _Graph(Phase.WARMUP, key=key)
        if g.phase is Phase.CAPTURED:
            return self._replay(g, leaves)
        if g.phase is Phase.WARMUP and g.calls < self.warmup:
            return self._eager(g, args, kwargs)
        return self._capture(g, leaves, spec)

    def _run(self, g: _Graph, args, kwargs, *, capturing: bool, program: Optional[_Program] = None):
        """``fn`` under a session; the session's findings checked against the earlier calls'."""
        global _ACTIVE
        if _ACTIVE is not None:
            raise CaptureError("shardplan.capture: a captured step called inside another captured step; capture the "
                               "outer step only")
        # [Note: stale shards at the capture] under ZeRO-1/2 the full parameters stay between steps and are
        # gathered again when the shards went stale (a synchronising backward, an optimizer step; under the
        # functional face, leaves that changed since they were loaded). Whatever ran between two calls can leave
        # them fresh: an evaluation forward gathers the stepped shards (the module face), or loads the leaves the
        # donated update changed in place (the functional face); a call that steps nothing (a captured
        # evaluation step) leaves them fresh itself. The next call would run without the gathers (and the
        # leaves' copy into the shards), and captured so, every replay would too: training on the parameters of
        # the step before, or an evaluation graph reading the full parameters of a step long gone, whatever the
        # steps between them changed. Every call after the first begins with every executor stale and every
        # leaf to load again: it gathers again (the same values where nothing changed), so warm-ups, the capture
        # and its replays run one sequence, and a graph never trusts full parameters it did not gather.
        force = self.calls > 0  # (the functional face's leaves: loads_afresh, at each model's first load)
        s = _ACTIVE = _Session(capturing=capturing and self.backend == "cuda_graph", force_stale=force,
                               as_graph=capturing, program=program)
        try:
            out = self.fn(*args, **kwargs)
            if s.as_graph:
                self._graph_copies_used(s)
                if s.program is not None:
                    s.join_side_streams()
        finally:
            _ACTIVE = None
            ops = s.ops_run()
        first, self.calls = self.calls == 0, self.calls + 1
        self._agree(g, s, capturing)
        self._same_ops(g, ops, capturing, first)
        if s.capturing:
            g.checks = s.checks
        return out

    def _agree(self, g: _Graph, s: _Session, capturing: bool) -> None:
        # [Note: the used-parameter exchange under capture] (planner/capture.py): the set is replayed, so every
        # warm-up call and the capture must agree on it
        if g.unused is None:
            g.unused = dict(s.unused)
        elif g.unused != s.unused:
            exes = {id(r()): r() for r in s.executors if r() is not None}
            diff = []
            for k in set(g.unused) | set(s.unused):
                a, b = set(g.unused.get(k, ())), set(s.unused.get(k, ()))
                exe = exes.get(k)
                names = [exe.plan.params[i].name if exe is not None else str(i) for i in sorted(a ^ b)]
                diff += names
            raise CaptureError(f"shardplan.capture: the parameters that get a gradient changed from one step to the "
                               f"next ({', '.join(diff[:4])}{', ...' if len(diff) > 4 else ''}): a captured step "
                               f"replays one set. Run this step eagerly (and plan it with order='dynamic' if units are "
                               f"skipped)")
        g.executors = [r for r in s.executors]
        for r in s.optimizers:
            if not any(o() is r() for o in g.optimizers):
                g.optimizers.append(r)

    # [Note: the same ops every step] a captured step replays the schedule ops its capture ran. They are the
    # ops the eager step would run when every step runs the same forward and backward calls of the sharded
    # models: the capture's ops must equal those of the warm-up call before it (the first call of a step
    # function is not compared: it follows no optimizer step, and a step after one may regather what the
    # optimizer changed). A plan whose schedule was edited by hand is captured on the same terms: the
    # planner validated it (with_schedule), and the calls show it runs one sequence.
    def _same_ops(self, g: _Graph, ops: dict, capturing: bool, first: bool) -> None:
        before, g.ops = g.ops, (None if first else ops)
        if not capturing or before is None or ops == before:
            return
        exes = {id(r()): r() for r in g.executors if r() is not None}
        for k in set(before) | set(ops):
            a, b = before.get(k, ()), ops.get(k, ())
            if a == b:
                continue
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            what = (f"op #{i}: {_op(b[i]) if i < len(b) else 'nothing'} where the warm-up step ran "
                    f"{_op(a[i]) if i < len(a) else 'nothing'}")
            name = f" of {type(exes[k].root()).__name__}" if k in exes and exes[k].root() is not None else ""
            raise CaptureError(f"shardplan.capture: the step ran other schedule ops{name} when it was captured than "
                               f"in the warm-up step before it ({len(b)} against {len(a)} ops; {what}): a captured "
                               f"step replays one sequence. Make every call run the same forward and backward "
                               f"calls of the sharded model (an evaluation forward belongs outside the captured "
                               f"step), or run this step eagerly")

    def _eager(self, g: _Graph, args, kwargs):
        g.calls += 1
        if self.backend == "eager" or not torch.cuda.is_available():
            return self._run(g, args, kwargs, capturing=False)
        # torch's advice for capture: warm up on a side stream (lazy initialisation stays off the capture stream)
        # [Note: one warm-up stream] a new stream per warm-up call would each get a cuBLAS workspace that torch
        # keeps for the stream's life (32 MiB or more on recent GPUs; streams come from a pool of 32): one per step
        if self._side is None:
            self._side = torch.cuda.Stream()
        side = self._side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self._run(g, args, kwargs, capturing=False)
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self, g: _Graph, leaves: list, spec):
        donated = self._donated(*optree.tree_unflatten(spec, leaves)) if self.donate else set()
        statics = []
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and i not in donated:
                statics.append(x.detach().clone().requires_grad_(x.requires_grad))
            else:
                statics.append(x)
        args, kwargs = optree.tree_unflatten(spec, statics)
        paths = optree.tree_paths((args, kwargs), none_is_leaf=True)
        g.held = [t for t in statics if isinstance(t, torch.Tensor)]
        g.paths = [p for t, p in zip(statics, paths) if isinstance(t, torch.Tensor)]
        g.addresses = list(map(_PTR, g.held))
        self._last = g
        self._check_fresh_grads(g)
        before = _buffers(g)
        if self.backend == "eager":
            self._host_boundary(g, before=True)
            out = self._run(g, args, kwargs, capturing=True)
            _check_buffers_kept(before)
            g.statics, g.static_args, g.out, g.phase = statics, (args, kwargs), out, Phase.CAPTURED
            g.hyper, g.ambient = self._hyper(g), _ambient()
            g.trained = self._trained(g)
            self._note_shards(g)
            g.left = [(r, r().stale, r().sync, _mode(r())) for r in g.executors if r() is not None]
            self._stale_on_load(g)
            g.replays += 1
            return out
        if not torch.cuda.is_available():
            raise CaptureError("shardplan.capture: CUDA graphs need a GPU, and none is available; run the step "
                               "eagerly, or pass backend='eager' to check the step's capture rules on the CPU")
        self._host_boundary(g, before=True)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        if self._stream is None:  # (torch.cuda.graph's own captures on a side stream, too)
            self._stream = torch.cuda.Stream()
        graph = _Program(pool, self._stream)
        try:
            with graph:
                out = self._run(g, args, kwargs, capturing=True, program=graph)
        except CaptureError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised with what to change
            raise CaptureError(_capture_failed(exc)) from exc
        finally:
            self._host_boundary(g, before=False)
        _check_buffers_kept(before)
        g.graph, g.pool, g.statics, g.out, g.phase = graph, pool, statics, out, Phase.CAPTURED
        g.hyper, g.ambient = self._hyper(g), _ambient()
        g.trained = self._trained(g)
        self._note_shards(g)
        g.left = [(r, r().stale, r().sync, _mode(r())) for r in g.executors if r() is not None]
        self._stale_on_load(g)
        graph.replay()
        self._copy_checks(g)
        g.replays += 1
        return out

    @staticmethod
    def _graph_copies_used(s: _Session) -> None:
        """[Note: offload under capture] gradients the step copied to the host are stepped by its own
        ``opt.step()``: one outside the step would read them before a replay's copies land."""
        for host in s.offloads():
            if host.graph_copies:
                host.graph_copies = False
                raise CaptureError("shardplan.capture: the step copies the offloaded gradients to the host, but the "
                                   "offloading optimizer does not step inside it: call opt.step() (and zero_grad) "
                                   "inside the captured step, so that one replay is one optimizer step")

    @staticmethod
    def _host_boundary(g: _Graph, before: bool) -> None:
        """Around the capture, the host state of the executors the warm-up ran (offload: runtime/offload/): before
        it, their work in flight done; after it, nothing left that names what the capture recorded."""
        for host in _offloads(g.executors):
            host.before_graph() if before else host.after_graph()

    @staticmethod
    def _stale_on_load(g: _Graph) -> None:
        for r in g.optimizers:
            opt = r()
            if opt is not None:  # loading a state dict replaces the state tensors (and a tensor lr) the graph reads:
                # capture again (the eager backend too, as its replays would be: the same bookkeeping)
                opt.register_load_state_dict_post_hook(lambda _o, _g=g: setattr(_g, "phase", Phase.STALE))

    def _replay(self, g: _Graph, leaves: list):
        t = time.perf_counter()
        self._read_checks(g)
        self._check_addresses(g)
        self._check_grads_before_replay(g)
        self._check_hyper(g)
        self._check_trained(g)
        self._check_mode(g)
        self._check_sync(g)
        if g.ambient is not None and _ambient() != g.ambient:
            raise CaptureError(_ambient_changed(g.ambient, _ambient()))
        with torch.no_grad():
            for x, s in zip(leaves, g.statics):
                if isinstance(x, torch.Tensor) and x is not s:
                    s.copy_(x)
        try:
            if g.graph is None:  # backend="eager": the same static buffers, run again
                _overwrite(g.out, self._run(g, *g.static_args, capturing=True))
            else:
                g.graph.replay()
        except BaseException:
            # a replay cut short (a host call between the segments raised: [Note: a step in segments]): the part
            # after it never ran, so nothing the capture assumed holds; the next call captures again, from the
            # state the host settles (an offloaded model's stepped masters copied to the device first)
            g.phase = Phase.STALE
            for host in _offloads(g.executors):
                host.replay_cut_short()
            raise
        if g.graph is not None:
            self._copy_checks(g)
            self._leave_as_captured(g)
        g.replays += 1
        self.replays += 1
        self._last = g
        self.host_seconds += time.perf_counter() - t
        return g.out

    # [Note: the host after a replay] a replay runs no Python: the executors' bookkeeping stays where the last
    # eager call left it, and no version counter moves. The replay did what the captured call did (its graph
    # gathers the shards the step before it changed, then steps the optimizer), so each executor is left as the
    # capture left it: stale shards where the capture left them stale (a ZeRO-1/2 forward between replays, an
    # evaluation say, then gathers the stepped shards; else it read the gathered parameters of the step before,
    # which an evaluation before the replay had marked fresh), and the functional face compares no leaf against
    # the versions it saw (the graph updated them in place without a version bump), so its next eager call
    # loads every leaf again.
    @staticmethod
    def _leave_as_captured(g: _Graph) -> None:
        for r, stale, *_ in g.left:
            exe = r()
            if exe is None:
                continue
            if stale:
                exe.stale = True
            versions = getattr(exe.face, "versions", None)
            if isinstance(versions, dict):
                versions.clear()

    # -- what must hold between replays --------------------------------------------------------------------
    def _local_params(self, g: _Graph) -> list:
        out = []
        for r in g.executors:
            exe = r()
            if exe is not None and getattr(exe.face, "owns_locals", False):
                out += list(exe.local_params().values())
        return out

    # [Note: gradients at the start of a replay] autograd adds a gradient to a .grad that exists and assigns one
    # where .grad is None; the capture records whichever happened then, and every replay repeats it. A parameter
    # without a gradient when the step was captured must be without one at every replay (zeroed with
    # set_to_none, inside the step or between calls), or the eager step would add where the replay assigns.
    def _check_fresh_grads(self, g: _Graph) -> None:
        g.grads_at_start = [p for p in self._local_params(g) if p.grad is None]

    def _check_grads_before_replay(self, g: _Graph) -> None:
        if g.grads_at_start and list(map(_GRAD, g.grads_at_start)).count(None) != len(g.grads_at_start):
            raise CaptureError("shardplan.capture: parameters have gradients in .grad that they did not have when the "
                               "step was captured: eagerly this step would add to them, the replay would not. Zero "
                               "them inside the step (optimizer.zero_grad() after optimizer.step()) or between calls")

    # [Note: Python numbers in a captured step] a hyper-parameter held as a Python number (lr=3e-4) is baked into
    # the graph when it is captured: a scheduler that changes it afterwards would be silently ignored by every
    # replay. The numbers of every optimizer the step used are recorded at the capture and compared before each
    # replay (a few per param group; tuples such as betas and flags such as maximize too: [Note: hyper-parameters
    # a graph bakes in]); a tensor (lr=torch.tensor(3e-4, device="cuda")) is read by the graph in
    # place, so it is recorded as the tensor itself: one assigned in its place (group["lr"] = 0.05, as a manual
    # decay loop does) would leave every replay reading the old one, silently.
    # An optimizer that steps on the host between the graph's segments (an offloaded one: [Note: a step in
    # segments]) reads its param groups there at every replay, as eagerly: what its graph part bakes in instead
    # is what its ``graph_constants()`` says (the clipping threshold, say), recorded and compared the same way.
    @staticmethod
    def _hyper(g: _Graph) -> list:
        out = []
        for r in g.optimizers:
            opt = r()
            if opt is None:
                continue
            if hasattr(opt, "graph_constants"):
                out.append((r, [opt.graph_constants()], "{name}.{k}", ""))
            else:
                out.append((r, [{k: v for k, v in grp.items() if k != "params" and _hyper_value(v)}
                                for grp in opt.param_groups], "{name}.param_groups[{i}][{k!r}]",
                            "Hold it as a tensor on the device ({k}=torch.tensor({v!r}, device='cuda'), and "
                            "capturable=True), which schedulers update in place, or call step.reset() to capture "
                            "again"))
        return out

    def _check_hyper(self, g: _Graph) -> None:
        for r, groups, where, advice in g.hyper:
            opt = r()
            if opt is None:
                continue
            nows = [opt.graph_constants()] if hasattr(opt, "graph_constants") else opt.param_groups
            for i, (grp, then) in enumerate(zip(nows, groups)):
                for k, v in then.items():
                    now = grp.get(k)
                    if _same_hyper(now, v):
                        continue
                    at = where.format(name=type(opt).__name__, i=i, k=k)
                    if _has_tensor(v):
                        raise CaptureError(
                            f"shardplan.capture: {at} was replaced (by {now!r}) since the step was captured, but the "
                            f"graph reads the tensor it was captured with. Update that tensor in place "
                            f"({k}.fill_(new), as schedulers and sp.optim.as_lr_scheduler do), or call "
                            f"step.reset() to capture again")
                    if isinstance(v, (tuple, list)):
                        advice = ("Hold its numbers as tensors on the device ({k}=(torch.tensor(...), ...), where the "
                                  "optimizer takes them) updated in place, or call step.reset() to capture again")
                    elif isinstance(v, bool):
                        advice = ""
                    raise CaptureError(  # (a tensor put where a number was captured too: the graph reads the number)
                        f"shardplan.capture: {at} changed from {v!r} to {now!r} since the step was captured, but as "
                        f"a Python value it is baked into the graph. "
                        + (advice.format(k=k, v=v) or "Call step.reset() to capture again with the new value"))

    # [Note: what a step trains] a graph replays the gradients and the optimizer updates its capture recorded: a
    # parameter frozen afterwards (``p.requires_grad_(False)``) would still be trained by every replay, one
    # unfrozen not at all, and a param group added to the optimizer (progressive unfreezing) never stepped,
    # where the eager step would do each. The parameters' ``requires_grad`` (the local ones and every one an
    # optimizer steps) and the optimizers' param groups are recorded at the capture and compared before each
    # replay; a change is refused naming the parameter.
    def _trained(self, g: _Graph) -> tuple:
        names, params, seen = [], [], set()
        for r in g.executors:
            exe = r()
            if exe is not None and getattr(exe.face, "owns_locals", False):
                for name, p in exe.local_params().items():
                    names.append(name); params.append(p); seen.add(id(p))  # noqa: E702
        groups = []
        for r in g.optimizers:
            opt = r()
            if opt is None:
                continue
            groups.append((r, list(opt.param_groups), [list(grp["params"]) for grp in opt.param_groups]))
            for i, grp in enumerate(opt.param_groups):
                for j, p in enumerate(grp["params"]):
                    if id(p) not in seen:
                        names.append(f"{type(opt).__name__}.param_groups[{i}]['params'][{j}]")
                        params.append(p); seen.add(id(p))  # noqa: E702
        return names, params, list(map(_RG, params)), groups

    @staticmethod
    def _check_trained(g: _Graph) -> None:
        if g.trained is None:
            return
        names, params, flags, groups = g.trained
        if list(map(_RG, params)) != flags:
            name, now = next((n, p.requires_grad) for n, p, f in zip(names, params, flags) if p.requires_grad != f)
            raise CaptureError(
                f"shardplan.capture: {name} has requires_grad={now} and had {not now} when the step was captured: "
                f"every replay {'trains' if not now else 'leaves'} it as the capture did. Freeze or unfreeze "
                f"parameters before the capture, or call step.reset() to capture again after changing them")
        for r, then, params in groups:
            opt = r()
            if opt is None:
                continue
            now = opt.param_groups
            if len(now) == len(then) and all(map(operator.is_, now, then)) and all(
                    len(grp["params"]) == len(ps) and all(map(operator.is_, grp["params"], ps))
                    for grp, ps in zip(now, params)):
                continue
            lens, nows = [len(ps) for ps in params], [len(grp["params"]) for grp in now]
            what = (f"{len(then)} groups of {lens} parameters then, {len(now)} of {nows} now" if lens != nows
                    else "a parameter of a group replaced by another")
            raise CaptureError(
                f"shardplan.capture: {type(opt).__name__}'s param groups changed since the step was captured "
                f"({what}): every replay steps the parameters it was captured with. Call step.reset() to capture "
                f"again after add_param_group or a change of a group's parameters")

    @staticmethod
    def _check_mode(g: _Graph) -> None:
        for r, _, _, mode in g.left:
            exe = r()
            if exe is None or mode is None:
                continue
            names, modules, flags, (paths, dicts, attrs, kids) = mode
            if not all(map(operator.is_, map(dict.get, dicts, attrs), kids)):  # (one dict read per module)
                path = next(p for p, d, a, c in zip(paths, dicts, attrs, kids) if d.get(a) is not c)
                root = type(exe.root()).__name__
                raise CaptureError(
                    f"shardplan.capture: {root}.{path} is another module than when the step was captured (it was "
                    f"replaced, or removed): every replay runs the one it was captured with. Call step.reset() to "
                    f"capture again after replacing modules")
            if list(map(_TRAINING, modules)) == flags:
                continue
            # [Note: train and eval modes] a graph replays the mode it was captured in (dropout, batch-norm
            # statistics), every module's: a model left in the other (model.eval() for an evaluation, then no
            # model.train()), or one submodule switched (a batch norm frozen with .eval()), would train
            # differently from the eager step, silently. (A step that sets the mode itself runs no Python at a
            # replay: set it before the call.) One flag read per module.
            name, training = next((n, f) for n, m, f in zip(names, modules, flags) if m.training != f)
            now = "eval" if training else "training"
            root = type(exe.root()).__name__
            if not name:
                raise CaptureError(
                    f"shardplan.capture: {root} is in {now} mode, the step was captured in "
                    f"{'training' if training else 'eval'} mode, which every replay runs. Call "
                    f"model.{'train' if training else 'eval'}() before the step (after an evaluation), or capture a "
                    f"step for the other mode apart (sp.capture(eval_step))")
            raise CaptureError(
                f"shardplan.capture: {root}.{name} is in {now} mode, it was in {'training' if training else 'eval'} "
                f"mode when the step was captured, which every replay runs. Set it back ({root}.{name}."
                f"{'train' if training else 'eval'}()), or call step.reset() to capture again in the new modes")

    # [Note: gradient sync around a replay] the graph reduces the gradients as the capture did: a call made under
    # sp.no_sync (or the drop-in's set_requires_gradient_sync(False)) after a capture outside it would reduce
    # and step anyway, and one outside it after a capture inside would not reduce, silently. Refused.
    @staticmethod
    def _check_sync(g: _Graph) -> None:
        for r, _, sync, _ in g.left:
            exe = r()
            if exe is not None and exe.sync != sync:
                name = type(exe.root()).__name__ if exe.root() is not None else "the model"
                raise CaptureError(
                    f"shardplan.capture: this call runs {'outside' if exe.sync else 'under'} sp.no_sync({name}), the "
                    f"step was captured {'outside' if sync else 'under'} it: a replay reduces the gradients as the "
                    f"capture did. Accumulate inside the step (micro-batches under sp.no_sync, the last one outside), "
                    f"so that one call is one optimizer step, or call the step function itself for this call")

    # [Note: what a replay reads in place] the graph reads its tensor inputs (donated ones are the caller's) and
    # each local parameter's piece of its shard at the addresses they had when the step was captured: one list
    # of addresses, compared before each replay. A donated input whose storage was replaced (``.data = new``, a
    # resize) would be read in its old, freed memory; a replaced parameter (``p.data = new``) would train on its
    # old values. On a mismatch the error names the input, or the parameter (the eager step's buffer walk,
    # runtime/seams.py)
    def _note_shards(self, g: _Graph) -> None:
        """Add the local parameters (known once the capture ran) to what the graph reads in place, and the
        models' buffers (compared as the module's attribute: one assigned anew is a new tensor)."""
        params = [t for t in map(plain, self._local_params(g)) if t.numel()]
        g.held += params
        g.paths += [None] * len(params)
        g.addresses += list(map(_PTR, params))
        g.buffers = [(name, mod, attr, t, t.data_ptr()) for name, mod, attr, t in _buffers(g)]

    def _check_addresses(self, g: _Graph) -> None:
        for name, mod, attr, t, ptr in g.buffers:
            now = mod._buffers.get(attr)
            if now is not t or t.data_ptr() != ptr:
                how = "removed" if now is None else "replaced"
                raise CaptureError(f"shardplan.capture: the buffer {name} was {how} since the step was captured: the "
                                   f"replay reads the one it was captured with, in place. Change buffers' values in "
                                   f"place ({attr}.copy_(new)), or call step.reset() to capture again")
        if list(map(_PTR, g.held)) == g.addresses:
            return
        path = next(p for t, a, p in zip(g.held, g.addresses, g.paths) if t.data_ptr() != a)
        if path is not None:
            raise CaptureError(f"shardplan.capture: the input at {_path(path)} no longer has the storage the step was "
                               f"captured with (its .data was replaced, or it was resized): the replay reads that "
                               f"memory in place. Change donated tensors' values in place (copy_), or call "
                               f"step.reset() to capture again")
        for r in g.executors:
            exe = r()
            if exe is not None and getattr(exe.face, "owns_locals", False):
                why = replaced_local(exe.buffer.values())
                if why:
                    raise CaptureError(f"{why} (the captured step reads the shards it was captured with: "
                                       f"capture again after replacing parameters)")
        raise CaptureError("shardplan.capture: a local parameter's storage moved since the step was captured (its "
                           "shard was reallocated): the replay reads the old address. Capture again (step.reset())")

    def _copy_checks(self, g: _Graph) -> None:
        """After a replay: the non-finite checks' indices to pinned host memory, without waiting."""
        if not g.checks:
            return
        idx = torch.stack([i.to(torch.int64) for _, _, i in g.checks])
        host = torch.empty(idx.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(idx, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        g.checked = (host, ev)

    def _read_checks(self, g: _Graph) -> None:
        """Raise for what the last replay's non-finite checks found (the step before this call), naming the
        parameter as the eager check does."""
        if g.checked is None:
            return
        host, ev = g.checked
        g.checked = None
        ev.synchronize()
        for (buffer, kind, _), k in zip(g.checks, host.tolist()):
            buffer.raise_non_finite(kind, k)

    def check(self) -> None:
        """Raise now for a NaN or inf the last replay's checks found (each call does this for the step before it)."""
        for g in self.graphs.values():
            self._read_checks(g)

    def reset(self) -> None:
        """Drop every captured graph: the next calls warm up and capture again (after loading a checkpoint whose
        optimizer state replaced the captured one, say)."""
        self.graphs.clear()
        self._last = None


def _overwrite(out, new) -> None:
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
# of them (``betas``: a beta2 schedule sets a new tuple; ``maximize``, ``amsgrad``) are recorded at the capture
# and compared before every replay, tensors by identity (one replaced is not the one the graph reads).
def _hyper_value(v) -> bool:
    if isinstance(v, (tuple, list)):
        return bool(v) and all(_hyper_value(x) for x in v)
    return isinstance(v, (int, float, bool, torch.Tensor))


def _has_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and any(map(_has_tensor, v)))


def _same_hyper(now, then) -> bool:
    if isinstance(then, torch.Tensor) or isinstance(now, torch.Tensor):
        return now is then
    if isinstance(then, (tuple, list)):
        return (isinstance(now, (tuple, list)) and len(now) == len(then)
                and all(map(_same_hyper, now, then)))
    return bool(now == then)


# [Note: the state around a call] what a caller's context sets for the step's torch calls is baked into the
# graph as the capture saw it: gradient mode (a replay under torch.no_grad() still runs its backward and
# optimizer step; eagerly, backward would raise) and autocast entered around the call (a replay computes in the
# capture's dtypes, eagerly the step would follow the new context). Recorded at the capture, compared before
# each replay; a call in another context is refused.
_AUTOCAST = ("cuda", "cpu")


def _ambient() -> tuple:
    # (an autocast's dtype only where it is on: a disabled one's default dtype changes nothing the step runs)
    return (torch.is_grad_enabled(),) + tuple((e, torch.get_autocast_dtype(d) if e else None)
                                               for d in _AUTOCAST for e in (torch.is_autocast_enabled(d),))


def _ambient_changed(then: tuple, now: tuple) -> str:
    parts = []
    if then[0] != now[0]:
        parts.append(f"gradients {'enabled' if now[0] else 'disabled (torch.no_grad())'} around this call, "
                     f"{'enabled' if then[0] else 'disabled'} around the capture")
    for d, (te, td), (ne, nd) in zip(_AUTOCAST, then[1:], now[1:]):
        if (te, td) != (ne, nd):
            what = lambda e, t: f"autocast({d!r}, dtype={t})" if e else f"no {d} autocast"  # noqa: E731
            parts.append(f"{what(ne, nd)} around this call, {what(te, td)} around the capture")
    return (f"shardplan.capture: {'; '.join(parts)}: a replay runs the step as it was captured in its context. "
            f"Call it in the same context, enter autocast (or no_grad) inside the step function, or capture a step "
            f"for the other context apart")


def _buffers(g: _Graph) -> list:
    """(name, module, attribute, tensor) of every buffer of the modules the step's executors run."""
    roots = {id(m): m for m in (r().root() for r in g.executors if r() is not None) if m is not None}
    return [(f"{type(root).__name__}.{name}", mod, attr, t)
            for root in roots.values() for name, mod in root.named_modules()
            for attr, t in mod._buffers.items() if t is not None
            for name in (f"{name}.{attr}" if name else attr,)]


def _check_buffers_kept(before: list) -> None:
    """At the capture: a buffer the step itself assigns anew (``self.x = self.x * 2`` in a forward) would be read by
    every replay where the capture found it (memory the module no longer holds), not the one the step made."""
    for name, mod, attr, t in before:
        if mod._buffers.get(attr) is not t:
            raise CaptureError(f"shardplan.capture: the step assigns the buffer {name} anew (a module attribute set to "
                               f"a new tensor): a replay would read the tensor the capture started from, not the one "
                               f"the step made. Update it in place ({attr}.copy_(new), {attr}.mul_(...)), or keep it "
                               f"out of the captured step")


def _mode(exe):
    """The training flags of the modules an executor runs, with their names (``None``: no module, the
    functional face)."""
    root = exe.root()
    if root is None:
        return None
    names, modules = zip(*root.named_modules())
    children = [(f"{prefix}.{n}" if prefix else n, m._modules, n, c)
                for prefix, m in zip(names, modules) for n, c in m._modules.items()]
    return list(names), list(modules), list(map(_TRAINING, modules)), tuple(map(list, zip(*children))) or ([],) * 4


class _Unhashable(Exception):
    def __init__(self, value):
        super().__init__()
        self.value = value


def _leaf_key(x) -> tuple:
    """One argument leaf's part of a call's signature (a tuple, not the torch.Size: comparing keys is 1.7x faster)."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype, x.device, x.requires_grad)
    try:
        hash(x)
    except TypeError:
        raise _Unhashable(x) from None
    return ("V", type(x), x)


def _unhashable(value, leaves: list, tree) -> str:
    """[Note: non-tensor arguments] a graph replays what the capture's Python computed from a non-tensor argument
    (a constant in its kernels' arguments); calls are told apart by such arguments compared with ``==``, as JAX's
    static arguments are. One that is neither a tensor nor hashable (a NumPy array, a set, an object without a
    hash) was keyed by its ``id()``: changed in place, or a new one at a freed one's address, it replayed the
    old values, silently. Refused, naming it."""
    paths = optree.tree_paths(tree, none_is_leaf=True)
    where = next((_path(p) for p, leaf in zip(paths, leaves) if leaf is value), "an argument")
    return (f"shardplan.capture: {where} is a {type(value).__name__}, neither a tensor nor hashable: a captured "
            f"step's graph keeps what its capture computed from a non-tensor argument and tells calls apart by such "
            f"arguments (compared with ==), so it would not see this one change. Pass it as a tensor (read at every "
            f"replay) or as a hashable, immutable value (a new value is a new signature)")


def _path(path: tuple) -> str:
    """``((args, kwargs), ...)``'s leaf path as the caller wrote it: ``args[0]['layers.0.w']``."""
    head, rest = ("args", path[1:]) if path and path[0] == 0 else ("kwargs", path[1:])
    return head + "".join(f"[{k!r}]" for k in rest)


def _op(op) -> str:
    return f"{op.kind} {op.what} of unit {op.unit or 'all'!r} at {op.trigger}"


_CAPTURE_VIOLATION = ("captur", "cudaErrorStreamCapture", "operation not permitted", "not permitted when stream")


def _capture_failed(exc: Exception) -> str:
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


def capture(fn: Optional[Callable] = None, *, warmup: int = 2, donate_argnums: Sequence[int] = (),
            on_new_shape: str = RECAPTURE, backend: str = "cuda_graph") -> Union[CapturedStep, Callable]:
    """Capture a training step once and replay it (a CUDA graph of everything the step runs on the device).

    >>> opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4, device="cuda"), capturable=True)
    >>> @sp.capture
    ... def step(x, y):
    ...     loss = model(x, y); loss.backward()
    ...     sp.clip_grad_norm_(model, 1.0); opt.step(); opt.zero_grad()
    ...     return loss
    >>> for x, y in data: loss = step(x, y)

    ``warmup``: eager calls per signature before the capture. ``donate_argnums``: positional arguments whose
    tensors become the graph's inputs themselves (a functional step's params and optimizer state).
    ``on_new_shape``: ``"recapture"`` (warm up and capture each new batch signature) or ``"error"``.
    ``backend="eager"``: run eagerly with the same checks (CPU, debugging).
    """
    def wrap(f):
        return CapturedStep(f, warmup=warmup, donate_argnums=donate_argnums, on_new_shape=on_new_shape,
                            backend=backend)
    return wrap if fn is None else wrap(fn)
