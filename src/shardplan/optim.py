"""Pure optimizers over pytrees of local shards, in optax's shape: tensors in, tensors out.

>>> opt = sp.optim.adamw(lr=3e-4, weight_decay=0.1)
>>> state = opt.init(local_params)
>>> local_params, state = opt.update(grads, state, local_params)   # nothing the caller holds is changed
>>> local_params, state = opt.update(grads, state, local_params, donate=True)   # in place, as JAX donation
>>> opt = sp.optim.adamw(lr=sp.optim.warmup_cosine(3e-4, warmup=100, total=10_000))   # a schedule: lr(step)

Updates use ``torch._foreach_*`` with the arithmetic, in the order, of ``torch.optim.AdamW`` / ``SGD``, so
a shard trains bit for bit like the same elements under torch's optimizers. Out of place by default (the
new parameters and moments live beside the old ones until the caller drops them); ``donate=True`` gives
the inputs to the update, as JAX's buffer donation does: ``params`` and ``state`` are updated in place and
returned, so a step needs no second copy of them (the caller must not use the old trees afterwards: they
are the new ones). ``clip_by_global_norm`` needs the plan: a parameter replicated over some mesh axes is
counted once, not once per replica.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import optree
import torch

from .errors import ShardingError
from .schedules import (SCHEDULES, LearningRate, Schedule, ScheduleLR, as_lr_scheduler, by_name, constant,
                        cosine_decay, join, linear, linear_warmup, value_at, warmup_cosine)
from .planner import geometry as G
from .rules import leaves_with_paths
from .runtime import collectives as C
from .errors import CaptureError

__all__ = ["Optimizer", "adamw", "sgd", "trainable", "clip_by_global_norm",
           # learning-rate schedules (shardplan.schedules), here as in optax
           "SCHEDULES", "LearningRate", "Schedule", "ScheduleLR", "as_lr_scheduler", "by_name", "constant",
           "cosine_decay", "join", "linear", "linear_warmup", "value_at", "warmup_cosine"]


class Optimizer(NamedTuple):
    """``init(params) -> state`` and ``update(grads, state, params, donate=False) -> (params, state)``."""

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]


def _flat(tree, what: str, like=None):
    leaves, spec = optree.tree_flatten(tree)
    if like is not None and spec != like:
        raise ShardingError(f"{what} has another tree structure than the parameters: {spec} vs {like}")
    return leaves, spec


def trainable(plan) -> Callable[[str], bool]:
    """A ``mask`` for the optimizers: the parameters the plan's module trains (``requires_grad``)."""
    return lambda path: plan.param(path).requires_grad


_SELECTED: dict = {}


def _selected(params, mask) -> list[int]:
    """Indices of the leaves ``mask`` lets the optimizer change (all of them without a mask); once per
    tree structure and mask."""
    spec = optree.tree_structure(params)
    key = (spec, id(mask))
    if key not in _SELECTED:
        paths = leaves_with_paths(params)[0]
        _SELECTED[key] = (mask, [i for i, p in enumerate(paths) if mask is None or mask(p)])
    return _SELECTED[key][1]


# [Note: the update's temporaries] an elementwise update makes whole-list temporaries (adamw: the denominator
# and the step, each the size of the parameters it is given). Run over all the parameters at once, they would
# add twice the model's shard bytes to the peak (in a captured step, to the graph's pool); run over groups of
# at most GROUP_BYTES of parameters, they add at most twice that. Each element sees the same operations with
# the same scalars either way, so the results are bit for bit the same; only the kernels per group are more.
GROUP_BYTES = 256 << 20


def _groups(leaves: list, sel: list[int], limit: int) -> list[list[int]]:
    """``sel`` cut into runs of at most ``limit`` bytes of ``leaves`` (a larger leaf is a run of its own)."""
    out, cur, size = [], [], 0
    for i in sel:
        n = leaves[i].numel() * leaves[i].element_size()
        if cur and size + n > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    return out + [cur] if cur else out


def _masked(update_some, group_bytes: int = None):
    """Run ``update_some`` on the selected leaves only (in groups of at most ``group_bytes`` of the first
    list's leaves: [Note: the update's temporaries]); the others, and their state, pass through."""
    def run(lists: list[list], sel: list[int]):
        out = None
        for idx in (_groups(lists[0], sel, group_bytes) if group_bytes else [sel]) or [[]]:
            picked = update_some(*[[xs[i] for i in idx] for xs in lists])
            if out is None:
                out = [list(xs) for xs in lists[:len(picked)]]
            for new, old in zip(picked, out):
                for i, t in zip(idx, new):
                    old[i] = t
        return out
    return run


def _step_tensor(leaves, capturable) -> torch.Tensor:
    """The step count: on the host, or on the parameters' device for a captured step (``capturable``)."""
    dev = leaves[0].device if leaves else torch.device("cpu")
    on_device = bool(capturable)
    return torch.zeros((), dtype=torch.float32, device=dev if on_device else "cpu")


def _device_step(step: torch.Tensor) -> bool:
    return step.device.type != "cpu" or getattr(step, "_shardplan_capturable", False)


class _AdamW(NamedTuple):
    """AdamW's hyper-parameters (``lr``: a number or a schedule)."""
    lr: LearningRate
    b1: float
    b2: float
    eps: float
    weight_decay: float


def _decay_and_moments(p, g, m, v, decay, h: _AdamW, donate: bool):
    """Weight decay and both moments: new tensors, or in place on the inputs when ``donate``."""
    if donate:
        torch._foreach_mul_(p, decay)
        torch._foreach_lerp_(m, g, 1 - h.b1)
        torch._foreach_mul_(v, h.b2)
    else:
        p = torch._foreach_mul(p, decay)
        m = torch._foreach_lerp(m, g, 1 - h.b1)
        v = torch._foreach_mul(v, h.b2)
    torch._foreach_addcmul_(v, g, g, value=1 - h.b2)
    return p, m, v


def _adamw_device(h: _AdamW, p, g, m, v, t, donate=False):
    """One AdamW update with step tensor ``t`` (no host read). [Note: the update without a host read] the same
    arithmetic as :func:`_adamw_host`, its scalars as 0-d tensors computed in float64 on the device from the step
    tensor, cast to the parameters' dtype where Python's floats would be: every kernel sees the same scalar
    values, so the results are bit-identical"""
    lr_t = value_at(h.lr, t - 1)
    tt = t.to(torch.float64)
    bc1, bc2 = 1 - h.b1 ** tt, 1 - h.b2 ** tt
    dt = p[0].dtype if p else torch.float32
    p, m, v = _decay_and_moments(p, g, m, v, (1 - lr_t * h.weight_decay).to(dt), h, donate)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2.sqrt().to(dt))
    torch._foreach_add_(denom, h.eps)
    scale = (-lr_t / bc1).to(dt)
    if p and p[0].device.type == "cpu":  # addcdiv's own order of operations on each device
        upd = torch._foreach_mul(m, scale)
        torch._foreach_div_(upd, denom)
    else:
        upd = torch._foreach_div(m, denom)
        torch._foreach_mul_(upd, scale)
    torch._foreach_add_(p, upd)
    return p, m, v


def _adamw_host(h: _AdamW, p, g, m, v, t, donate=False):
    """One AdamW update at step ``t`` (a float): one new tensor per output (params, moments) plus one temporary,
    then in place on those only; donated: in place on the inputs, one temporary (the denominator), as
    ``torch.optim.AdamW(foreach=True)``."""
    lr_t = value_at(h.lr, int(t) - 1)
    bc1, bc2 = 1 - h.b1 ** t, 1 - h.b2 ** t
    p, m, v = _decay_and_moments(p, g, m, v, 1 - lr_t * h.weight_decay, h, donate)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, math.sqrt(bc2))
    torch._foreach_add_(denom, h.eps)
    torch._foreach_addcdiv_(p, m, denom, value=-lr_t / bc1)
    return p, m, v


def adamw(lr: LearningRate = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 1e-2, mask: Callable[[str], bool] = None, capturable: bool = False) -> Optimizer:
    """AdamW (decoupled weight decay), as ``torch.optim.AdamW``. State: ``{"step", "exp_avg", "exp_avg_sq"}``.

    ``lr`` is a number or a schedule (``sp.optim.warmup_cosine(...)``): update ``t`` (from 0) uses ``lr(t)``.
    ``mask(path) -> bool`` picks the leaves to train (``trainable(plan)``: those that require grad); the
    others keep their values, as torch's optimizers skip parameters without gradients. ``capturable``: the
    step count lives on the parameters' device and the update reads nothing on the host, so the step can be
    captured (``sp.capture``). The two paths compute the same formula with the same scalars; on the CPU they
    agree bit for bit, on a GPU to the last bit of fp32 rounding (the fused addcdiv is split in two).

    >>> opt = sp.optim.adamw(lr=sp.optim.warmup_cosine(3e-4, warmup=100, total=10_000), weight_decay=0.1)
    """
    h = _AdamW(lr, *betas, eps, weight_decay)

    def init(params):
        leaves, spec = _flat(params, "params")
        zeros = lambda: optree.tree_unflatten(spec, [torch.zeros_like(p) for p in leaves])
        step = _step_tensor(leaves, capturable)
        if capturable and step.device.type == "cpu":
            step._shardplan_capturable = True  # the device path on the CPU (tests, backend="eager")
        return {"step": step, "exp_avg": zeros(), "exp_avg_sq": zeros()}

    def update(grads, state, params, donate: bool = False):
        p, spec = _flat(params, "params")
        g, _ = _flat(grads, "grads", spec)
        m, _ = _flat(state["exp_avg"], "exp_avg", spec)
        v, _ = _flat(state["exp_avg_sq"], "exp_avg_sq", spec)
        old = state["step"]
        on_device = _device_step(old)
        if donate and on_device:
            step = old.add_(1)  # in place: a captured step's count advances every replay
        else:
            step = old + 1
            if on_device and old.device.type == "cpu":
                step._shardplan_capturable = True
        run = _adamw_device if on_device else _adamw_host
        if not on_device and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise CaptureError("sp.optim.adamw: the step count is read on the host, which a captured step cannot do; "
                               "build the optimizer with sp.optim.adamw(..., capturable=True)")
        t = step if on_device else float(step)
        with torch.no_grad():
            p, m, v = _masked(lambda p_, g_, m_, v_: run(h, p_, g_, m_, v_, t, donate), GROUP_BYTES)(
                [p, g, m, v], _selected(params, mask))
        rebuild = lambda xs: optree.tree_unflatten(spec, xs)
        return rebuild(p), {"step": step, "exp_avg": rebuild(m), "exp_avg_sq": rebuild(v)}

    return Optimizer(init, update)


