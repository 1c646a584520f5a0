"""CPU offload at run time: host copies of the offloaded buffers, the schedule's host ops, the host step.

For every buffer the plan offloads (``BufferPlan.offload``) this rank keeps four flat host tensors the size
of its shard, in the parameters' dtype (pinned on CUDA; views of a few power-of-two slabs, [Note: slabs]): the
master shard, the gradient shard, and AdamW's two moments. :mod:`shardplan.planner.accounting` counts exactly
these (``plan.memory().host``).

* ``copy_d2h grads`` (after the unit's reduction wait, ``sync`` backwards only): the local gradient shards
  go to the host gradient on a side copy stream, overlapping the rest of backward.
* ``optim_step params`` (right after it): the host step of those buffers is handed to a worker thread
  (torch's CPU kernels release the GIL), so it runs while backward goes on; see [Note: the overlapped step].
* ``copy_h2d params`` (ZeRO-3: just before the unit's first forward gather; ZeRO-1/2: ``before_forward``,
  after a step): the updated shards are on the device before any gather reads them; it waits for the
  unit's host step, issues its copy if not yet issued and orders the gather after it.

[Note: the overlapped step] At ``optim_step`` a buffer steps on the host at once (in the worker) when
the step is known now to be the one ``opt.step()`` would take: the optimizer is built with ``overlap=True``
(the default) and without ``max_grad_norm`` (clipping needs the global norm, known only after the whole
backward), and every trainable parameter of the buffer got a gradient on this rank (otherwise the used-
parameter exchange at ``end_backward`` may still turn a gradient into ``None``, which skips it: such a
buffer steps in ``opt.step()``). The step reads the optimizer's hyper-parameters (the learning rate a
scheduler set) when it starts, i.e. during backward; ``opt.step()`` checks that they and the gradients
are still what the step used, and raises naming the fix otherwise (never a silently different step).
The new shard goes back to the device as soon as the executor next sees the worker done (at the next
host op, at ``opt.step()`` or at the next ``copy_h2d``), on a host-to-device stream that waits only for
the device's last read of the shard (``ready``, recorded at ``optim_step``). ``opt.step()`` checks the
steps in flight, hands the worker the buffers that could not overlap backward, steps the device-resident
buffers, and waits for the host steps (the parameters after ``step()`` are the new ones, torch's contract);
with ``offload_optimizer(..., overlap_forward=True)`` it returns without waiting: [Note: the host step
overlaps the next forward].

[Note: the host step overlaps the next forward] Each offloaded buffer's step is a :class:`HostStep` state
and a future (:class:`InFlightStep`): ``QUEUED`` when backward handed it to the worker, ``CLAIMED`` once
``opt.step()`` checked it is the step it would take (hyper-parameters, gradients), ``IDLE`` once it ran and
the copy of the new shard to the device is issued (landed). With ``overlap_forward`` ``opt.step()`` does not
wait for the worker:
the wait is the unit's own ``copy_h2d``, which ZeRO-3 runs just before the unit's first all-gather of the
next forward (at the schedule's prefetch depth), and which waits for that unit's step only; the worker steps
the units in forward order once they are all queued (runtime/host_worker.py, [Note: host step order]). So
unit k's forward in step t+1 reads its parameters after step t's update (no staleness), while the host
still steps units k+1, ... . Under ZeRO-1/2 every gather runs at ``before_forward``, so the first forward
op waits for every host step (the overlap is then backward's only). Whatever reads the shards or the
host state between ``opt.step()`` and that forward waits first (:meth:`OffloadState.settle`): checkpoints,
``model.state_dict()``, ``opt.state_dict()``, ``Executor.local_value`` / ``shard_of``; a loop reading
``model.parameters()`` directly there calls ``opt.synchronize()`` first.

[Note: hosted parameter shards] Under ``offload="params"`` (ZeRO-3) a buffer's master *is* its shard: the
device shard's storage is freed at start-up (the local parameters keep their shapes, with no storage, as the
gathered parameters do between gathers). The ``copy_h2d`` before each of the unit's all-gathers (at the
schedule's prefetch depth) allocates it on the compute stream and copies the master in on the host-to-device
stream through a view with its own version counter (a copy in is not a change of the shard); the gather
stream, not the compute stream, waits for that copy, so a prefetched copy overlaps the compute before it.
The gather's wait frees it again (:meth:`OffloadState.gathered`), so the device holds it exactly where
``plan.memory()`` counts it. The host step writes the master (the copy back of optimizer offload is
nothing here: the next gather reads the master). Checkpoints read and write the master
(``Executor.local_value`` / ``shard_of``); ``model.state_dict()`` refuses such parameters naming them.

[Note: keeping copies' tensors alive] A non-blocking copy reads its source after the call returns. The
device gradients a ``copy_d2h`` reads are marked with ``record_stream`` (the caching allocator does not
reuse them before the copy stream is past them, even if ``zero_grad`` drops them at once); the host
tensors are ours: the worker waits for a buffer's gradient copy (``d2h``) before reading the host gradient
and for its last copy to the device (``h2d``) before writing the master again.

[Note: clipping] Without overlap, ``sp.clip_grad_norm_`` scales the device gradients after they were
copied; it tells this module the coefficient (:meth:`OffloadState.grads_scaled`), and the host gradient is
scaled by the same number before the step. Any other change to a gradient after its copy (its tensor or
version differs at step time) makes the step copy that gradient again: slower, never stale. With
overlap, ``clip_grad_norm_`` after a host step already ran raises (pass ``max_grad_norm=`` instead).

[Note: offload under capture] ``shardplan.capture`` captures an offloaded step in segments ([Note: a step in
segments], runtime/capture/graph.py). In a call that runs as its graph (the capture; the eager backend's calls after
it) nothing goes to the worker: ``optim_step`` hands nothing over, ``opt.step()`` clips on the device as eagerly,
joins the gradients' copies into the segment, and gives the capture one host call (``graph_host_step``: wait for
the segment, scale the host gradients by the clip coefficients the graph computed, AdamW on the host; the
buffers kept on the device step there too, with the gradient tensors the graph writes), then issues the
copies of the new masters to the device, which the next segment records. Before the capture every host step
in flight lands and the copies finish (a graph cannot wait for work issued outside it); after it, the copies'
events it recorded are forgotten (the host never waits on a graph's event). Each replay leaves the host state
as the capture did: nothing in flight, the masters on the device.
"""

from .copies import HostCopies
from .host import HYPER, STATS, HostBuffer, HostStep, InFlightStep, _hyper, _slabs, _snapshot  # noqa: F401
from .kernels import _by_step, _spans, adamw  # noqa: F401  (kernels._host_compute: the steps read it there)
from .state import OffloadState, attach
from .steps import HostSteps

# The rooms: ``host.py`` (the host buffers' records and slabs), ``kernels.py`` (the AdamW kernels over them),
# ``copies.py`` (device <-> host copies), ``steps.py`` (the host step: overlapped, claimed, landed),
# ``state.py`` (``OffloadState``, which has both, and ``attach``).
__all__ = ["OffloadState", "attach", "HostBuffer", "HostStep", "InFlightStep", "HostCopies", "HostSteps", "adamw",
           "HYPER", "STATS"]
