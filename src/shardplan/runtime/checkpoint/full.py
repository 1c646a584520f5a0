"""Full (unsharded) export and import: ordinary tensors on rank 0 <-> the local shards.

>>> full = shardplan.checkpoint.full_state_dict(model)          # rank 0: {fqn: full tensor}; other ranks: {}
>>> shardplan.checkpoint.load_full_state_dict(model, full)      # rank 0's dict, broadcast one parameter at a time
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ...errors import CheckpointError
from . import diagnose
from .. import collectives as C
from ...planner import expert_parallel as EPX, tensor_parallel as TPX
from ...planner import geometry as G
from ..builder import engine_of
from ..dtensor_params import plain
from ..seams import unwrap_compiled


def _piece(plan, name: str, rank: int):
    """``(box, offset, shape)`` of ``rank``'s piece of ``name``: its box in the parameter (tensor-parallel
    local, ````plan.piece(name, rank).storage_box``), where it starts in that rank's shard and its shape; ``None``: no piece.

    >>> _piece(plan, "layers.0.w", 1)     # e.g. ((slice(64, 128), slice(0, 256)), 0, (64, 256))
    """
    pc = plan.piece(name, rank)
    if pc.storage_box is None:
        return None
    return pc.storage_box, pc.shard_offset, pc.shape


def _copy(t: torch.Tensor, cpu: bool) -> torch.Tensor:
    return t.detach().clone().cpu() if cpu else t.detach().clone()


def full_state_dict(model: nn.Module, *, cpu: bool = True) -> dict[str, torch.Tensor]:
    """Rank 0 gets ordinary full tensors (fp32 masters); other ranks get ``{}``. One buffer at a time.

    >>> full = shardplan.checkpoint.full_state_dict(model)
    >>> if rank == 0: torch.save(full, "model.pt")
    """
    eng = engine_of(model)
    plan = eng.plan
    locals_ = {n: plain(lp) for n, lp in eng.local_params().items()}  # (DTensor parameters: their local shards)
    if TPX.of(plan).axes or EPX.of(plan).modules:  # tensor- or expert-parallel blocks: by global boxes
        out = _full_by_boxes(eng, locals_, cpu)
    else:
        out = {}
        for bp in plan.buffers:
            out.update(_full_of_buffer(eng, bp, locals_, cpu))
    if eng.rank == 0:
        for pp in plan.params:
            for a in pp.aliases:
                out[a] = out[pp.name]
        for name, buf in _persistent_buffers(model).items():
            out[name] = _copy(buf, cpu)
    return out


def _full_of_buffer(eng, bp, locals_, cpu: bool) -> dict[str, torch.Tensor]:
    """Rank 0's full tensors of one buffer's parameters: one all-gather of the shards, then every rank's
    piece of every parameter put in its box (:func:`_piece`, for any layout)."""
    plan = eng.plan
    if not bp.sharded:
        return {name: _copy(locals_[name], cpu) for name in bp.params} if eng.rank == 0 else {}
    shard = eng.shard_of(bp.index).to(eng.device)  # (offload="params": the host master, copied in)
    gathered = torch.empty(bp.gathered_numel, dtype=shard.dtype, device=shard.device)
    C.all_gather(gathered, shard.contiguous(), eng.groups.gather(bp.axes), async_op=False)
    out = {}
    if eng.rank == 0:
        packed = gathered.view(bp.group_size, bp.shard_numel)  # one row per member's shard, in group order
        members = plan.mesh.group_of(0, bp.axes)
        for name in bp.params:
            full = torch.empty(plan.param(name).shape, dtype=shard.dtype, device=shard.device)
            for r in members:
                piece = _piece(plan, name, r)
                if piece is not None:
                    box, off, shape = piece
                    full[box].copy_(packed[G.segment(plan.mesh, bp, r), off:off + math.prod(shape)].view(shape))
            out[name] = full.cpu() if cpu else full
    del gathered
    return out


def _full_by_boxes(eng, locals_, cpu: bool) -> dict[str, torch.Tensor]:
    """Full tensors on rank 0 from every rank's box, one parameter at a time (any plan, compute axes too):
    each box is written by one of its replicas and summed over the world."""
    plan, out = eng.plan, {}
    for pp in plan.params:
        lp = eng.local_value(pp.name, locals_[pp.name]).to(eng.device)
        full = torch.zeros(pp.global_shape, dtype=lp.dtype, device=lp.device)
        box = plan.local_slices(pp.name, eng.rank)
        others = [a for a in plan.mesh.axis_names if a not in G.owner_axes(plan, pp.name)]
        if box is not None and plan.mesh.axis_index(eng.rank, others) == 0:
            full[box] = lp.reshape(plan.local_shape(pp.name, eng.rank))
        C.all_reduce(full, eng.groups.world, async_op=False, op=torch.distributed.ReduceOp.SUM)
        if eng.rank == 0:
            out[pp.name] = full.cpu() if cpu else full
    return out


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers that ``model.state_dict()`` holds (non-persistent ones are rebuilt by the module). Read from
    the modules, not from ``model.state_dict()``, whose parameters are DTensors or refused (runtime/state_dict.py)."""
    model = unwrap_compiled(model)  # torch.compile(model) names them "_orig_mod.<name>"
    out = {}
    for path, m in model.named_modules(remove_duplicate=False):
        for name, buf in m._buffers.items():
            if buf is not None and name not in m._non_persistent_buffers_set:
                out[f"{path}.{name}" if path else name] = buf
    return out


def _misfit(plan, model: nn.Module, full: dict, strict: bool) -> str:
    """Rank 0's description of how ``full`` does not fit the plan (``""``: it fits)."""
    return diagnose.full_misfit(full, [p.name for p in plan.params], {a: p.name for p in plan.params for a in p.aliases},
                                _persistent_buffers(model), {p.name: p.global_shape for p in plan.params}, strict)


def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load ordinary full tensors held by rank 0 (others may pass ``{}``), broadcast one parameter at a time.

    >>> shardplan.checkpoint.load_full_state_dict(model, torch.load("model.pt") if rank == 0 else {})
    """
    eng = engine_of(model)
    plan = eng.plan
    world = eng.groups.world
    msg = C.broadcast_str(_misfit(plan, model, full, strict) if eng.rank == 0 else "", world)
    if msg:
        raise CheckpointError(msg)
    locals_ = {n: plain(lp) for n, lp in eng.local_params().items()}  # (DTensor parameters: their local shards)
    with torch.no_grad():
        for pp in plan.params:
            lp = eng.local_value(pp.name, locals_[pp.name])  # (offload="params": a view of the host master)
            t = torch.empty(pp.global_shape, dtype=lp.dtype, device=eng.device)
            if eng.rank == 0:
                v = full.get(pp.name)
                if v is None:
                    v = next((full[a] for a in pp.aliases if a in full), None)
                if v is not None:
                    t.copy_(v)
            C.broadcast(t, 0, world)
            box = plan.local_slices(pp.name, eng.rank)
            if box is not None:
                lp.copy_(t[box])
        for name, buf in _persistent_buffers(model).items():
            if eng.rank == 0 and name in full:
                buf.copy_(full[name])
            C.broadcast(buf, 0, world)
    eng.mark_shards_changed()
