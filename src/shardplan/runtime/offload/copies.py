"""The copies between the device and the host: gradients out (``copy_d2h``), stepped masters or hosted
parameter shards in (``copy_h2d``), on a side stream per direction on CUDA. Methods of
:class:`~shardplan.runtime.offload.OffloadState` (a mixin of it)."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..capture import session as CAP
from ..storage import alloc_storage, free_storage
from .host import HostBuffer, stamp


class HostCopies:
    """The copies of :class:`~shardplan.runtime.offload.OffloadState` (``self.hosts``, ``self.cuda``, the two
    copy streams and ``self.exe`` are its own)."""

    def copy_grads(self, hosts: list[HostBuffer]) -> None:
        """The reduced local gradients of ``hosts`` to host memory (a side stream on CUDA)."""
        with self._side(self.d2h_stream):
            for hb in hosts:
                dsts, srcs = [], []
                for m in hb.trainable:
                    g = m.local.grad
                    if m.held and g is not None:
                        src = g.detach().reshape(-1)  # (a copy, when strided, made on the copy stream itself)
                        dsts.append(hb.grad[m.shard])
                        srcs.append(src)
                        if self.cuda:  # [Note: keeping copies' tensors alive]: made on the compute stream
                            g.record_stream(self.d2h_stream)
                    hb.copied[m.index] = stamp(g)
                if dsts:
                    torch._foreach_copy_(dsts, srcs, non_blocking=self.cuda)
                hb.scales.clear()
                hb.d2h = self._event(self.d2h_stream)
                if self.cuda and CAP.capturing() and self._overlapping():  # [Note: the replay's host step
                    hb.landed.append(self._landed(hb.d2h, hb.h2d if hb.params else None))  # overlaps] (steps.py)
        if CAP.as_graph():  # (the captured step's opt.step() must use them: checked at the end of the call)
            self.graph_copies = True

    def copy_params(self, hosts: list[HostBuffer], before_gather: bool = False) -> None:
        """The stepped master shards on the device before anything reads them (idempotent): waits for these
        buffers' host steps only ([Note: the host step overlaps the next forward]). A hosted parameter shard
        ([Note: hosted parameter shards]) is copied in for the all-gather that follows. ``before_gather``
        (ZeRO-3's copy before a unit's forward gather): only the gather reads a sharded buffer's shard, so a
        gather that runs on the gather stream waits for the copy, not the compute stream."""
        for hb in hosts:
            if hb.inflight is not None:
                self._land(hb, block=True)
            if hb.params:
                self._stage(hb)
                continue
            if hb.dirty:
                self._issue_h2d(hb)
            if self.cuda and hb.h2d is not None:
                bp = hb.b.bp
                if before_gather and bp.sharded and self.exe.comm.groups.gather(bp.axes).pg is not None:
                    self.exe.comm.streams.side_waits("gather", hb.h2d)
                else:
                    torch.cuda.current_stream().wait_event(hb.h2d)

    def _stage(self, hb: HostBuffer) -> None:
        """offload="params": allocate the device shard and copy the master into it on the host-to-device
        stream; the gather stream (not the compute stream) waits for the copy, so a prefetched copy overlaps
        the compute before it."""
        if hb.staged:
            return
        alloc_storage(hb.b.shard)  # on the compute stream, like every buffer ([Note: streams], streams.py)
        if self.cuda:
            self.h2d_stream.wait_stream(torch.cuda.current_stream())
        with (torch.cuda.stream(self.h2d_stream) if self.cuda else contextlib.nullcontext()):
            with torch.no_grad():
                hb.device_view.copy_(hb.master, non_blocking=self.cuda)
            hb.h2d = self._event(self.h2d_stream)
        if self.exe.comm.groups.gather(hb.b.bp.axes).pg is not None:
            self.exe.comm.streams.side_waits("gather", hb.h2d)
        elif self.cuda:  # a gather that moves nothing (a shard group of one) copies on the compute stream
            torch.cuda.current_stream().wait_event(hb.h2d)
        hb.staged = True

    def gathered(self, indices) -> None:
        """The all-gather of these buffers completed (the compute stream waited for it): the device copies
        of hosted parameter shards are freed until the next gather's ``copy_h2d``."""
        for i in indices:
            hb = self.hosts.get(i)
            if hb is not None and hb.params and hb.staged:
                free_storage(hb.b.shard)
                hb.staged = False

    def hosted_shard(self, index: int) -> Optional[torch.Tensor]:
        """The host master of buffer ``index`` when its parameter shard is hosted, else ``None``."""
        hb = self.hosts.get(index)
        if hb is None or not hb.params:
            return None
        self.settle()
        return hb.master

    def hosted_value(self, name: str) -> Optional[torch.Tensor]:
        """A view of parameter ``name``'s host master when its shard is hosted, else ``None``."""
        v = self.values.get(name)
        if v is not None:
            self.settle()
        return v
    def _issue_h2d(self, hb: HostBuffer, after=None) -> None:
        """The master to the device shard, non-blocking on the host-to-device stream. ``after``: an event
        the copy waits for (the device's last read of the shard); else everything issued so far. A hosted
        parameter shard has no device copy between gathers: the next gather's ``copy_h2d`` copies it."""
        if hb.params:
            hb.dirty = False
            return
        if self.cuda:
            if after is not None:
                self.h2d_stream.wait_event(after)
            else:
                self.h2d_stream.wait_stream(torch.cuda.current_stream())
        with (torch.cuda.stream(self.h2d_stream) if self.cuda else contextlib.nullcontext()):
            with torch.no_grad():
                hb.b.shard.copy_(hb.master, non_blocking=self.cuda)
            hb.h2d = self._event(self.h2d_stream)
        hb.dirty = False

    def finish_step(self) -> None:
        """After the host step: anything the compute stream runs next sees the new shards."""
        if self.cuda:
            for hb in self.hosts.values():
                if hb.h2d is not None:
                    torch.cuda.current_stream().wait_event(hb.h2d)
    # -- helpers ------------------------------------------------------------------------------------------
    def _side(self, stream):
        if not self.cuda:
            return contextlib.nullcontext()
        stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(stream)

    def _overlapping(self) -> bool:
        """Whether a replay's host step may start before the segment ends: an optimizer that steps each buffer
        as its gradient lands (overlap, no clipping: clipping needs the norm of every gradient first)."""
        opt = self.optimizer_ref() if self.optimizer_ref is not None else None
        return opt is not None and opt.overlap and opt.max_grad_norm is None

    def _landed(self, copied, staged=None):
        """An external event (a graph node the host can wait on) a replay records once ``copied`` (the gradient
        copy's event) is done, and ``staged`` (a hosted parameter shard's last copy in, read from the master the
        host step writes: the eager worker waits for it too); on a stream of its own, so that the copy stream's
        last captured node stays a copy ([Note: the replay's host step overlaps])."""
        if self.signal_stream is None:
            self.signal_stream = torch.cuda.Stream(self.exe.device)
        self.signal_stream.wait_event(copied)
        if staged is not None:
            self.signal_stream.wait_event(staged)
        ev = torch.cuda.Event(external=True)
        ev.record(self.signal_stream)
        return ev

    def _event(self, stream):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev
