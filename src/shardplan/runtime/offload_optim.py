"""The optimizer of an offloaded model: AdamW whose offloaded buffers step on the host.

>>> plan = sp.plan(model, rules, sp.Mesh(dp=8), offload="optimizer")
>>> sp.shard(model, plan)
>>> opt = sp.offload_optimizer(model, lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)   # AdamW's hyper-parameters
>>> loss.backward(); opt.step(); opt.zero_grad()      # the host steps run during backward and the next forward

It is a ``torch.optim.Optimizer`` over the local shards (``model.parameters()``), with torch AdamW's
state per parameter (``step``, ``exp_avg``, ``exp_avg_sq``): learning-rate schedulers, ``state_dict()``
and ``shardplan.checkpoint`` treat it like ``torch.optim.AdamW``, and a checkpoint of either loads into
the other. The state of an offloaded buffer *is* a view of its flat host tensors; the rest lives on
the device and steps there (``offload_fraction < 1``), with the same kernels.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..errors import RuntimeShardingError
from .capture import session as CAP
from .builder import engine_of
from .offload.host import STATS
from .offload.kernels import _by_step, adamw  # noqa: F401  (the kernel both sides share)
from .api import clip_grad_norm_


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW over a sharded model's local shards; offloaded buffers step on the host (see the module)."""

    _shardplan_offload = True  # the optimizer check (runtime/identity.py) accepts it for offloaded models

    def __init__(self, model: nn.Module, lr=1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, fused: Optional[bool] = True, overlap: bool = True,
                 max_grad_norm: Optional[float] = None, overlap_forward: bool = False):
        eng = engine_of(model)
        self._engine = eng
        self._model = weakref.ref(model)
        self._host = eng.offload
        self.fused = fused
        self.overlap = bool(overlap)  # host steps during backward ([Note: the overlapped step], runtime/offload/)
        # ... and into the next forward: step() returns before the host steps end (opt in: see offload_optimizer)
        self.overlap_forward = self.overlap and bool(overlap_forward)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.last_grad_norm: Optional[torch.Tensor] = None  # the global norm step() clipped by (max_grad_norm)
        members = [(b, m) for u in eng.unit_list for b in u.buffers for m in b.members if m.info.requires_grad]
        if not members:
            raise RuntimeShardingError("shardplan.offload_optimizer: the model has no parameter that requires grad")
        super().__init__([m.local for _, m in members], dict(lr=lr, betas=tuple(betas), eps=eps,
                                                               weight_decay=weight_decay))
        hosts = self._host.hosts if self._host is not None else {}
        self._device: list = []  # (local shard) of buffers stepped on the device
        for b, m in members:
            hb = hosts.get(b.bp.index)
            lp = m.local
            if hb is not None:  # views of the flat host tensors: a checkpoint load writes straight into them
                shape = m.piece.shape
                self.state[lp] = {"step": hb.steps[m.index], "exp_avg": hb.exp_avg[m.shard].view(shape),
                                  "exp_avg_sq": hb.exp_avg_sq[m.shard].view(shape)}
            else:
                self.state[lp] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(lp.detach()),
                                  "exp_avg_sq": torch.zeros_like(lp.detach())}
                self._device.append(lp)
        # the host buffers in the order their gradients arrive (the last unit's first): the first copies
        # back to the device start while later buffers still step
        order = {u.name: k for k, u in enumerate(reversed(eng.plan.units[1:]))}
        self._hosts = sorted(hosts.values(), key=lambda hb: order.get(hb.b.bp.unit, len(order)))
        forward = {u.name: k for k, u in enumerate(eng.plan.units)}
        self._forward_order = sorted(hosts.values(), key=lambda hb: forward.get(hb.b.bp.unit, len(forward)))
        if self._host is not None:
            self._host.optimizer_ref = weakref.ref(self)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        if self.max_grad_norm is not None:  # no host step ran yet (clipping turns the overlap off)
            model = self._model()
            if model is None:
                raise RuntimeShardingError("shardplan.offload_optimizer: the model was garbage-collected")
            self.last_grad_norm = clip_grad_norm_(model, self.max_grad_norm)
        if CAP.as_graph():  # [Note: offload under capture] (runtime/offload/)
            self._graph_step()
            return loss
        dev = [p for p in self._device if p.grad is not None]
        if dev:  # first: on a GPU these kernels run while the host finishes its steps
            st = [self.state[p] for p in dev]
            adamw(dev, [p.grad for p in dev], [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st],
                  [s["step"] for s in st], group, None)
        stepped = self._host.claim(group) if self._host is not None else set()  # those queued in backward
        # to the worker in forward order (the one the next forward needs first, first); in opt.step() itself
        # in gradient order (the first copies back start while later buffers still step)
        for hb in self._forward_order if self.overlap else self._hosts:
            if hb.b.bp.index not in stepped:
                if self.overlap:  # in the worker, overlapping the next forward
                    self._host.submit_step(hb, group, self.fused)
                else:
                    self._host.host_step(hb, group, self.fused)
        if self._host is not None:
            # [Note: the host step overlaps the next forward] (runtime/offload/): with overlap, no wait here;
            # each unit's copy_h2d before its next gather waits for that unit's step
            self._host.harvest() if self.overlap else self._host.finish_step()
            if self.overlap and not self.overlap_forward:  # torch's contract: after step() the parameters are new
                self._host.settle()
        return loss

    def _graph_step(self) -> None:
        """``step()`` in a captured step: the host work between the graph's segments, then the copies back."""
        device = [(p, p.grad) for p in self._device if p.grad is not None]  # (the graph's own gradient tensors)
        work = self._host.graph_work(self._hosts) if self._host is not None else []
        CAP.host_call(functools.partial(self._replayed_step, device, work))
        if self._host is not None:
            self._host.graph_landing(work)

    @torch.no_grad()
    def _replayed_step(self, device: list, work: list) -> None:
        group = self.param_groups[0]  # read at every replay, as eagerly: a schedule may set a Python lr
        ready = None
        if self._host is not None and self._host.cuda:  # the segment before: its gradients on the host
            ready = torch.cuda.Event()
            ready.record()
        if device:  # the buffers kept on the device: launched here, running while the host steps (their step
            st = [self.state[p] for p, _ in device]  # counts live on the host)
            adamw([p for p, _ in device], [g for _, g in device], [s["exp_avg"] for s in st],
                  [s["exp_avg_sq"] for s in st], [s["step"] for s in st], group, None)
        if self._host is not None:
            self._host.graph_host_step(work, group, self.fused, ready)

    def graph_constants(self) -> dict:
        """What a captured step bakes into its graph (compared before every replay; the hyper-parameters are read
        by the host step at every replay, as eagerly)."""
        return {"max_grad_norm": self.max_grad_norm}

    def synchronize(self) -> None:
        """Wait for the host steps still running (they overlap the next forward) and put their shards on the
        device: call it before reading ``model.parameters()`` directly between ``step()`` and the next forward.
        shardplan's own readers (checkpoints, ``state_dict``) do it themselves."""
        if self._host is not None:
            self._host.settle()

    def state_dict(self):
        self.synchronize()  # the state tensors are the host tensors the worker may still write
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.synchronize()
        super().load_state_dict(state_dict)

    def host_stats(self, reset: bool = False) -> dict:
        """Seconds the host steps took (``host_step_s``; ``kernel_s`` of them in the AdamW kernels, the rest
        waiting for the gradient's copy to the host) and how many of them ``step()`` waited for
        (``exposed_s``; the rest overlapped backward: ``hidden_s``), summed since the start (or the last
        reset); ``steps``: buffer steps, ``overlapped``: those that ran during backward; ``recopied``:
        gradients copied to the host again at the step (changed after their copy, other than by clipping);
        ``threads``: the CPU threads torch's kernels use."""
        self.synchronize()  # (the host steps still overlapping the next forward land first)
        st = dict(self._host.stats) if self._host is not None else dict(STATS)
        st["threads"] = torch.get_num_threads()
        st["hidden_s"] = max(st["host_step_s"] - st["exposed_s"], 0.0)
        if reset and self._host is not None:
            self._host.stats.update(STATS)
        return st


