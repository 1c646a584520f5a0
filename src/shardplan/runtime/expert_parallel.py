"""Expert parallelism at run time: tokens to the ranks that hold their experts and back (all-to-all).

An expert module (stacked weights ``[num_experts, ...]``, an integer ``num_experts``) calls
:func:`dispatch` with its tokens and the experts each is routed to, runs its local experts on the rows it
gets, and calls :func:`combine` with the results::

    routed = sp.expert_parallel.dispatch(self, x, top_k_index)     # x: [N, dim], top_k_index: [N, k]
    outs = [expert(l, rows) for l, rows in enumerate(routed.tokens.split(routed.counts))]
    y = sp.expert_parallel.combine(routed, torch.cat(outs))       # [N, k, dim], in x's order

Where ``shard()`` split the module's experts over ``ep`` (a rule with ``ep`` first in dim 0), ``routed``
holds the rows every rank of the ``ep`` group sent to this rank's ``num_experts / ep`` experts;
elsewhere (one process, ``ep=1``, experts replicated) the same code sorts the local tokens by expert.
Routing is dropless: every token reaches its experts whatever the load (no capacity, no overflow), so
a rank may receive all tokens of its group; counts are exchanged first, then the rows, with split sizes.

[Note: expert gradients. A data-parallel step averages gradients over the data axes, and the plan reduces
an expert weight's gradient over the data axes other than ``ep`` only (its ep peers hold other experts).
Autograd already *sums* over the ep group the contributions of every ep rank's tokens, which arrive
through the all-to-all; the average over ep is one more factor 1/ep. The gradient arriving back at the
experts (combine's backward) is scaled by 1/ep and the tokens' gradient leaving them (dispatch's
backward) by ep, so expert weights get exactly the average and everything else is unchanged (both
factors are powers of two for the usual sizes: exact).]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from ..errors import RuntimeShardingError
from . import collectives as C

ATTR = "_shardplan_experts"


@dataclass(frozen=True)
class ExpertGroup:
    """Where a module's experts live: the ``ep`` group (its size and this rank's index) and how many
    experts the whole module has."""

    group: C.Group
    num_experts: int

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.group.size


class _AllToAll(torch.autograd.Function):
    """Rows out by ``in_splits``, rows in by ``out_splits``; backward sends the gradients back the other way,
    scaled by ``grad_scale``."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, grad_scale):
        ctx.splits, ctx.group, ctx.scale = (out_splits, in_splits), group, grad_scale
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        C.all_to_all_single(out, x.contiguous(), group, out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        C.all_to_all_single(back, grad.contiguous(), ctx.group, in_splits, out_splits)
        if ctx.scale != 1:
            back = back * ctx.scale
        return back, None, None, None, None


@dataclass
class Routed:
    """The rows this rank's experts compute: ``tokens`` grouped by local expert, ``counts`` rows per local
    expert (a list of ints: ``tokens.split(counts)``), and what :func:`combine` needs to send them back."""

    tokens: torch.Tensor
    counts: list
    _order: torch.Tensor                 # sorted position -> (token, slot) position
    _shape: tuple                        # (N, k)
    _group: Optional[ExpertGroup] = None
    _regroup: Optional[torch.Tensor] = None   # received row order -> by local expert
    _sent: Optional[list] = None          # rows sent to each ep rank
    _received: Optional[list] = None      # rows received from each


def group_of(module: nn.Module) -> Optional[ExpertGroup]:
    """The expert group ``shard()`` gave ``module`` (``None``: its experts are all local)."""
    return module.__dict__.get(ATTR)


def dispatch(module: nn.Module, x: torch.Tensor, expert_ids: torch.Tensor) -> Routed:
    """Send each row of ``x`` ([N, dim]) to the rank holding each of its experts (``expert_ids``: [N, k] or
    [N], global expert indices) and return the rows this rank's experts compute, grouped by local expert.

    >>> routed = dispatch(self, x, top_k_index); routed.tokens.split(routed.counts)
    """
    num = getattr(module, "num_experts", None)
    if not isinstance(num, int):
        raise RuntimeShardingError(f"dispatch: {type(module).__name__} has no integer num_experts; an expert module "
                                   f"says how many experts it stacks (dim 0 of its weights)")
    ids = expert_ids if expert_ids.dim() == 2 else expert_ids[:, None]
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x[order // k]                                   # each (token, slot) pair, sorted by expert
    if flat.device.type == "meta":  # the planner's traced step: routing has no values; assume it balanced
        even, extra = divmod(n * k, num)
        return Routed(rows, [even + (e < extra) for e in range(num)], order, (n, k))
    counts = torch.bincount(flat, minlength=num)
    eg = group_of(module)
    if eg is None or eg.group.pg is None:  # experts all local (a real group of one: SHARDPLAN_SINGLETON_GROUPS=1)
        return Routed(rows, counts.tolist(), order, (n, k))
    size, local = eg.group.size, eg.local_experts
    recv = torch.empty_like(counts)
    C.all_to_all_single(recv, counts, eg.group)            # [src rank, local expert] counts, flattened
    recv = recv.view(size, local)
    sent = counts.view(size, local).sum(1).tolist()
    received = recv.sum(1).tolist()
    got = _AllToAll.apply(rows, received, sent, eg.group, float(size))
    # the rows arrive by source rank, then by local expert; the experts want them by local expert
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=recv.device).repeat(size), recv.reshape(-1))
    regroup = torch.argsort(expert_of_row, stable=True)
    return Routed(got[regroup], recv.sum(0).tolist(), order, (n, k), eg, regroup, sent, received)


def combine(routed: Routed, y: torch.Tensor) -> torch.Tensor:
    """The experts' outputs ``y`` (rows in ``routed.tokens``' order) back on the ranks and in the order of
    the tokens: ``[N, k, ...]`` (slot ``j`` of token ``i``: its ``j``-th expert's output)."""
    if routed._group is not None:
        back = torch.empty_like(routed._regroup)
        back[routed._regroup] = torch.arange(routed._regroup.numel(), device=back.device)
        y = _AllToAll.apply(y[back], routed._sent, routed._received, routed._group.group,
                            1.0 / routed._group.group.size)
    inverse = torch.empty_like(routed._order)
    inverse[routed._order] = torch.arange(routed._order.numel(), device=inverse.device)
    n, k = routed._shape
    return y[inverse].view(n, k, *y.shape[1:])


def install(module: nn.Module, plan, groups) -> None:
    """Give each expert module the plan splits its ``ep`` group (``group_of`` reads it)."""
    for m in plan.expert_modules:
        mod = module.get_submodule(m.path)
        mod.__dict__[ATTR] = ExpertGroup(groups.axis(m.axis), m.num_experts)
