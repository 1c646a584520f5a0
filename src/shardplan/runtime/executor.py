"""The executor: runs ``plan.schedule`` op by op. Hooks (or the functional face) only report events.

A cursor walks the plan's program (:class:`shardplan.planner.Program`), forward steps then backward
steps, so every rank runs the same ops in the same order whatever its data does:

* An event that arrives ahead of the cursor makes it run every step before it first: a unit the model
  skipped is still gathered and freed, and its gradient (zeros) still reduced.
* An event behind the cursor is harmless while its unit is still gathered; if the plan already freed
  the unit, the model departed from the plan and the executor raises, naming both events.
* A ``post_backward(u)`` step runs as soon as every gradient of ``u`` arrived and the cursor reached it,
  or when a later event needs the steps after it: the next unit's ``pre_backward`` fires only once
  ``u``'s backward is over (autograd accumulates a parameter's gradient as soon as it is ready, before
  anything upstream), so a unit whose parameters did not all get a gradient completes right then.
  ``end_backward`` runs whatever is left. A gradient that reaches ``u`` after its reduction raises: it
  would otherwise be lost.

Gradient accumulation windows end at each synchronising backward: the unsharded gradients are zeroed
lazily at the first touch of the next window, and an all-reduce of "which parameters got a gradient"
gives parameters no rank used a ``None`` gradient, as plain PyTorch does.

The executor wires three parts, each in its own module: the :class:`~.cursor.Cursor` (where this
rank is in the program), the :class:`~.comm.CommEngine` (collectives on streams, in-flight records,
waits) and the :class:`~.grads.GradTracker` (gradients, windows, used parameters). It keeps each unit's
state (:class:`~.unit.Params`, :class:`~.unit.Grads`) and runs each op through one handler per
(kind, subject): the handlers and their table are :class:`~.handlers.OpHandlers` (runtime/handlers.py), a
mixin of the executor; so is :class:`~.local_shards.LocalShards` (runtime/local_shards.py: this rank's shards
as the optimizer and checkpoints read them). A face (runtime/faces.py) says where parameters and gradients go.
"""

from __future__ import annotations

import time
import weakref
from typing import Optional

import torch

from ..errors import RuntimeShardingError
from ..planner import Plan
from ..planner.schedule import BEGIN_BACKWARD, POST_BACKWARD, POST_FORWARD, PRE_FORWARD, ROOT, STALE, Op, Step
from .capture import session as CAP
from . import collectives as C
from .comm import CommEngine
from .cursor import Cursor, Facts
from .faces import Face
from .grads import GradTracker
from .handlers import OpHandlers
from .local_shards import LocalShards
from .seams import replaced_local
from .unit import Grads, Params, UnitRuntime


def _profiling() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