def sgd(lr: LearningRate, momentum: float = 0.0, weight_decay: float = 0.0, mask: Callable[[str], bool] = None) -> Optimizer:
    """SGD with optional momentum and (coupled) weight decay, as ``torch.optim.SGD``; ``lr`` (a number or a
    schedule) and ``mask`` as for adamw."""

    def init(params):
        leaves, spec = _flat(params, "params")
        return {"momentum_buffer": optree.tree_unflatten(spec, [torch.zeros_like(p) for p in leaves]),
                "step": torch.tensor(0.0)}

    def update(grads, state, params, donate: bool = False):
        p, spec = _flat(params, "params")
        g, _ = _flat(grads, "grads", spec)
        buf, _ = _flat(state["momentum_buffer"], "momentum_buffer", spec)
        first = float(state["step"]) == 0
        lr_t = value_at(lr, int(state["step"]))

        def step_some(p_, g_, b_):
            if weight_decay:
                g_ = torch._foreach_add(g_, p_, alpha=weight_decay)
            if momentum:
                if first:
                    b_ = [x.clone() for x in g_]
                elif donate:
                    torch._foreach_mul_(b_, momentum)
                    torch._foreach_add_(b_, g_)
                else:
                    b_ = torch._foreach_add(torch._foreach_mul(b_, momentum), g_)
                g_ = b_
            if donate:
                torch._foreach_add_(p_, g_, alpha=-lr_t)
                return p_, b_
            return torch._foreach_add(p_, g_, alpha=-lr_t), b_

        with torch.no_grad():
            p, buf = _masked(step_some)([p, g, buf], _selected(params, mask))
        return optree.tree_unflatten(spec, p), {"momentum_buffer": optree.tree_unflatten(spec, buf),
                                                "step": state["step"] + 1}

    return Optimizer(init, update)


def clip_by_global_norm(grads, max_norm: float, plan, *, donate: bool = False) -> tuple[Any, torch.Tensor]:
    """``(clipped, norm)``: the gradients scaled so their global L2 norm over every rank is at most
    ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model). Collective: every rank
    calls it. Pure: returns new tensors; ``donate=True`` scales ``grads``' own tensors in place and returns
    them (no second copy of the gradients: the caller does not read ``grads`` again).

    >>> grads, norm = sp.optim.clip_by_global_norm(grads, 1.0, plan)
    >>> grads, norm = sp.optim.clip_by_global_norm(grads, 1.0, plan, donate=True)   # in place
    """
    paths, leaves, spec = leaves_with_paths(grads)
    dev = leaves[0].device if leaves else torch.device("cpu")
    acc = torch.zeros((), dtype=torch.float64 if dev.type == "cpu" else torch.float32, device=dev)
    counted: set = set()  # a tied parameter's gradient under both its names is one gradient: counted once
    by_replicas: dict = {}  # one foreach norm per replica count (a few kernels, not a few per leaf: a captured
    for path, g in zip(paths, leaves):  # step replays every kernel it launches)
        name = plan.param(path).name if path in plan else path
        if not g.numel() or name in counted:
            continue
        counted.add(name)
        by_replicas.setdefault(G.replicas(plan, path), []).append(g)
    for r, gs in by_replicas.items():
        norms = torch._foreach_norm(gs, 2)
        acc = acc + torch.stack([n.to(acc.dtype) for n in norms]).pow(2).sum() / r
    C.all_reduce(acc, C.world(), async_op=False, op=torch.distributed.ReduceOp.SUM)
    norm = acc.sqrt().float()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if donate:
        with torch.no_grad():
            if leaves:
                torch._foreach_mul_(leaves, coef)
        return grads, norm
    out = torch._foreach_mul(leaves, coef) if leaves else []
    return (dict(zip(paths, out)) if spec is None else optree.tree_unflatten(spec, out)), norm
