"""Asynchronous saves: copy the checkpoint to host memory, write it in the background, publish it atomically.

>>> fut = sp.checkpoint.async_save(sp.checkpoint.step_dir("ckpt", step), model, opt, step=step)
>>> ...                       # training goes on while DCP writes the files
>>> fut.result()              # the published path; raises CheckpointError if the save failed

How it goes, on every rank:

1. A previous asynchronous save still in flight is waited for (one at a time per process: the host
   copies and the checkpoint process group are reused).
2. *Staging*: every tensor of the state dict is copied into a host buffer kept for the next save
   (:class:`_HostCopies`). On CPU the copy is done when ``async_save`` returns. On a GPU the buffer is
   page-locked and the copies run on a side stream; the optimizer's next ``step()`` waits for them on the
   GPU (a step pre-hook, no host synchronisation), so forward and backward of the next step overlap them.
3. DCP's ``async_save`` writes the copies into ``PATH.tmp-XXXX`` from its own thread, on a gloo process
   group of its own (created on the first call, every rank together): training's collectives never share a
   group with the writer, so neither can block the other.
4. After DCP returned on every rank (all ranks' files are written and synced, and rank 0 wrote ``.metadata``),
   the ranks agree over that group whether all succeeded; only then rank 0 writes the completion marker and
   renames the directory to ``PATH``. A rank killed or failing at any point before leaves ``PATH`` as it was
   (the previous checkpoint, if any) and :func:`~.steps.latest` pointing to the previous step.

The future's ``result()`` is ``PATH``; a failure raises :class:`~shardplan.errors.CheckpointError` there, and,
if no ``result()`` / ``exception()`` call looked at it, at the next ``save`` / ``async_save`` of the process.
Call ``result()`` (or :func:`wait`) before ``torch.distributed.destroy_process_group()``.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
import weakref
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from ...errors import CheckpointError
from .. import collectives as C
from ..builder import engine_of
from ..dcp_values import over_copies, value_tensors
from .values import quiet_sharded_tensor, state_dict
from . import dcp_io
from .run_state import RunState, saved_entries

_ALIGN = 64  # bytes: where each staged tensor starts in the host buffer


class CheckpointFuture(concurrent.futures.Future):
    """What :func:`async_save` returns: a :class:`concurrent.futures.Future` whose ``result()`` is the
    published path (``.path``, ``.step``), or raises :class:`CheckpointError` if the save failed."""

    def __init__(self, path: str, step: int):
        super().__init__()
        self.path, self.step = path, step
        self._copied: Optional[torch.cuda.Event] = None
        self._observed = False

    def result(self, timeout=None):
        try:
            return super().result(timeout)
        finally:
            self._observed = self._observed or self.done()

    def exception(self, timeout=None):
        try:
            return super().exception(timeout)
        finally:
            self._observed = self._observed or self.done()

    def wait_staged(self) -> None:
        """Block until the host copies are complete (at once on CPU; on a GPU the copies may still be
        running when ``async_save`` returns): needed only before writing parameters or optimizer states
        in place other than through the optimizer's ``step()``, which waits for them itself."""
        if self._copied is not None:
            self._copied.synchronize()


_INFLIGHT: list[CheckpointFuture] = []  # the save of this process still being written (at most one)
_LOCK = threading.Lock()


def wait() -> Optional[str]:
    """Wait for this process's asynchronous save in flight, if any; its path, or ``None``: none was in
    flight. Raises its :class:`CheckpointError` if it failed.

    >>> sp.checkpoint.wait()      # e.g. before torch.distributed.destroy_process_group()
    """
    with _LOCK:
        fut = _INFLIGHT[-1] if _INFLIGHT else None
    return None if fut is None else fut.result()


def settle(*, raise_unobserved: bool) -> None:
    """Wait for the save in flight; raise its failure if asked and nobody looked at it (the next save
    reports a failed one that the caller never checked)."""
    with _LOCK:
        fut = _INFLIGHT[-1] if _INFLIGHT else None
    if fut is None:
        return
    concurrent.futures.wait([fut])
    observed = fut._observed
    with _LOCK:
        if _INFLIGHT and _INFLIGHT[-1] is fut:
            _INFLIGHT.clear()
    if raise_unobserved and not observed and fut.exception() is not None:
        raise CheckpointError(f"the previous asynchronous save (step {fut.step}, to {fut.path}) failed, and its "
                              f"future was never checked: {fut.exception()}") from fut.exception()


def inflight_paths() -> set[str]:
    """The temporary directories this process is writing into now (``prune`` leaves them alone)."""
    with _LOCK:
        return {f._tmp for f in _INFLIGHT if not f.done() and getattr(f, "_tmp", None)}


# -- the checkpoint's own process group ------------------------------------------------------------------

