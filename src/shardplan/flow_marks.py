"""What :mod:`shardplan.flow`'s rules share: ``Mark`` (a tensor's split dimension), the operation tables the
rules dispatch on, the fixes the messages name, :func:`reshaped` (where a reshape puts a split dimension) and
``_Call`` (one marked argument of one call: the argument readers and the carry of a mark to an output)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._pytree import tree_leaves

SEQUENCE = ""  # the source of a sequence mark (a module path names a column-parallel output's)

ATTENTION_FIX = ("compute attention with sp.context_parallel.attention(q, k, v, is_causal=True), which gathers keys "
                 "and values over cp (a Hugging Face model: build it with attn_implementation=\"shardplan_cp\" after "
                 "sp.context_parallel.hf_attention(); docs/context_parallel.md)")
SHIFT_FIX = ("shift the labels of the whole sequences before sp.context_parallel.shard_batch (a Hugging Face model: "
             "pass shift_labels= the shifted, sharded labels instead of labels=)")

HEADS_FIX = ("compute head counts from local shapes, view(b, t, -1, head_dim), so that each rank views its own "
             "whole heads (docs/tensor_parallel.md); a model whose code views with its config's head count (Hugging "
             "Face StableLM) cannot run that module tensor-parallel: keep {axis!r} out of the specs of its "
             "projections (replicated compute there)")


@dataclass(frozen=True)
class Mark:
    """A tensor's split dimension: ``dim``; ``source``: ``SEQUENCE`` or the column-parallel module whose
    output it derives from; ``axis``: the mesh axis that splits it; ``size``: that axis's size. A sequence
    merged with other dimensions (``[b, t, d] -> [b*t, d]``: the tokens of every sample in one dimension) is a
    factor of ``dim``: ``extent`` positions (the sequence's length) at ``stride`` (the merged dimensions inside
    it), its index ``(i // stride) % extent``; 0 and 0: the whole dimension (see :func:`regrouped`)."""

    dim: int
    source: str
    axis: str
    size: int
    stride: int = 0
    extent: int = 0

    def at(self, dim: int) -> "Mark":
        return Mark(dim, self.source, self.axis, self.size, self.stride, self.extent)


_CARRY = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as", "reshape_as", "squeeze", "unsqueeze",
          "contiguous", "clone", "to", "float", "double", "half", "bfloat16", "type", "type_as", "detach",
          "requires_grad_", "cpu", "cuda", "_reshape_alias", "ravel", "atleast_2d", "atleast_3d"}
_PERMUTE = {"transpose", "swapaxes", "swapdims", "t", "permute", "movedim", "moveaxis"}
_ALONG = {"softmax": 1, "log_softmax": 1, "_softmax": 1, "softmin": 1, "cumsum": 1, "cumprod": 1,
          "logcumsumexp": 1, "cummax": 1, "cummin": 1, "sort": 1, "argsort": 1, "topk": 2, "kthvalue": 2,
          "flip": 1, "roll": 2, "diff": 2, "unfold": 1, "index_select": 1, "gather": 1, "take_along_dim": 2,
          "narrow": 1, "select": 1, "scatter": 1, "scatter_add": 1, "index_add": 1, "index_copy": 1,
          "index_fill": 1, "glu": 1}
_ALONG_DEFAULT = {"sort": -1, "argsort": -1, "topk": -1, "kthvalue": -1, "diff": -1, "glu": -1, "msort": 0}
_REDUCE = {"sum", "mean", "nansum", "nanmean", "amax", "amin", "max", "min", "argmax", "argmin", "logsumexp", "prod",
           "std", "var", "std_mean", "var_mean", "norm", "median", "nanmedian", "mode", "quantile", "nanquantile",
           "all", "any", "count_nonzero", "aminmax", "linalg_vector_norm", "vector_norm"}
