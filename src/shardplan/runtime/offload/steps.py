"""The host step: handed to the worker during backward where that gives ``opt.step()``'s result ([Note: the
overlapped step]), claimed and checked by ``opt.step()``, landed (its copy back issued) when done; or run in
``opt.step()``. Methods of :class:`~shardplan.runtime.offload.OffloadState` (a mixin of it)."""

from __future__ import annotations

import time
from typing import Optional

import torch

from ...errors import RuntimeShardingError
from ..capture import session as CAP
from ..host_worker import HostWorker
from ..streams import join
from . import kernels
from .host import HostBuffer, HostStep, InFlightStep, _hyper, _snapshot, holds, stamp


class HostSteps:
    """The host steps of :class:`~shardplan.runtime.offload.OffloadState` (its ``hosts``, ``stats``, ``worker``,
    ``priority``, ``submitted`` and ``optimizer_ref``; the copies are :class:`~.copies.HostCopies`')."""

    # -- the overlapped host step ([Note: the overlapped step]) --------------------------------------------
    def start_steps(self, hosts: list[HostBuffer]) -> None:
        """``optim_step``: hand the host steps of ``hosts`` to the worker, where that gives opt.step()'s result."""
        opt = self.optimizer_ref() if self.optimizer_ref is not None else None
        if opt is None or not opt.overlap or opt.max_grad_norm is not None or CAP.as_graph():
            return  # the step runs in opt.step() (under capture: [Note: offload under capture])
        used = self.exe.grads.used
        group = opt.param_groups[0]
        for hb in hosts:
            if hb.state == HostStep.QUEUED:
                raise RuntimeShardingError(
                    f"shardplan: the host stepped buffer #{hb.b.bp.index} in the previous synchronising backward, "
                    f"but opt.step() was not called before this one: with the overlapped host step every "
                    f"synchronising backward is an optimizer step. Call opt.step() after each (no_sync for "
                    f"accumulation), or build the optimizer with shardplan.offload_optimizer(..., overlap=False)")
            if not all(used[m.index] for m in hb.trainable):
                continue  # a gradient may still become None at end_backward: opt.step() decides
            active = [m for m in hb.trainable if m.local.grad is not None]
            if not active:
                continue
            if hb.inflight is not None:  # (the last step's, landed by the forward in every normal loop)
                self._land(hb, block=True)
            self._submit(hb, active, group, opt.fused, in_backward=True)
            hb.state = HostStep.QUEUED
            self.submitted.append(hb)

    def _submit(self, hb: HostBuffer, active: list, group: dict, fused: Optional[bool], in_backward: bool) -> None:
        """Hand ``hb``'s AdamW to the worker ([Note: host step order]); the copy back waits for ``ready``."""
        ready = self._event(torch.cuda.current_stream()) if self.cuda else None
        fut = self._pool().submit(self.priority.get(hb.b.bp.unit, len(self.priority)), kernels._host_compute,
                                  (hb, active, _snapshot(group), fused, hb.d2h, hb.h2d), ready=hb.d2h)
        hb.hyper = _hyper(group)
        hb.inflight, hb.d2h = InFlightStep(fut, hb.hyper, ready, in_backward), None

    def harvest(self) -> None:
        """Issue the copy back of every host step the worker finished (without waiting for the others)."""
        for hb in self.hosts.values():
            if hb.inflight is not None and hb.inflight.future.done():
                self._land(hb, block=False)

    def _land(self, hb: HostBuffer, block: bool) -> None:
        rec = hb.inflight
        t0 = time.perf_counter()
        seconds, kernel = rec.future.result()  # re-raises what the worker raised
        if block:
            self.stats["exposed_s"] += time.perf_counter() - t0
        self.stats["host_step_s"] += seconds
        self.stats["kernel_s"] += kernel
        self.stats["steps"] += 1
        self.stats["overlapped"] += rec.in_backward
        hb.inflight = None
        hb.dirty = True
        self._issue_h2d(hb, after=rec.ready)
        if hb.state == HostStep.CLAIMED:
            hb.state = HostStep.IDLE

    def claim(self, group: dict) -> set:
        """``opt.step()``: check the steps queued during backward are the steps it would take now, without
        waiting for them ([Note: the host step overlaps the next forward]); returns the indices of the
        buffers they step (opt.step() hands the others to the worker, or steps them itself)."""
        done = set()
        now = _hyper(group)
        submitted, self.submitted = self.submitted, []
        for hb in submitted:
            if hb.state != HostStep.QUEUED:
                continue
            rec = hb.inflight
            hb.state = HostStep.CLAIMED if rec is not None else HostStep.IDLE
            done.add(hb.b.bp.index)
            used = hb.hyper
            if used != now:
                raise RuntimeShardingError(
                    f"shardplan: the optimizer's hyper-parameters changed between backward and opt.step() ({used} "
                    f"-> {now}), but the host steps ran during backward with the old ones: set the learning rate "
                    f"(scheduler.step()) before backward, e.g. right after opt.step(), or build the optimizer with "
                    f"shardplan.offload_optimizer(..., overlap=False)")
            for m in hb.trainable:
                g = m.local.grad
                if hb.copied.get(m.index) is not None and not holds(hb.copied[m.index], g):
                    names = [x.name for x in hb.trainable]
                    which = repr(m.name)
                    if g is not None and hb.copied[m.index][0]() is g and len(names) > 1:  # only a version moved:
                        # views of one flat buffer share it ([Note: versions of scaled gradients]), any may have
                        which = (f"one of {', '.join(map(repr, names[:4]))}{', ...' if len(names) > 4 else ''} (views "
                                 f"of one flat buffer, sharing one version counter)")
                    raise RuntimeShardingError(
                        f"shardplan: the gradient of {which} changed after backward, but its host step already ran "
                        f"during backward with the gradient backward produced: to clip, pass max_grad_norm= to "
                        f"shardplan.offload_optimizer (it clips before stepping); to change gradients by hand, build "
                        f"it with overlap=False")
        return done

    def check_clip(self) -> None:
        """``sp.clip_grad_norm_`` is about to scale the gradients: impossible once host steps used them."""
        if any(hb.state == HostStep.QUEUED for hb in self.hosts.values()):
            raise RuntimeShardingError(
                "shardplan: clip_grad_norm_ after backward, but the host optimizer step of the offloaded buffers "
                "already ran during backward (overlapped) with the unclipped gradients: pass max_grad_norm= to "
                "shardplan.offload_optimizer(model, ..., max_grad_norm=1.0) (it clips by the global norm before its "
                "steps), or build it with overlap=False to keep calling clip_grad_norm_ yourself")

    def wait_all(self) -> None:
        """Finish every step in flight (before anything else reads or writes the host tensors)."""
        for hb in self.hosts.values():
            if hb.inflight is not None:
                self._land(hb, block=True)

    def settle(self) -> None:
        """Every host step done and its shard on the device, the compute stream after the copies: what a
        reader of the shards or the host state between ``opt.step()`` and the next forward calls first."""
        if any(hb.inflight is not None or hb.dirty for hb in self.hosts.values()):
            self.wait_all()
            for hb in self.hosts.values():
                if hb.dirty:
                    self._issue_h2d(hb)
        self.finish_step()

    # -- the host step in opt.step() ----------------------------------------------------------------------
    def copies_current(self) -> set:
        """The members whose host copy holds their device gradient as it is now: taken by ``sp.clip_grad_norm_``
        just before it scales the gradients (:meth:`grads_scaled`)."""
        out = set()
        for hb in self.hosts.values():
            for m in hb.trainable:
                g = m.local.grad
                if holds(hb.copied.get(m.index), g):
                    out.add((hb.b.bp.index, m.index))
        return out

    def grads_scaled(self, coef: torch.Tensor, current: set) -> None:
        """``sp.clip_grad_norm_`` multiplied the device gradients by ``coef``: do the same to the copies (under
        capture, the host step reads ``coef`` at each replay: [Note: offload under capture]). ``current``: the
        members whose copy held their gradient just before (:meth:`copies_current`); a copy of one changed
        before the clipping is stale and copied again at the step."""
        # [Note: versions of scaled gradients] the clipping's in-place multiply moves a gradient's version by
        # as many as the gradients that share its storage (views of one flat buffer share one version
        # counter, and the foreach multiply bumps it once per view), not by one: the copies it leaves current
        # are named before the multiply, not inferred from the version after it (they were all taken for
        # changed, and copied again, synchronously, at every clipped step).
        c = coef.detach() if CAP.as_graph() else coef.detach().to("cpu")
        for hb in self.hosts.values():
            hb.scales.append(c)
            for m in hb.trainable:
                g = m.local.grad
                if g is not None and (hb.b.bp.index, m.index) in current:
                    hb.copied[m.index] = stamp(g)

    def host_step(self, hb: HostBuffer, group: dict, fused: Optional[bool]) -> None:
        """AdamW on ``hb``'s master shard, on the CPU, in ``opt.step()``; then its copy back to the device."""
        t0 = time.perf_counter()
        active = self._prepare(hb)
        if not active:
            return
        _, kernel = kernels._host_compute(hb, active, group, fused, hb.d2h, hb.h2d)
        hb.d2h = None
        self._count_exposed(time.perf_counter() - t0, kernel)
        hb.dirty = True
        self._issue_h2d(hb)

    def submit_step(self, hb: HostBuffer, group: dict, fused: Optional[bool]) -> None:
        """``opt.step()``'s host step of a buffer that did not step during backward, handed to the worker:
        the gradients it reads are settled here (copied again, scaled); the next forward waits for it."""
        if hb.inflight is not None:
            self._land(hb, block=True)
        active = self._prepare(hb)
        if active:
            self._submit(hb, active, group, fused, in_backward=False)
            hb.state = HostStep.CLAIMED

    def _prepare(self, hb: HostBuffer) -> list:
        """The members of ``hb`` that step now, their host gradients made current (copied again when the
        device gradient changed after its copy, scaled by the clip coefficients applied since)."""
        active = []
        for m in hb.trainable:
            g = m.local.grad
            if g is None:  # no gradient this step: skipped, as torch's optimizers skip it
                continue
            if not holds(hb.copied.get(m.index), g):  # changed after its copy (or never copied): again
                if hb.d2h is not None:  # the pending copy into the host gradient lands first
                    hb.d2h.synchronize()
                    hb.d2h = None
                if m.held:
                    hb.grad[m.shard].copy_(g.detach().reshape(-1))
                    self.stats["recopied"] += 1
                hb.copied[m.index] = stamp(g)
                # [Note: a fresh copy holds whatever scaling the device gradient has: no pending scale]
                active.append((m, True))
            else:
                active.append((m, False))
        if not active:
            return []
        with torch.no_grad():
            for m, fresh in active:
                if hb.scales and not fresh and m.held:
                    if hb.d2h is not None:
                        hb.d2h.synchronize()
                        hb.d2h = None
                    for c in hb.scales:
                        hb.grad[m.shard].mul_(c.to(hb.grad.dtype))
            hb.scales.clear()
        return [m for m, _ in active]
    # -- under a captured step ([Note: offload under capture], runtime/offload/) ---------------------------
    def before_graph(self) -> None:
        """Before a step is captured: every host step done, its shard on the device, no copy in flight (a graph
        cannot wait for work issued before its capture)."""
        self.settle()
        if self.cuda:
            torch.cuda.synchronize(self.exe.device)
        self.after_graph()

    def after_graph(self) -> None:
        """After the capture: the copies' events it recorded belong to the graph (the host never waits on them)."""
        for hb in self.hosts.values():
            hb.d2h = hb.h2d = None
            hb.landed = []

    def graph_work(self, hosts: list[HostBuffer]) -> list:
        """``opt.step()`` under capture: per host buffer, the members that step, those whose gradient changed after
        its copy to the host (copied again here, in this segment, as ``_prepare`` does eagerly) and the clip
        coefficients to apply to the others' host gradients (device tensors the replay computes)."""
        self.join_streams()  # the gradients' copies ran on the side stream: this segment waits for them
        work = []
        for hb in hosts:
            active, fresh = [], set()
            for m in hb.trainable:
                g = m.local.grad
                if g is None:
                    continue
                active.append(m)
                if not holds(hb.copied.get(m.index), g):  # changed after its copy (not by clipping)
                    if m.held:
                        hb.grad[m.shard].copy_(g.detach().reshape(-1), non_blocking=self.cuda)
                        self.stats["recopied"] += 1  # (counted at the capture: the graph copies it every replay)
                    hb.copied[m.index] = stamp(g)
                    fresh.add(m.index)
            # (every external event the capture recorded stays with the host call, used or not: a graph's node
            # must not outlive its event)
            work.append((hb, active, fresh, list(hb.scales), hb.landed))
            hb.scales.clear()
            hb.landed = []
        self.graph_copies = False
        return work

    def replay_cut_short(self) -> None:
        """A replay stopped between its segments: host masters may be stepped without their copies to the device
        (the next ``settle``, before a capture, issues them)."""
        for hb in self.hosts.values():
            hb.dirty = True

    def join_streams(self) -> None:
        """Under capture: the compute stream after every copy issued so far (a graph's segment ends joined), and
        no event recorded in this segment left for the next one to wait on (it runs after this one ends)."""
        if self.cuda:
            join(self.d2h_stream)  # [Note: joining a side stream under capture], runtime/streams.py
            join(self.h2d_stream)
            if self.signal_stream is not None:
                join(self.signal_stream)
        for hb in self.hosts.values():
            hb.d2h = hb.h2d = None

    def graph_host_step(self, work: list, group: dict, fused: Optional[bool], ready=None) -> None:
        """The host steps of a replay, between its segments: the segment before is waited for (``ready``: an
        event recorded at its end; the gradients are on the host), each buffer's host gradient scaled as the
        clipping did, then AdamW, as the eager step does."""
        # [Note: the replay's host step overlaps] a replay's first segment runs asynchronously once launched;
        # each buffer's gradient copy in it records an external event (``HostBuffer.landed``, recorded at the
        # capture with cudaEventRecordExternal: a graph node the host can wait on, unlike the capture's own
        # events). The host steps the buffers in gradient order as each one's copy lands, while the graph's
        # backward goes on, as the eager step's worker does during backward ([Note: the overlapped step]).
        # The events are recorded only where that is the step: an optimizer that overlaps and does not clip
        # (``_overlapping``). With clipping, in the optimizer or by hand, every host step needs the coefficient
        # the segment computes after the backward: the host waits for ``ready`` (the segment's end); so does a
        # buffer whose gradient was copied again at the segment's end, and everything on the CPU. (Every event
        # the capture recorded stays with the host call: in a clipping step, before [Note: versions of scaled
        # gradients], each buffer counted as copied again and its event object was dropped during the capture,
        # and torch 2.11's capture_end segfaulted on an H100; the likely cause, not proven on a GPU.)
        for hb, active, fresh, scales, landed in work:
            if not active:
                continue
            if landed and not scales and not fresh:
                landed[-1].synchronize()
            elif ready is not None:
                ready.synchronize()
            hidden = ready is not None and not ready.query()  # the segment still runs: this step overlaps it
            t0 = time.perf_counter()
            if scales:
                with torch.no_grad():
                    for c in scales:
                        c = c.to("cpu")
                        for m in active:
                            if m.held and m.index not in fresh:
                                hb.grad[m.shard].mul_(c.to(hb.grad.dtype))
            _, kernel = kernels._host_compute(hb, active, group, fused, None, None)
            self._count_exposed(time.perf_counter() - t0, kernel, hidden)

    def graph_landing(self, work: list) -> None:
        """After the host steps (the next segment, under capture): the new master shards to the device, and what the
        compute stream runs next after them."""
        for hb, active, *_ in work:
            if active:
                self._issue_h2d(hb)
        self.finish_step()

    # -- helpers ------------------------------------------------------------------------------------------
    def _count_exposed(self, seconds: float, kernel: float, hidden: bool = False) -> None:
        """A host step the caller waited for (run in ``opt.step()`` or between a replay's segments; ``hidden``:
        it began while the replay's segment still ran, [Note: the replay's host step overlaps])."""
        self.stats["host_step_s"] += seconds
        self.stats["kernel_s"] += kernel
        self.stats["exposed_s"] += 0.0 if hidden else seconds
        self.stats["overlapped"] += hidden
        self.stats["steps"] += 1

    def _pool(self) -> HostWorker:
        if self.worker is None:  # one thread, the unit the next forward needs first, first
            self.worker = HostWorker()
        return self.worker
