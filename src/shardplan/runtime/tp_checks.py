"""What the ranks of one tensor-parallel group must agree on, checked once when training starts: the random
generators (dropout masks of replicated activations: every group gets its first rank's states), the inputs of the
first forward (every rank of a group given the same batch slice), and, at the first synchronising backward, which
replicated parameters' gradients are partial sums (:class:`PartialCheck`; docs/tensor_parallel.md)."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import RuntimeShardingError
from ..planner.tensor_parallel import of as tp_of
from . import collectives as C
from .tensor_parallel import active_modules


def _gather_from_all(plan, mine: torch.Tensor, world_group, device) -> list[torch.Tensor]:
    """Every rank's ``mine`` (same shape and dtype everywhere), indexed by rank."""
    return C.all_gather_list(mine.to(device), world_group)  # NCCL gathers device tensors


def _tp_groups(plan) -> list[tuple[int, ...]]:
    """The ranks that compute together: they differ only along the active compute axes."""
    axes = sorted({m.axis for m in active_modules(plan)})
    return list(plan.mesh.groups(axes)) if axes else []


def _fingerprint(tensors) -> torch.Tensor:
    """Three float64 numbers that differ between different inputs: element counts, sums, and sums
    weighted by position (a permutation changes them). Equal inputs give equal bits on every rank."""
    out = torch.zeros(3, dtype=torch.float64)
    for t in tensors:
        x = torch.nan_to_num(t.detach().reshape(-1).to("cpu", torch.float64), nan=7e7, posinf=3e7, neginf=-5e7)
        w = torch.arange(x.numel(), dtype=torch.float64) % 1009 + 1
        out += torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), x.sum(), (x * w).sum()])
    return out