_TOKEN_REDUCE = {"sum", "mean", "nansum", "nanmean", "all", "any", "count_nonzero"}
_MATMUL = {"matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "inner"}
_SPLIT = {"split": 2, "chunk": 2, "tensor_split": 2, "split_with_sizes": 2, "unbind": 1}
_JOIN = {"cat", "concat", "concatenate", "stack"}
_LOSS = {"cross_entropy", "nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "mse_loss",
         "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "poisson_nll_loss", "soft_margin_loss",
         "multilabel_soft_margin_loss", "multi_margin_loss", "gaussian_nll_loss"}
_BEFORE = {"multi_head_attention_forward", "scaled_dot_product_attention"}
_NORM = {"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "normalize", "local_response_norm"}


def _dim(d, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _plain(t) -> bool:
    """Only plain tensors carry marks (a DTensor is the runtime's own, already placed)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def reshaped(d: int, shape_in, shape_out) -> Optional[int]:
    """The dimension of a reshape's output holding the outermost part of input dimension ``d`` (a split
    keeps the outer factor split: whole heads; a merge keeps the merged dimension split)."""
    if tuple(shape_in) == tuple(shape_out):
        return d
    if math.prod(shape_in) != math.prod(shape_out):
        return None
    outer = math.prod(shape_in[d:])
    for e in range(len(shape_out)):  # a split keeps its outer factor split (of size 1 too: one head per rank)
        if math.prod(shape_out[e:]) == outer:
            return e
    for e in range(len(shape_out)):  # a merge: the merged dimension
        lo, hi = math.prod(shape_out[e + 1:]), math.prod(shape_out[e:])
        if lo < outer <= hi:
            return e
    return None


def regrouped(m: "Mark", shape_in, shape_out) -> Optional["Mark"]:
    """A sequence mark through a reshape: the output dimension that holds the sequence's positions whole (the
    mark), or a factor of it (a merge: with ``stride`` and ``extent``), ``None`` where the sequence is split
    over several output dimensions. [Note: unlike a column-parallel output's features, which a reshape splits
    into heads (the ranks' blocks are the outer factor: :func:`reshaped`), the sequence merged into ``b*t`` is
    the *inner* factor there, and a reshape back to ``[b, t, ...]`` must find it at ``t``, not at ``b``.]"""
    if tuple(shape_in) == tuple(shape_out):
        return m
    if math.prod(shape_in) != math.prod(shape_out):
        return None
    extent = m.extent or shape_in[m.dim]
    step = math.prod(shape_in[m.dim + 1:]) * (m.stride or 1)   # elements between two positions of the sequence
    for e in range(len(shape_out)):
        inner = math.prod(shape_out[e + 1:])
        if step % inner:
            continue
        s = step // inner
        if s * extent <= shape_out[e] and shape_out[e] % (s * extent) == 0:
            whole = s == 1 and extent == shape_out[e]
            return Mark(e, m.source, m.axis, m.size, 0 if whole else s, 0 if whole else extent)
        return None
    return None


class _Call:
    """One marked argument ``x`` (its mark ``m``) of one call of operation ``name``: the argument readers and
    the carry of a mark to an output that every rule family uses."""

    def __init__(self, chk, name: str, args, kwargs, out, marked):
        self.chk, self.name, self.args, self.kwargs, self.marked = chk, name, args, kwargs, marked
        self.seq = marked[0][1].source == SEQUENCE
        self.x, self.m = marked[0]
        self.outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]

    def dim_arg(self, pos: int, default=None, keys=("dim", "axis", "dims")):
        for k in keys:
            if k in self.kwargs:
                return self.kwargs[k]
        return self.args[pos] if len(self.args) > pos else default

    @staticmethod
    def dims_of(d, ndim) -> list[int]:
        if d is None:
            return list(range(ndim))
        return [_dim(int(i), ndim) for i in (d if isinstance(d, (tuple, list, torch.Size)) else (d,))]

    def carry(self, t, dim, mark=None):
        if dim is not None:
            self.chk.mark(t, (mark or self.m).at(dim))

    def refuse(self, how: str, op: str, fix: str = "") -> None:
        self.chk.refuse(self.m, how, op, fix)


