"""The host side of one sharded model (``exe.offload``): its host buffers built at start-up, the schedule's host
ops dispatched to the copies and the steps, writes from outside a step, the host bytes; :func:`attach`."""

from __future__ import annotations

from typing import Optional

import torch

from ...planner.kinds import COPY_D2H, OPTIM_STEP, PRE_FORWARD
from ..storage import alias, free_storage
from ..host_worker import HostWorker
from .copies import HostCopies
from .host import STATS, HostBuffer, HostStep, _slabs
from .steps import HostSteps


class OffloadState(HostCopies, HostSteps):
    """The host side of one sharded model (``exe.offload``); built by :func:`attach`."""

    def __init__(self, exe):
        self.exe = exe
        self.cuda = exe.device.type == "cuda"
        # one stream per direction: PCIe copies both ways at once
        self.d2h_stream = torch.cuda.Stream(exe.device) if self.cuda else None
        self.h2d_stream = torch.cuda.Stream(exe.device) if self.cuda else None
        self.signal_stream = None  # captured steps: the replay's external events ([Note: the replay's host step overlaps])
        self.optimizer_ref = None         # weak reference to the OffloadAdamW stepping this model (it registers)
        self.worker: Optional[HostWorker] = None
        # the worker's priority of a unit's host step: its place in the forward ([Note: host step order])
        self.priority = {u.name: k for k, u in enumerate(exe.plan.units)}
        self.stats = dict(STATS)
        self.hosts: dict[int, HostBuffer] = {}
        self.submitted: list[HostBuffer] = []  # steps queued during backward, in the order they were queued
        self.values: dict[str, torch.Tensor] = {}  # offload="params": parameter name -> view of its host master
        self.graph_copies = False  # under capture: gradients copied to the host that no opt.step() used yet
        offloaded = [b for u in exe.unit_list for b in u.buffers if b.bp.offload]
        slabs = _slabs(offloaded, exe.device)
        for b in offloaded:
            n = b.shard.numel()
            master, grad, exp_avg, exp_avg_sq = slabs[b.bp.index]
            master.copy_(b.shard.detach())
            hb = HostBuffer(b, b.bp.offload, master=master, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
            hb.steps = {m.index: torch.tensor(0.0) for m in hb.trainable}
            self.hosts[b.bp.index] = hb
            if hb.params:  # [Note: hosted parameter shards]: the master is the shard; the device copy goes
                hb.device_view = alias(b.shard, 0, (b.shard.numel(),))  # (its own version counter)
                free_storage(b.shard)
                for m in b.members:
                    self.values[m.name] = hb.master[m.shard].view(m.piece.shape)

    # -- the schedule's ops (executor handlers) ------------------------------------------------------
    def run(self, op) -> None:
        hosts = [self.hosts[i] for i in op.buffers]
        if op.kind == COPY_D2H:
            self.copy_grads(hosts)
        elif op.kind == OPTIM_STEP:
            self.start_steps(hosts)
        else:
            self.copy_params(hosts, before_gather=op.event == PRE_FORWARD)
        self.harvest()

    def shards_changed(self) -> None:
        """The device shards were written outside a step (a checkpoint load): the masters follow them."""
        self.wait_all()
        for hb in self.hosts.values():
            if hb.h2d is not None:
                hb.h2d.synchronize()
            if not hb.params:  # a hosted parameter shard was written in its master (Executor.local_value)
                hb.master.copy_(hb.b.shard.detach())
            hb.dirty, hb.h2d, hb.state = False, None, HostStep.IDLE
        self.submitted = []

    # -- inspection --------------------------------------------------------------------------------------
    def host_bytes(self) -> int:
        """Bytes of host memory this rank's offload allocated: its slabs' storages (every host tensor is a view
        of one) and the step counts. ``plan.memory().host`` on CPU, ``plan.memory().host_pinned`` on CUDA
        (the slabs are powers of two there); the process's RSS adds Python, torch, CUDA and the model."""
        slabs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for hb in self.hosts.values() for t in (hb.master, hb.grad, hb.exp_avg, hb.exp_avg_sq) if t.numel()}
        steps = sum(t.untyped_storage().nbytes() for hb in self.hosts.values() for t in hb.steps.values())
        return sum(slabs.values()) + steps


def attach(exe) -> None:
    """Give an executor whose plan offloads its host side (``shard()`` calls this)."""
    exe.offload = OffloadState(exe) if exe.plan.offload else None
