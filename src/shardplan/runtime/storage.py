"""Tensor storage as the runtime moves it: freed and allocated in place (the tensor object and its views stay),
and a tensor over another's storage with its own version counter."""

from __future__ import annotations

import torch


def free_storage(t: torch.Tensor) -> None:
    if t.untyped_storage().size() != 0:
        t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    need = t.numel() * t.element_size()
    if t.untyped_storage().size() != need:
        t.untyped_storage().resize_(need)


def alias(base: torch.Tensor, offset: int, shape) -> torch.Tensor:
    """A tensor over ``base``'s storage with its own version counter (so writes into ``base``
    by collectives never trip autograd's saved-tensor checks on the parameters)."""
    t = torch.empty(0, dtype=base.dtype, device=base.device)
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    t.set_(base.untyped_storage(), base.storage_offset() + offset, tuple(shape), tuple(reversed(stride)))
    return t
