"""What one call of a captured step saw (``Session``: the executors that ran, their unused parameters, the
optimizers that stepped, the schedule ops they ran), the hooks the runtime calls into it (``note_forward``,
``host_call``, ...), its findings agreed with the earlier calls', and the call's signature (the key of its
graph: the argument tree's structure and a key per leaf)."""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import optree
import torch

from ...errors import CaptureError
from ...hf import capture_problem
from .graph import Graph
from .offloaded import join_side_streams


@dataclass
class Session:
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
    program: Any = None                                  # the graph.Program being captured (CUDA graphs), else None

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

    def join_side_streams(self) -> None:
        """Before a graph's segment ends: every offloaded model's copy streams joined (a capture ends joined)."""
        join_side_streams(self.executors)

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


_ACTIVE: Optional[Session] = None  # the session of the captured call running now (None: plain eager code)


def begin(**fields) -> Session:
    """A captured step's call starts: its session is the active one (one at a time)."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise CaptureError("shardplan.capture: a captured step called inside another captured step; capture the "
                           "outer step only")
    s = _ACTIVE = Session(**fields)
    return s


def end() -> None:
    """The call is over: plain eager code again."""
    global _ACTIVE
    _ACTIVE = None


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


def watch_optimizers() -> None:
    """One global optimizer-step hook (torch's extension point), installed once: which optimizers a step uses."""
    global _STEP_HOOK
    if _STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _STEP_HOOK = register_optimizer_step_pre_hook(_optimizer_stepped)


def agree(g: Graph, s: Session) -> None:
    """The call's unused parameters, executors and optimizers agreed with the earlier calls' and kept."""
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
def same_ops(g: Graph, ops: dict, capturing: bool, first: bool) -> None:
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


# [Note: a replay's signature] a functional step passes every parameter and optimizer state back in (5,400
# tensors on the 200-block model): building and comparing each one's key took most of a replay's host time
# (15 ms of 58 on one H100). A call whose tree has the last replayed graph's structure and whose leaves are
# that graph's inputs themselves (donated tensors passed back) or have their keys is that graph's call; only
# the leaves that are not the graph's own are keyed. The graph's own tensors are checked by their storage
# before every replay instead (checks.check_addresses): a donated tensor whose storage was replaced would have
# the graph read freed memory.
def same_call(g: Graph, leaves: list, spec) -> bool:
    """Whether a call with these leaves is ``g``'s call ([Note: a replay's signature])."""
    statics = g.statics
    if len(leaves) != len(statics) or spec != g.key[0]:
        return False
    keys = g.key[1]
    others = [i for i, same in enumerate(map(operator.is_, leaves, statics)) if not same]
    return all(leaf_key(leaves[i]) == keys[i] for i in others)


def donated(donate: frozenset, args, kwargs) -> set:
    """The leaf indices that belong to donated positional arguments."""
    if not donate:
        return set()
    out, k = set(), 0
    for i, a in enumerate(args):
        n = len(optree.tree_leaves(a, none_is_leaf=True))
        if i in donate:
            out.update(range(k, k + n))
        k += n
    return out


class Unhashable(Exception):
    def __init__(self, value):
        super().__init__()
        self.value = value


def leaf_key(x) -> tuple:
    """One argument leaf's part of a call's signature (a tuple, not the torch.Size: comparing keys is 1.7x faster)."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype, x.device, x.requires_grad)
    try:
        hash(x)
    except TypeError:
        raise Unhashable(x) from None
    return ("V", type(x), x)


def unhashable(value, leaves: list, tree) -> str:
    """[Note: non-tensor arguments] a graph replays what the capture's Python computed from a non-tensor argument
    (a constant in its kernels' arguments); calls are told apart by such arguments compared with ``==``, as JAX's
    static arguments are. One that is neither a tensor nor hashable (a NumPy array, a set, an object without a
    hash) was keyed by its ``id()``: changed in place, or a new one at a freed one's address, it replayed the
    old values, silently. Refused, naming it."""
    paths = optree.tree_paths(tree, none_is_leaf=True)
    where = next((arg_path(p) for p, leaf in zip(paths, leaves) if leaf is value), "an argument")
    return (f"shardplan.capture: {where} is a {type(value).__name__}, neither a tensor nor hashable: a captured "
            f"step's graph keeps what its capture computed from a non-tensor argument and tells calls apart by such "
            f"arguments (compared with ==), so it would not see this one change. Pass it as a tensor (read at every "
            f"replay) or as a hashable, immutable value (a new value is a new signature)")


def arg_path(path: tuple) -> str:
    """``((args, kwargs), ...)``'s leaf path as the caller wrote it: ``args[0]['layers.0.w']``."""
    head, rest = ("args", path[1:]) if path and path[0] == 0 else ("kwargs", path[1:])
    return head + "".join(f"[{k!r}]" for k in rest)


def _op(op) -> str:
    return f"{op.kind} {op.what} of unit {op.unit or 'all'!r} at {op.trigger}"