_GROUP: dict = {}  # "held": (default process group, the checkpoint group over all its ranks)


def checkpoint_group():
    """A gloo group over every rank, for the background writer and the publish step (``None`` without a
    process group). Created on first use, by every rank together, and again after a new
    ``init_process_group``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.distributed_c10d._get_default_group()
    held = _GROUP.get("held")
    if held is None or held[0] is not world:
        held = _GROUP["held"] = (world, dist.new_group(backend="gloo"))
    return held[1]


# -- staging: host copies -----------------------------------------------------------------------------------

class _HostCopies:
    """One model's checkpoint tensors copied into one host buffer, kept for the next save (same layout:
    no allocation, no page faults). Page-locked where any tensor is on a GPU (one ``cudaHostRegister`` of
    the whole buffer, as DCP's own stager does per storage). Each staged tensor owns a storage slice of
    the buffer, so DCP's writer writes it without cloning it."""

    def __init__(self):
        self.layout, self.buffer, self.slots, self._unpin = None, None, {}, None
        self.stream = None

    def slots_for(self, tensors: list) -> dict:
        layout = tuple((k, tuple(t.shape), t.dtype, t.is_cuda) for k, t in tensors)
        if layout == self.layout:
            return self.slots
        self.release()
        offsets, total = {}, 0
        for k, t in tensors:
            offsets[k] = total
            total += -(-t.nbytes // _ALIGN) * _ALIGN
        buffer = torch.empty(max(total, _ALIGN), dtype=torch.uint8)
        if any(t.is_cuda for _, t in tensors):
            buffer = self._pin(buffer)
        storage = buffer.untyped_storage()
        self.slots = {k: torch.empty(0, dtype=t.dtype).set_(storage[offsets[k]:offsets[k] + t.nbytes], 0, t.shape)
                      for k, t in tensors}
        self.layout, self.buffer = layout, buffer
        return self.slots

    def _pin(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` page-locked in place (exact size); where the host refuses that (a sandbox without
        ``cudaHostRegister``), a pinned buffer from torch's host allocator; failing both, ``buffer`` as it
        is (the copies are then synchronous, still correct)."""
        from torch.cuda import _pin_memory_utils as pin
        try:
            pin.pin_memory(buffer.data_ptr(), buffer.nbytes)
        except RuntimeError:
            clear = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
            if clear is not None:  # the refused registration must not surface at the next kernel launch
                clear()
            try:
                return torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=True)
            except RuntimeError:
                return buffer
        self._unpin = weakref.finalize(buffer, pin.unpin_memory, buffer.data_ptr())
        self._unpin.atexit = False  # not after the CUDA context is gone
        return buffer

    def copy(self, tensors: list) -> Optional[torch.cuda.Event]:
        """Copy ``[(key, tensor)]`` into the slots; returns the CUDA event that marks the GPU copies done
        (``None``: all copies are done)."""
        slots = self.slots_for(tensors)
        cuda = [(slots[k], t) for k, t in tensors if t.is_cuda]
        with torch.no_grad():
            for k, t in tensors:
                if not t.is_cuda:
                    slots[k].copy_(t)
            if not cuda:
                return None
            device = cuda[0][1].device
            if self.stream is None or self.stream.device != device:
                self.stream = torch.cuda.Stream(device)
            self.stream.wait_stream(torch.cuda.current_stream(device))  # after the step that produced them
            with torch.cuda.stream(self.stream):
                for slot, t in cuda:
                    slot.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def release(self) -> None:
        if self._unpin is not None:
            self._unpin()
        self.layout, self.buffer, self.slots, self._unpin = None, None, {}, None


_COPIES: "weakref.WeakKeyDictionary[nn.Module, _HostCopies]" = weakref.WeakKeyDictionary()


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer that stages through :class:`_HostCopies` (DCP's ``AsyncStager`` protocol: it is
    asked for the training-safe copy on the caller's thread) and writes once the GPU copies are done."""

    _synchronize_after_execute = False

    def __init__(self, path: str, copies: _HostCopies):
        # per_thread_copy_ahead=0: the data is on the host already (no device copy-ahead stream)
        super().__init__(path, per_thread_copy_ahead=0)
        self._copies, self.copied = copies, None

    def stage(self, sd):
        tensors = value_tensors(sd)
        self.copied = self._copies.copy(tensors)
        return over_copies(sd, self._copies.slots, dist.get_rank())

    def synchronize_staging(self) -> None:
        pass

    def write_data(self, plan, planner):
        if self.copied is not None:
            self.copied.synchronize()
        return super().write_data(plan, planner)


# -- the optimizer waits for the GPU copies -----------------------------------------------------------------

class _StepGuard:
    """An optimizer step pre-hook: the step's kernels wait (on the GPU) for the staging copies."""

    def __init__(self):
        self.event: Optional[torch.cuda.Event] = None

    def __call__(self, optimizer, args, kwargs):
        event, self.event = self.event, None
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


_GUARDS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _StepGuard]" = weakref.WeakKeyDictionary()


def _guard(optimizer, event) -> None:
    guard = _GUARDS.get(optimizer)
    if guard is None:
        guard = _GUARDS[optimizer] = _StepGuard()
        optimizer.register_step_pre_hook(guard)
    guard.event = event


# -- async_save ---------------------------------------------------------------------------------------------

def async_save(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
               step: int = 0, lr_scheduler=None, dataloader=None, rng: bool = False,
               extra: Optional[dict] = None) -> CheckpointFuture:
    """:func:`~.dcp_io.save` in the background: returns once the state is copied to host memory (on a GPU:
    once the copies are queued), while DCP writes it; the future's ``result()`` is ``path`` once every rank's
    files are written and the directory is published, or raises :class:`CheckpointError`.

    >>> fut = sp.checkpoint.async_save(sp.checkpoint.step_dir("ckpt", step), model, opt, step=step)
    >>> fut.result()      # later: the path, published

    Same checkpoint as ``save`` (``load`` reads either), the run's state (``lr_scheduler``, ``dataloader``,
    ``rng``, ``extra``) included, taken when ``async_save`` is called. A second call waits for the first to finish.
    """
    run = RunState(lr_scheduler, dataloader, rng, extra)
    settle(raise_unobserved=True)
    eng = engine_of(model)
    pg = checkpoint_group()
    rank = dist.get_rank() if pg is not None else 0
    with quiet_sharded_tensor():
        sd = state_dict(model, optimizer)
    sd["extra"] = {"step": torch.tensor(step)}
    sd.update(saved_entries(run, eng.plan, eng.groups.world, eng.rank))  # objects as bytes: nothing to stage
    tmp = f"{path.rstrip('/')}.tmp-{uuid.uuid4().hex[:8]}"
    tmp = C.broadcast_object(tmp, pg)
    copies = _COPIES.get(model)
    if copies is None:
        copies = _COPIES[model] = _HostCopies()
    writer = _Writer(tmp, copies)
    fut = CheckpointFuture(path, step)
    fut._tmp = tmp
    try:
        written = dcp.async_save(sd, storage_writer=writer, process_group=pg)
    except Exception as exc:
        raise CheckpointError(f"async save to {path}: staging failed on rank {rank}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(written, concurrent.futures.Future):  # AsyncSaveResponse (torch >= 2.9 with async staging)
        written = written.upload_completion
    fut._copied = writer.copied
    if writer.copied is not None:
        if optimizer is not None:
            _guard(optimizer, writer.copied)
        else:
            writer.copied.synchronize()  # nothing would wait for the copies: finish them now
    marker = {**dcp_io._about(eng.plan, step, "module", optimizer, run), "world_size": eng.groups.world.size}
    with _LOCK:
        _INFLIGHT[:] = [fut]
    threading.Thread(target=_publish_when_written, args=(fut, written, tmp, path, pg, rank, marker),
                     name="shardplan-checkpoint-publish").start()
    return fut


def _publish_when_written(fut: CheckpointFuture, written, tmp: str, path: str, pg, rank: int, marker: dict) -> None:
    """The background end of :func:`async_save`: every rank's DCP write finished -> rank 0 publishes."""
    import shutil
    try:
        failure = ""
        try:
            written.result()
        except BaseException as exc:  # noqa: BLE001 - reported through the future, on every rank
            failure = f"rank {rank}: {type(exc).__name__}: {exc}"
        failures = C.all_gather_objects(failure, pg)  # every rank learns whether every rank's write succeeded
        failures = [f for f in failures if f]
        status = ""
        if rank == 0:
            try:
                if failures:
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    dcp_io.publish_directory(tmp, path, {**marker, "time": time.time()})
            except Exception as exc:  # noqa: BLE001
                status = f"rank 0 could not publish {tmp} as {path}: {type(exc).__name__}: {exc}"
        status = C.broadcast_object(status, pg)
        if failures:
            raise CheckpointError(f"async save to {path} (step {fut.step}) failed; nothing was published, the "
                                  f"previous checkpoint is intact: " + "; ".join(failures[:4]))
        if status:
            raise CheckpointError(f"async save to {path} (step {fut.step}): {status}")
        fut.set_result(path)
    except BaseException as exc:  # noqa: BLE001
        if not isinstance(exc, CheckpointError):
            exc = CheckpointError(f"async save to {path} (step {fut.step}) failed: {type(exc).__name__}: {exc}")
        fut.set_exception(exc)


def _register() -> None:
    if settle not in dcp_io.SETTLERS:  # sync saves and loads wait for an asynchronous save in flight
        dcp_io.SETTLERS.append(settle)


_register()
