"""Context parallelism at run time: each rank of the ``cp`` axis holds two chunks of every sequence, and
attention sees the whole sequence by gathering keys and values over ``cp``.

The sequence is cut into ``2*cp`` equal chunks; rank ``i`` holds chunks ``i`` and ``2*cp-1-i``, so under
the causal mask every rank has the same work (an early chunk attends to little, its partner to much).
The training loop shards a batch with :func:`shard_batch` (its positions are those of the full
sequence) and the model's attention calls :func:`attention` instead of
``F.scaled_dot_product_attention``; outside the forward and backward of a sharded model with ``cp > 1`` that is
the plain call::

    x, y, pos = sp.context_parallel.shard_batch(plan, rank, x, y)   # [B/dp, T/cp] each, pos: [T/cp]
    loss = model(x, y, positions=pos)                                # mean over this rank's tokens

Gradients are averaged over ``cp`` like over ``dp`` (the plan reduces them over every axis that does not
shard them), which is the mean over all tokens since every cp rank holds as many.

[Note: why all-gather, not ring. Keys and values of the whole sequence are all-gathered before the local
queries attend (and their gradients reduce-scattered back in backward): one collective per attention
call, exact, on any backend and with any attention kernel that takes a boolean mask. Ring attention
(send/recv of K/V blocks overlapped with blockwise compute, torch's ``context_parallel`` on SDPA) holds
only two blocks at a time and hides the transfer behind compute; it needs online-softmax merging per
block and is what long sequences on GPUs want. The all-gather holds ``T`` keys and values per layer
during the call: fine up to sequences whose K/V fit, which is where this starts.]
"""

from __future__ import annotations

import torch

from ..errors import ShardingError
from . import collectives as C
# [Note: the face of four rooms] the group binding (context_group.py), the attention (context_attention.py) and
# Hugging Face's "shardplan_cp" (context_parallel_hf.py), re-exported here: sp.context_parallel is this module
from .context_attention import attention
from .context_group import (CONTEXT_AXIS, ContextGroup, _BACKWARD, _bind_backward, _LAST, active, disabled,
                            group_of, install, note_batch, positions)
from .context_parallel_hf import HF_ATTENTION, hf_attention

__all__ = ["ContextGroup", "HF_ATTENTION", "active", "attention", "disabled", "group_of", "hf_attention", "loss_mean",
           "positions", "shard_batch"]  # (install, CONTEXT_AXIS and the binding's internals: runtime/axes.py, tests)


def shard_batch(plan, rank: int, *tensors: torch.Tensor, seq_dim: int = 1):
    """This rank's part of a global batch: the batch split by ``plan.data_index(rank)`` (cp ranks share it),
    each sequence by :func:`positions`; returns the local tensors and then the positions ([T/cp]).

    >>> x, y, pos = shard_batch(plan, rank, x, y)
    """
    x0 = tensors[0]
    per = x0.shape[0] // plan.data_size
    if x0.shape[0] % plan.data_size:
        raise ShardingError(f"batch of {x0.shape[0]} does not split into the plan's {plan.data_size} data slices")
    i = plan.data_index(rank)
    cp = plan.mesh.axis_size(CONTEXT_AXIS) if CONTEXT_AXIS in plan.mesh.axis_names else 1
    idx = plan.mesh.axis_index(rank, (CONTEXT_AXIS,)) if cp > 1 else 0
    pos = positions(x0.shape[seq_dim], cp, idx, device=x0.device)
    out = [t[i * per:(i + 1) * per].index_select(seq_dim, pos) for t in tensors]
    if cp > 1:
        note_batch(plan, tensors)  # (labels with ignored positions need num_items_in_batch: context_group.py)
    return (*out, pos)


def loss_mean(loss: torch.Tensor, model=None) -> torch.Tensor:
    """The mean over the cp group of each rank's loss (a mean over its tokens): the loss of the whole
    sequences, for logging (training needs nothing: gradients are averaged over cp). The group is ``model``'s
    (:func:`group_of`); without it, that of the context-parallel model whose forward ran last in this thread.

    >>> whole = sp.context_parallel.loss_mean(loss, model)
    """
    if model is not None:
        g = group_of(model)
    else:
        last = _LAST.get()
        g = last() if last is not None else None
    if g is None:
        return loss
    t = loss.detach().clone()
    C.all_reduce(t, g.group, async_op=False)
    return t
