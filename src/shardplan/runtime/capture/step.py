"""``CapturedStep``: a step function's calls, by signature, warmed up eagerly, captured once and replayed;
``capture``, its decorator."""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence, Union

import optree
import torch

from ...errors import CaptureError
from . import checks
from . import offloaded
from . import session as S
from .graph import Graph, Phase, Program, capture_failed, overwrite

RECAPTURE, ERROR = "recapture", "error"
BACKENDS = ("cuda_graph", "eager")


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
        self._last: Optional[Graph] = None  # the graph replayed or captured last ([Note: a replay's signature])
        S.watch_optimizers()

    # -- calls -------------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        g = self._last
        try:
            if g is not None and g.phase is Phase.CAPTURED and S.same_call(g, leaves, spec):
                return self._replay(g, leaves)  # [Note: a replay's signature]
            key = (spec, tuple(map(S.leaf_key, leaves)))
        except S.Unhashable as exc:
            raise CaptureError(S.unhashable(exc.value, leaves, (args, kwargs))) from None
        g = self.graphs.get(key)
        if g is None:
            if self.graphs and self.on_new_shape == ERROR:
                raise CaptureError(f"shardplan.capture: a call with a new signature (shapes, dtypes or other "
                                   f"arguments) and on_new_shape='error'; captured: {len(self.graphs)} signature(s). "
                                   f"Pad batches to one shape, or capture with on_new_shape='recapture'")
            g = self.graphs[key] = Graph(Phase.WARMUP, key=key)
        if g.phase is Phase.CAPTURED:
            return self._replay(g, leaves)
        if g.phase is Phase.WARMUP and g.calls < self.warmup:
            return self._eager(g, args, kwargs)
        return self._capture(g, leaves, spec)

    def _run(self, g: Graph, args, kwargs, *, capturing: bool, program: Optional[Program] = None):
        """``fn`` under a session; the session's findings checked against the earlier calls'."""
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
        s = S.begin(capturing=capturing and self.backend == "cuda_graph", force_stale=force, as_graph=capturing,
                    program=program)
        try:
            out = self.fn(*args, **kwargs)
            if s.as_graph:
                offloaded.graph_copies_used(s.executors)
                if s.program is not None:
                    s.join_side_streams()
        finally:
            S.end()
            ops = s.ops_run()
        first, self.calls = self.calls == 0, self.calls + 1
        S.agree(g, s)
        S.same_ops(g, ops, capturing, first)
        if s.capturing:
            g.checks = s.checks
        return out

    def _eager(self, g: Graph, args, kwargs):
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


    def _capture(self, g: Graph, leaves: list, spec):
        donated = S.donated(self.donate, *optree.tree_unflatten(spec, leaves)) if self.donate else set()
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
        g.addresses = list(map(torch.Tensor.data_ptr, g.held))
        self._last = g
        checks.note_grads_at_start(g)
        before = checks.buffers(g)
        if self.backend == "eager":
            offloaded.host_boundary(g.executors, before=True)
            out = self._run(g, args, kwargs, capturing=True)
            checks.check_buffers_kept(before)
            g.statics, g.static_args, g.out, g.phase = statics, (args, kwargs), out, Phase.CAPTURED
            checks.record(g)
            g.replays += 1
            return out
        return self._capture_graph(g, statics, args, kwargs, before)

    def _capture_graph(self, g: Graph, statics: list, args, kwargs, before: list):
        if not torch.cuda.is_available():
            raise CaptureError("shardplan.capture: CUDA graphs need a GPU, and none is available; run the step "
                               "eagerly, or pass backend='eager' to check the step's capture rules on the CPU")
        offloaded.host_boundary(g.executors, before=True)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        if self._stream is None:  # (torch.cuda.graph's own captures on a side stream, too)
            self._stream = torch.cuda.Stream()
        graph = Program(pool, self._stream)
        try:
            with graph:
                out = self._run(g, args, kwargs, capturing=True, program=graph)
        except CaptureError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised with what to change
            raise CaptureError(capture_failed(exc)) from exc
        finally:
            offloaded.host_boundary(g.executors, before=False)
        checks.check_buffers_kept(before)
        g.graph, g.pool, g.statics, g.out, g.phase = graph, pool, statics, out, Phase.CAPTURED
        checks.record(g)
        graph.replay()
        checks.copy_checks(g)
        g.replays += 1
        return out

    def _replay(self, g: Graph, leaves: list):
        t = time.perf_counter()
        checks.before_replay(g)
        with torch.no_grad():
            for x, s in zip(leaves, g.statics):
                if isinstance(x, torch.Tensor) and x is not s:
                    s.copy_(x)
        try:
            if g.graph is None:  # backend="eager": the same static buffers, run again
                overwrite(g.out, self._run(g, *g.static_args, capturing=True))
            else:
                g.graph.replay()
        except BaseException:
            # a replay cut short (a host call between the segments raised: [Note: a step in segments]): the part
            # after it never ran, so nothing the capture assumed holds; the next call captures again, from the
            # state the host settles (an offloaded model's stepped masters copied to the device first)
            g.phase = Phase.STALE
            offloaded.cut_short(g.executors)
            raise
        if g.graph is not None:
            checks.copy_checks(g)
            self._leave_as_captured(g)
        g.replays += 1
        self.replays += 1
        self._last = g
        self.host_seconds += time.perf_counter() - t
        return g.out

    # eager call left it, and no version counter moves. The replay did what the captured call did (its graph
    # gathers the shards the step before it changed, then steps the optimizer), so each executor is left as the
    # capture left it: stale shards where the capture left them stale (a ZeRO-1/2 forward between replays, an
    # evaluation say, then gathers the stepped shards; else it read the gathered parameters of the step before,
    # which an evaluation before the replay had marked fresh), and the functional face compares no leaf against
    # the versions it saw (the graph updated them in place without a version bump), so its next eager call
    # loads every leaf again.
    @staticmethod
    def _leave_as_captured(g: Graph) -> None:
        for r, stale, *_ in g.left:
            exe = r()
            if exe is None:
                continue
            if stale:
                exe.stale = True
            versions = getattr(exe.face, "versions", None)
            if isinstance(versions, dict):
                versions.clear()


    # -- after the replays -----------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise now for a NaN or inf the last replay's checks found (each call does this for the step before it)."""
        for g in self.graphs.values():
            checks.read_checks(g)

    def reset(self) -> None:
        """Drop every captured graph: the next calls warm up and capture again (after loading a checkpoint whose
        optimizer state replaced the captured one, say)."""
        self.graphs.clear()
        self._last = None


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