def align_generators(plan, world_group, device: torch.device) -> bool:
    """Give every rank of a tensor-parallel group its first rank's random generator states (CPU, and the
    device's); returns whether this rank's changed. The ranks of a group compute on the same replicated
    activations, so a dropout mask (or any random op) must come out the same on each, or they train a
    model no single process would, silently. torch >= 2.13 seeds each process differently unless the
    program seeds it; data-parallel ranks keep their own states."""
    groups = _tp_groups(plan)
    if not groups or world_group.pg is None:
        return False
    states = [torch.random.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])
    every = _gather_from_all(plan, torch.cat(states), world_group, device)
    rank = world_group.rank
    leader = next(g[0] for g in groups if rank in g)
    theirs = every[leader].cpu()
    if torch.equal(theirs, every[rank].cpu()):
        return False
    n = states[0].numel()
    torch.random.set_rng_state(theirs[:n].clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(theirs[n:].clone(), device)
    return True


def install_input_check(module: nn.Module, plan, world_group, device: torch.device):
    """A root pre-forward hook (ahead of the executor's) that checks, on the first forward, that the ranks of
    each tensor-parallel group were given the same inputs: a batch split by rank instead of by
    ``plan.data_index(rank)`` would otherwise train on mixed activations without an error."""
    from torch.utils._pytree import tree_leaves

    @torch._dynamo.disable
    def hook(_mod, args, kwargs):
        handle.remove()  # the first forward only
        if world_group.pg is None:
            return None
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        every = _gather_from_all(plan, _fingerprint(leaves), world_group, device)
        for group in _tp_groups(plan):
            differ = [r for r in group if not torch.equal(every[r], every[group[0]])]
            if not differ:
                continue
            axis = ",".join(a for a in tp_of(plan).axes if plan.mesh.axis_size(a) > 1)
            raise RuntimeShardingError(
                f"forward: ranks {list(group)} form one tensor-parallel group over compute axis {axis!r}, but "
                f"ranks {differ} were given other inputs than rank {group[0]}. Every rank of a tensor-parallel "
                f"group computes on the same batch slice: split the batch by plan.data_index(rank) into "
                f"plan.data_size parts (here {plan.data_size}), not by rank")
        return None

    handle = module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    return handle


def _projections(g: torch.Tensor) -> torch.Tensor:
    """Five numbers that tell two gradients apart: its norm and four fixed projections of it (float64)."""
    x = g.detach().reshape(-1).to(torch.float64)
    if not x.numel():
        return torch.zeros(5, dtype=torch.float64, device=x.device)
    i = torch.arange(x.numel(), dtype=torch.float64, device=x.device)
    ws = [torch.cos(i * k) for k in (0.6180339887, 1.4142135623, 2.7182818284, 0.5772156649)]
    return torch.stack([x.norm()] + [(x * w).sum() for w in ws])


class PartialCheck:
    """Once per unit, in the first synchronising backward: the gradients of parameters replicated over a
    compute axis, before any reduction, compared across each tensor-parallel group. A replicated parameter
    computes on activations every rank of the group shares, so its gradient is the same on each: one that
    differs read tensor-parallel-sharded activations the plan did not see (its gradient is a partial sum
    the plan would not add up), and one the plan sums (``BufferPlan.partial_axes``) that is the same on every
    rank did not (the sum would multiply it). Either raises, naming the parameters and the fix (plan with
    ``trace=``, which follows the activations). [Note: compared within a tolerance (1e-3 of the gradients'
    size): GPU kernels with atomics make equal gradients differ in their last bits; partial sums over other
    heads differ at their own size.]"""

    def __init__(self, plan, world_group, device: torch.device):
        self.plan, self.world, self.device = plan, world_group, device
        self.groups = _tp_groups(plan)
        self.done: set = set()

    def __call__(self, u) -> None:
        if not self.groups or u.name in self.done or self.world.pg is None:
            return
        self.done.add(u.name)
        checked = []  # (member, partial)
        for b in u.with_grads:
            if b.flat is None:
                continue
            b._views()
            for m in b.members:
                if m.info.compute is None and m.info.requires_grad:
                    checked.append((m, b))
        if not checked:
            return
        mine = torch.stack([_projections(b.flat[m.whole]) for m, b in checked]).cpu()
        every = [t.cpu() for t in _gather_from_all(self.plan, mine, self.world, self.device)]
        missed, assumed = [], []
        for group in self.groups:
            if self.world.rank not in group:
                continue
            ref = every[group[0]]
            for r in group[1:]:
                other = every[r]
                tol = (ref[:, :1] + other[:, :1]) * 1e-3  # of the norms (a projection moves by about the norm)
                differs = ((ref - other).abs() > tol).any(dim=1)
                for k, (m, b) in enumerate(checked):
                    if b.bp.partial_axes and not differs[k] and ref[k, 0] > 0:
                        assumed.append(m.name)
                    elif not b.bp.partial_axes and differs[k]:
                        missed.append(m.name)
        if missed:
            names = sorted(set(missed))
            raise RuntimeShardingError(
                f"backward: the gradients of replicated parameter(s) {names[:4]}{' ...' if len(names) > 4 else ''} "
                f"(unit {u.name!r}) differ between the ranks of their tensor-parallel group, which share every "
                f"replicated activation: they read activations sharded over the compute axis (a per-head norm after a "
                f"column-parallel projection), so each rank's gradient is a partial sum the plan does not add up. "
                f"Fix: plan with trace=example inputs (the planner follows the activations and sums such gradients "
                f"over the compute axis), or keep the compute axis out of the projection feeding them")
        if assumed:
            names = sorted(set(assumed))
            raise RuntimeShardingError(
                f"backward: the plan sums the gradients of {names[:4]}{' ...' if len(names) > 4 else ''} (unit "
                f"{u.name!r}) over the compute axis, taking them to read per-head activations (an untraced plan "
                f"judges head_dim-sized parameters so), but their gradients are the same on every rank of the "
                f"group: they read replicated activations, and the sum would multiply them. Fix: plan with "
                f"trace=example inputs (the planner follows the activations)")