def in_backward_pass() -> bool:
    """True while the autograd engine runs (a forward now is a recomputation: activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


def _no_module() -> None:
    return None


class Executor(OpHandlers, LocalShards):
    """The runtime state of one sharded model. Attached as ``module._shardplan`` by :func:`shard`."""

    def __init__(self, plan: Plan, units: list[UnitRuntime], groups: C.Groups, device: torch.device, rank: int,
                 timeout_s: float, face: Optional["Face"] = None):
        self.plan, self.rank, self.device, self.groups, self.timeout_s = plan, rank, device, groups, timeout_s
        self.units = {u.name: u for u in units}
        self.unit_list = units
        self.buffer = {b.bp.index: b for u in units for b in u.buffers}
        self.cursor = Cursor(plan)
        self.comm = CommEngine(self.buffer, groups, device, rank, timeout_s)
        # the face: how gathered parameters reach the compute and where reduced gradients go (runtime/faces.py)
        self.face = face
        self.grads = GradTracker(plan)
        self.stale = True          # shards changed since the last gather (ZeRO-1/2 gather before the next forward)
        self.in_backward = False
        self.awaiting_backward = False
        self.versions = -1
        self.record: Optional[list] = None
        self.hook_seconds = 0.0      # CPU time inside the forward module hooks
        self.backward_seconds = 0.0  # ... inside the backward hooks, the end-of-backward callback, unit backwards
        self.track_memory = False
        self.live_bytes = self.peak_live_bytes = 0
        self.n_gathered = self.max_gathered = 0
        self.transient = {u.name for u in units if any(not b.bp.persistent for b in u.buffers)}
        # the plan keeps full parameters between steps and re-gathers them only when the shards went stale
        self.regathers = any(op.when == STALE for op in plan.schedule)
        self._todo: dict[tuple, list] = {}
        self._run_op = self._handlers()  # (kind, subject) -> its handler (runtime/handlers.py)
        self.replay_forward = False  # a no-grad forward ran after a forward whose backward is pending
        self.fsdp2_inputs = False  # the drop-in fully_shard: cast inputs at every unit, as FSDP2 (hooks.py)
        self.offload = None  # [offload hook] runtime/offload/: OffloadState, set by shard() for offloading plans
        self.partial_check = None  # tensor parallelism: runtime/tensor_parallel.py's PartialCheck, set by the faces
        self.root = _no_module  # a weak reference to the module this executor runs, set by the faces

    @property
    def face(self) -> Optional[Face]:
        return self._face

    @face.setter
    def face(self, face: Optional[Face]) -> None:
        self._face = self.comm.face = face

    # -- the tracker's switches, as attributes (no_sync and the drop-in set ``sync``) ---------------------
    @property
    def sync(self) -> bool:
        return self.grads.sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self.grads.sync = bool(value)

    @property
    def window(self) -> int:
        return self.grads.window

    @property
    def used(self) -> bytearray:
        return self.grads.used

    @property
    def streams(self):
        return self.comm.streams

    # -- events: forward -----------------------------------------------------------------------------
    def before_forward(self) -> None:
        # [Note: a no-grad forward before the pending backward] (an evaluation between loss = model(x) and
        # loss.backward(), as FSDP2 allows): it releases what the pending graph's backward reads (the root
        # unit's gathered storage, which autograd saved). The backward, if it comes, replays the forward's
        # gathers first (begin_backward); a forward with gradients instead supersedes the pending graph.
        if CAP._ACTIVE is not None:  # under shardplan.capture: refuse what cannot be captured, before any op
            CAP.note_forward(self)
        grad = torch.is_grad_enabled()
        self.replay_forward = not grad and (self.awaiting_backward or self.replay_forward)
        if self.in_backward or self.awaiting_backward or self.cursor.mid_forward:
            self._abandon()
        self.cursor.reset()
        if getattr(self.face, "owns_locals", False) and self.offload is None:
            why = replaced_local(self.buffer.values())
            if why:
                raise RuntimeShardingError(why)
        for u in self.unit_list:
            u.start_forward()
        if self.regathers and not self.stale and self._versions() != self.versions:
            raise RuntimeShardingError(
                "the local shards changed since the last all-gather of the full parameters, but no gradient-"
                "synchronising backward came in between (ZeRO-0/1/2 re-gather after one): call optimizer.step() "
                "between backward and the next forward, or shardplan.runtime.mark_shards_changed(model) after changing "
                "the shards by hand")
        self._advance_forward(0)
        self.stale = False

    def pre_forward(self, name: str) -> None:
        if in_backward_pass():  # a recomputation (activation checkpointing): the unit's backward begins
            self.pre_backward(name)
            return
        self.units[name].entered += 1
        k = self.cursor.forward_index[(PRE_FORWARD, name)]
        if k >= self.cursor.fwd:
            self._advance_forward(k)
            return
        u = self.units[name]
        if u.params is not Params.UNSHARDED and u.buffers:
            raise RuntimeShardingError(self.cursor.departure(f"pre_forward({name})", backward=False))

    def post_forward(self, name: str) -> None:
        if in_backward_pass():
            return
        k = self.cursor.forward_index[(POST_FORWARD, name)]
        if k >= self.cursor.fwd:
            self._advance_forward(k)
        if name == ROOT:
            self.awaiting_backward = torch.is_grad_enabled()
            if self.regathers:  # the full parameters now match the shards (see before_forward)
                self.versions = self._versions()

    def _advance_forward(self, k: int) -> None:
        grad = torch.is_grad_enabled()
        for step in self.cursor.forward_to(k):
            self._run_step(step, grad=grad)

    # -- events: backward ------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        self.awaiting_backward = False
        if self.replay_forward:  # see [Note: a no-grad forward before the pending backward]
            self.replay_forward = False
            self.cursor.reset()
            for u in self.unit_list:
                u.start_forward()
            for step in self.cursor.forward_to(len(self.cursor.program.forward) - 1):
                self._run_step(step, grad=True)
        for u in self.unit_list:
            u.start_pass()
        me = weakref.ref(self)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: me() and me().end_backward())
        self.face.backward_begins()
        self._advance_backward(0)  # begin_backward: the root's gradients may arrive from now on

    def pre_backward(self, name: str) -> None:
        self.begin_backward()
        k = self.cursor.pre_backward_index.get(name)
        if k is None:
            return
        u = self.units[name]
        if k >= self.cursor.bwd:
            self._advance_backward(k)
            self._drain()
        elif u.params is not Params.UNSHARDED and u.buffers and u.grads in (Grads.REDUCING, Grads.DONE):
            raise RuntimeShardingError(self.cursor.departure(f"pre_backward({name})", backward=True))

    def _advance_backward(self, k: int) -> None:
        """Run the backward steps up to ``k``. A ``post_backward`` step passed this way completes its unit:
        a later event needs what comes after it, so its gradients are as complete as they will get."""
        for step in self.cursor.backward_to(k):
            self._run_step(step, grad=True)
            if step.event == BEGIN_BACKWARD:
                continue
            u = self.units[step.at]
            if step.event == POST_BACKWARD:
                if u.grads in (Grads.IDLE, Grads.RUNNING):  # passed without a reduction (no_sync, dynamic)
                    u.grads = Grads.COMPLETE
            elif u.grads is Grads.IDLE:
                u.grads = Grads.RUNNING

    def _drain(self) -> None:
        """Run ``post_backward`` steps at the cursor whose units are complete."""
        while True:
            name = self.cursor.pending_post_backward()
            if name is None or self.units[name].grads is not Grads.COMPLETE:
                return
            self._advance_backward(self.cursor.bwd)

    def on_grad(self, name: str, index: int) -> None:
        """A full parameter's gradient was accumulated (post-accumulate-grad hook)."""
        self.begin_backward()
        u = self.units[name]
        if self.grads.arrived(u, index) and name != ROOT:
            self._complete(u)

    def outside_grad(self, name: str, buffer: int, k: int, g: torch.Tensor) -> None:
        """Member ``k`` of ``buffer`` (a replicated parameter of unit ``name``) got gradient ``g`` through its local
        tensor, used outside the unit's forward (see [Note: a replicated parameter used outside its unit] in
        hooks.py): added to its full parameter's gradient, which lands in the unit's reduction. After that
        reduction it would be lost: raise, as for any late gradient."""
        self.begin_backward()
        u = self.units[name]
        m = self.buffer[buffer].members[k]
        self.grads.check_not_reduced(u, [m.name])
        self.grads.used[m.index] = 1
        fp = m.full
        with torch.no_grad():
            if fp.grad is None:  # a copy: ``g`` may be an expanded view (the gradient of a sum)
                fp.grad = g.to(dtype=fp.dtype, memory_format=torch.contiguous_format, copy=True).view(fp.shape)
            else:
                fp.grad.add_(g.view(fp.shape))

    def expect_activation(self, name: str) -> None:
        """A tensor-parallel module of unit ``name`` will reduce its input's gradient in this backward."""
        self.units[name].awaiting += 1

    def on_activation(self, name: str) -> None:
        """That reduction ran (the backward of the module's input, right after its ``module_backward`` op)."""
        u = self.units[name]
        if self.grads.reduced_activation(u) and name != ROOT:
            self._complete(u)

    def check_not_reduced(self, u: UnitRuntime, names: list[str]) -> None:
        """A gradient arriving for ``u`` after its reduction would be lost: raise instead."""
        self.grads.check_not_reduced(u, names)

    def complete(self, name: str) -> None:
        """Every gradient of unit ``name`` has arrived (the functional face knows it exactly)."""
        u = self.units[name]
        u.params_done = True
        if name != ROOT and u.awaiting <= 0:
            self._complete(u)

    def _complete(self, u: UnitRuntime) -> None:
        if u.grads in (Grads.IDLE, Grads.RUNNING):
            u.grads = Grads.COMPLETE
            self._drain()

    def end_backward(self) -> None:
        """The autograd engine's final callback: run every backward step left, then ``end_backward``."""
        t = time.perf_counter()
        try:
            self._advance_backward(len(self.cursor.program.backward) - 1)
            self._run_step(self.cursor.program.end, grad=True)
            self._check_all_sharded()
        finally:
            self.cursor.reset()
            self.in_backward = False
            if self.grads.end_pass():
                self.stale = self.stale or self.face.stale_after_sync
                self.face.window_ended()
            for u in self.unit_list:
                u.start_pass()
            self._account()
            self.backward_seconds += time.perf_counter() - t

    # -- running ops ---------------------------------------------------------------------------------
    def _run_step(self, step: Step, *, grad: bool) -> None:
        key = (id(step), self.stale, grad, self.grads.sync)  # steps live as long as the plan
        todo = self._todo.get(key)
        if todo is None:  # the step's ops under these facts, with their handlers: looked up once
            todo = self._todo[key] = [(op, self._run_op[(op.kind, op.what)])
                                      for op in self.cursor.ops_of(step, Facts(*key[1:]))]
        for op, fn in todo:
            self.run(op, fn)

    def run(self, op: Op, fn=None):
        if self.record is not None:
            self.record.append(op)
        fn = fn or self._run_op[(op.kind, op.what)]
        if _profiling():
            with torch.profiler.record_function(f"shardplan.{op.kind} {op.what} unit={op.unit} at={op.trigger}"):
                out = fn(op)
        else:
            out = fn(op)
        if self.track_memory:
            self._account()
        return out

    def run_in_module(self, op: Op, collective):
        """Run in-module op ``op`` (a compute axis's, ``what="activations"``) through its handler: ``collective`` is
        its work, which only the module call that issues it can do (runtime/axis_ops.py); returns its result."""
        return self.run(op, lambda o: self._run_op[(o.kind, o.what)](o, collective))

    # -- helpers -----------------------------------------------------------------------------------
    def _versions(self) -> int:
        return self.face.shard_version()

    def _abandon(self) -> None:
        """A step ended without its backward (or was interrupted): finish what is in flight and release what
        the schedule would have released. Only local work: every rank reaches here the same way."""
        for u in self.unit_list:
            if u.gather is not None:
                self.comm.finish_gather(u)
            if u.reduce is not None:
                self.comm.finish_reduce(u.reduce, u.reduce.op)
                u.reduce = None
            self._reshard(u)
        self.cursor.reset()
        self.in_backward = self.awaiting_backward = False

    def _check_all_sharded(self) -> None:
        """After end_backward the schedule has freed every unit it gathered (plan validation proves it for
        the plan; this checks that the run followed it). A unit left gathered is released, and reported."""
        left = [u.name for u in self.unit_list if u.params is not Params.SHARDED and u.name in self.transient]
        for u in self.unit_list:
            if u.params is not Params.SHARDED:
                self._reshard(u)
        if left:
            raise RuntimeShardingError(f"shardplan: unit(s) {left} were still gathered after end_backward, though the "
                                       f"schedule frees them: the run departed from the plan (record it with "
                                       f"shardplan.record_ops and compare with plan.ops()). They were released")

    # -- memory accounting ---------------------------------------------------------------------------
    def _account(self) -> None:
        """Live bytes of every distinct storage the runtime holds (see ``plan.memory()``)."""
        if not self.track_memory:
            return
        seen: dict[int, int] = {}
        for u in self.unit_list:
            for t in u.tensors():
                if t is not None:
                    st = t.untyped_storage()
                    if st.size():
                        seen[st.data_ptr()] = st.size()
        # gradients autograd is forming, before they land: the plan counts them from the unit's prepare op
        self.live_bytes = sum(seen.values()) + sum(b.forming_bytes() for b in self.buffer.values())
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
