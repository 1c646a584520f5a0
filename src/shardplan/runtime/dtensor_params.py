"""Registered parameters as FSDP2's: DTensor ``nn.Parameter``\\ s over the plan's ``DeviceMesh``, whose local
tensor is this rank's shard view in the flat buffer (no copy), with DTensor gradients after backward.

``shard(..., dtensor_params=True)`` (and always ``fully_shard``) installs them where every parameter's plan
boxes are DTensor placements (``state_dict.describe``: always under ``layout="chunked"``). Then ``p.shape`` and
``p.numel()`` are global, ``p.full_tensor()``, ``p.to_local()`` and ``p.placements`` work, and torch's own
``clip_grad_norm_``, DTensor-aware optimizers and ``torch.distributed.checkpoint`` take the parameters as they
take FSDP2's. The runtime itself never computes on them: gathers read the flat shard, reductions write the
flat gradient, and the modules hold the full (plain) parameters while a unit computes; only the hand-over of
a reduced gradient wraps its view (``DTensor(view, spec)``, no dispatch), as FSDP2 does.

[Note: scalars] A 0-d parameter is replicated (no dimension to shard; FSDP2 refuses them) and stays a plain
tensor, the whole value, with a plain gradient: DTensor takes a 0-d plain tensor beside DTensors as replicated
(torch's optimizers, ``clip_grad_norm_``), and a module may read it outside its unit's forward (a gain applied
in the root's forward), where a DTensor would meet plain activations.

[Note: the user's original parameter objects] A DTensor cannot take over an ``nn.Parameter``'s identity
(``torch.utils.swap_tensors`` refuses objects with different ``__slots__``), so the objects a user held before
sharding are not the ones that train. An optimizer built on them (before ``fully_shard``'s lazy compile, say,
through a root that is not itself a ``fully_shard`` module) gets the DTensor parameter in each one's place at its
first ``step()`` (runtime/identity.py); other references to them read the shard's values (the same memory) but
never get a gradient, as under FSDP2, whose ``fully_shard`` replaces the parameters too.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from ..errors import RuntimeShardingError
from ..planner import expert_parallel as EPX, tensor_parallel as TPX


def plain(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The plain local tensor behind ``t`` (a DTensor parameter, gradient or state), or ``t`` itself."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def check(plan, layout: dict) -> None:
    """Refuse (every rank alike: the plan decides) a plan whose parameters cannot be DTensors, before any work;
    ``layout``: ``state_dict.describe(plan)``."""
    why = refusal(plan, layout)
    if why:
        raise RuntimeShardingError(f"shard(..., dtensor_params=True): {why}")


def refusal(plan, layout: dict) -> Optional[str]:
    """Why this plan's parameters cannot be DTensors (``None``: they can); ``layout``: ``state_dict.describe``'s."""
    bad = next((n for n, (pl, _) in layout.items() if pl is None), None)
    if bad is not None:
        return (f"parameter {bad!r} cannot be a DTensor: {layout[bad][1]}. Plan with layout=\"chunked\" "
                f"(shardplan.plan(..., layout=\"chunked\")), whose shards are torch.chunk pieces")
    if plan.offload:
        return (f"the plan offloads to host memory (offload={plan.offload!r}), whose host masters and optimizer "
                f"step the local shards as plain tensors; plan without offload")
    if TPX.of(plan).axes or EPX.of(plan).modules:
        return ("the plan has compute axes (tensor, context or expert parallelism), whose parameters are not yet "
                "given as DTensors of the whole mesh; shard with dtensor_params=False")
    if any(b.tensorwise for b in plan.buffers):
        return "the plan gathers float8 weights (fp8='torchao'); plan with fp8_gather=False"
    return None


def install(exe, face, hooks, slots: dict) -> None:
    """Replace every registered local shard by a DTensor parameter over the same memory: on the modules, in the
    face's slots and lookups, and on each buffer member (``m.local``, with ``m.dspec``). ``slots``: unit name ->
    [(module, attribute, local, full)] (the face's, rewritten in place)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    mesh = hooks.mesh
    made: dict[int, nn.Parameter] = {}
    for u in exe.unit_list:
        for b in u.buffers:
            for m in b.members:
                if not m.info.global_shape:  # a scalar (replicated; FSDP2 refuses them): see [Note: scalars]
                    continue
                old = m.local
                g = torch.Size(m.info.global_shape)
                stride = tuple(math.prod(g[d + 1:]) for d in range(len(g)))
                spec = DTensorSpec(mesh, hooks.layout[m.name][0], TensorMeta(g, stride, old.dtype))
                dshape = tuple(hooks.local_shape[m.name])
                local = old.detach()  # the shard view: same storage, same version counter
                if tuple(local.shape) != dshape:  # an empty piece: the plan's (0, ...) vs DTensor's zero on dim d
                    local = local.view(dshape)
                dt = nn.Parameter(DTensor(local, spec, requires_grad=False), requires_grad=old.requires_grad)
                # the object the user held before sharding no longer trains: an optimizer built on it steps the
                # DTensor parameter instead (identity.check_optimizer)
                old.__dict__.setdefault("_shardplan_replaced", m.name)
                old.__dict__["_shardplan_successor"] = dt
                m.local = dt
                m.dspec = (spec, dshape, contiguous_strides(dshape))
                made[id(old)] = dt
    for name, entries in slots.items():
        slots[name] = [(mod, attr, made.get(id(lp), lp), fp) for mod, attr, lp, fp in entries]
        for mod, attr, lp, _ in slots[name]:
            if mod._parameters.get(attr) is not None and id(mod._parameters[attr]) in made:
                mod._parameters[attr] = lp
    face.by_index = {i: made.get(id(lp), lp) for i, lp in face.by_index.items()}
    face.by_name = {n: made.get(id(lp), lp) for n, lp in face.by_name.items()}
    exe.dtensor_params = True


def grad(view: torch.Tensor, dspec) -> torch.Tensor:
    """A reduced local gradient view as its parameter's DTensor gradient (no copy, no dispatch)."""
    from torch.distributed.tensor import DTensor
    spec, dshape, _ = dspec
    if tuple(view.shape) != dshape:
        view = view.view(dshape)
    return DTensor(view, spec, requires_grad=False)


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for d in reversed(tuple(shape)):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))
