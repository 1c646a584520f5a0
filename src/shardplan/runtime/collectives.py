"""Every collective shardplan issues, in one place: picks the API the installed torch has.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``; older releases only have the former.
A group of one rank needs no communication: those calls become local copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Group:
    """A process group with its size and this rank's index in it (``None`` pg: a group of one)."""

    pg: Optional[object]
    size: int
    rank: int


class _Done:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


DONE = _Done()


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = True):
    if group.pg is None:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return DONE
    return _all_gather(out, inp, group=group.pg, async_op=async_op) or DONE


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = True):
    """Average ``inp`` over the group; this rank gets its segment in ``out``."""
    if group.pg is None:
        out.copy_(inp)
        return DONE
    return _reduce_scatter(out, inp, op=dist.ReduceOp.AVG, group=group.pg, async_op=async_op) or DONE


def all_reduce(t: torch.Tensor, group: Group, async_op: bool = True, op=None):
    if group.pg is None:
        return DONE
    return dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.AVG, group=group.pg, async_op=async_op) or DONE


def broadcast(t: torch.Tensor, src: int, group: Group):
    if group.pg is None:
        return DONE
    return dist.broadcast(t, src=src, group=group.pg) or DONE