def offload_optimizer(model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                      weight_decay: float = 1e-2, *, fused: Optional[bool] = True, overlap: bool = True,
                      max_grad_norm: Optional[float] = None, overlap_forward: bool = False) -> OffloadAdamW:
    """AdamW for a model sharded with an offloading plan (``plan(..., offload="optimizer")``): the offloaded
    buffers' master shards and moments live in host memory and step there; hyper-parameters as
    ``torch.optim.AdamW``'s. ``fused``: torch's fused kernel for the host step (``None``: torch's default).

    ``overlap`` (default): each offloaded buffer steps on the host as soon as its gradient arrived there,
    while backward goes on; ``step()`` waits for those steps. The learning rate must then be set before
    backward (``scheduler.step()`` right after ``opt.step()`` does that), and gradients are not changed
    after backward: ``max_grad_norm=`` clips by the global norm inside ``step()`` (the host steps then run
    in ``step()``, after the norm: clipping needs every gradient). ``overlap=False``: every host step
    runs in ``step()``, and ``shardplan.clip_grad_norm_`` / learning-rate changes after backward work.

    ``overlap_forward=True`` (opt in): ``step()`` returns without waiting for the host steps, which go on
    while the next forward runs; each unit's copy back to the device waits for its own step only
    ([Note: the host step overlaps the next forward]). Until that forward, ``model.parameters()`` hold the
    values before the step: call ``opt.synchronize()`` before reading them yourself (an EMA, a logged norm).
    shardplan's own readers (checkpoints, ``state_dict``) wait by themselves. Off by default: after
    ``step()`` the parameters are the new ones, as with every torch optimizer.

    >>> opt = shardplan.offload_optimizer(model, lr=3e-4, weight_decay=0.1)
    >>> loss.backward(); opt.step(); opt.zero_grad()

    Also runs a plan without offload (every buffer steps on the device), so one training script serves both.
    """
    return OffloadAdamW(model, lr, betas, eps, weight_decay, fused=fused, overlap=overlap, max_grad_norm=max_grad_norm,
                        overlap_forward=overlap_forward)
