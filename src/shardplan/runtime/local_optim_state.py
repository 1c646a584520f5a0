"""An optimizer's state dict as this rank's local shards, for plans whose layout no DTensor describes (the
contiguous packing ``layout="auto"`` picks for dim-0 specs): torch's own ``Optimizer.state_dict()`` contract,
with a marker that keeps the dict from loading where it would be wrong.

``optimizer.state_dict()`` gives the states as the optimizer holds them (this rank's shards, plain tensors)
plus one :class:`LocalStates` under ``param_groups[0][KEY]``: the rank, the world, and the box of every
parameter this rank held, in the optimizer's order. ``copy.deepcopy`` and a per-rank ``torch.save`` /
``torch.load`` (``weights_only`` too: the class is registered with torch's safe globals) keep it;
``load_state_dict`` takes it back where this rank holds the same boxes (same rank, same shards: the same plan
and world, or any plan that shards this rank alike) and refuses it elsewhere, naming ``shardplan.checkpoint``
for resharding. DCP refuses it too: :meth:`LocalStates.__create_write_items__` is the hook DCP's planner calls
for every value it saves, and as plain per-rank tensors it would keep one rank's copy.

>>> sd = copy.deepcopy(opt.state_dict()); ...; opt.load_state_dict(sd)   # the same plan, world and rank

[Note: why local states and not Megatron-FSDP's uneven DTensors] Megatron-FSDP (``uneven_dtensor.py``) hands
out DTensors whose local row ranges are uneven and patches DCP's chunk metadata onto each one's local tensor,
computed from every rank's local shape. The metadata is DCP's alone: ``full_tensor()``, ``redistribute`` and
torch's ``get_optimizer_state_dict(full_state_dict=True)`` still take the pieces for ``torch.chunk``'s and
gather the wrong elements, and a ``deepcopy`` or ``torch.load`` of such a DTensor drops the patched metadata,
so a later DCP save writes the wrong boxes; silently, both. shardplan's own checkpoints already describe any
layout to DCP (``ShardedTensor``, dcp_values.py). Plain local states are right for everything torch's
optimizer contract promises, and the marker refuses the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..errors import CheckpointError

KEY = "shardplan_local_states"  # param_groups[0][KEY]: the marker (a key torch's optimizers never use)

WAYS_OUT = ("save and load sharded checkpoints with shardplan.checkpoint.state_dict(model, opt) / "
            "shardplan.checkpoint.load_state_dict(model, sd, opt) (or shardplan.checkpoint.save(path, model, opt) / "
            "shardplan.checkpoint.load), export with shardplan.checkpoint.full_state_dict(model), or plan with "
            "layout=\"chunked\" (shardplan.plan(..., layout=\"chunked\")), whose shards are torch.chunk pieces "
            "as with FSDP2")

Box = Optional[tuple[tuple[int, int], ...]]


@dataclasses.dataclass(frozen=True)
class LocalStates:
    """Which elements a local optimizer state dict holds: ``boxes[i]`` is ``(parameter name, global box)`` of the
    optimizer's ``i``-th parameter on ``rank`` (``None``: nothing, or not a sharded parameter), at ``world``
    ranks under plan ``plan`` (its fingerprint); ``param``/``why``: a parameter no DTensor describes, and why."""

    rank: int
    world: int
    plan: str
    boxes: tuple[tuple[Optional[str], Box], ...]
    param: str = ""
    why: str = ""

    def __create_write_items__(self, fqn: str, _obj) -> list:
        """DCP's planner asks every value it saves for its write items: a local state dict is refused."""
        raise CheckpointError(
            f"torch.distributed.checkpoint.save ({fqn}): the optimizer's states of parameter {self.param!r} cannot "
            f"be given as DTensors ({self.why}); optimizer.state_dict() (and torch's get_optimizer_state_dict) "
            f"gives this rank's local shards, of which DCP would keep one rank's copy as if replicated. "
            f"To checkpoint this model, {WAYS_OUT}")


torch.serialization.add_safe_globals([LocalStates])  # a per-rank torch.load(weights_only=True) reads it back


def _box(plan, name: Optional[str], rank: int) -> Box:
    box = plan.local_slices(name, rank) if name is not None else None
    if box is None or any(s.stop <= s.start for s in box):
        return None
    return tuple((s.start, s.stop) for s in box)


def marker(optimizer: torch.optim.Optimizer, exe) -> LocalStates:
    """The marker of ``optimizer``'s local states on this rank (``exe``: the sharded model's engine)."""
    names = {id(lp): n for n, lp in exe.local_params().items()}
    order = [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    hooks = exe.state_dict_hooks
    why = hooks.layout[hooks.bad][1] if hooks.bad is not None else ""
    return LocalStates(rank=exe.rank, world=exe.plan.mesh.size, plan=exe.plan.fingerprint(),
                       boxes=tuple((n, _box(exe.plan, n, exe.rank)) for n in order), param=hooks.bad or "", why=why)


def mark(sd: dict, optimizer: torch.optim.Optimizer, exe) -> dict:
    """``sd`` (torch's ``optimizer.state_dict()``) with the marker in its first parameter group."""
    groups = [dict(g) for g in sd["param_groups"]]
    if groups:
        groups[0][KEY] = marker(optimizer, exe)
    return {**sd, "param_groups": groups}


def unmark(sd: dict, optimizer: torch.optim.Optimizer, exe) -> dict:
    """``sd`` without the marker, after checking that this rank holds the elements it was saved from; a dict
    without one is returned as it is (DTensors and full tensors describe themselves)."""
    found = [g[KEY] for g in sd.get("param_groups", ()) if isinstance(g, dict) and KEY in g]
    if not found:
        return sd
    check(found[0], marker(optimizer, exe), "optimizer.load_state_dict()")
    return {**sd, "param_groups": [{k: v for k, v in g.items() if k != KEY} for g in sd["param_groups"]]}


def check(saved: LocalStates, here: LocalStates, what: str) -> None:
    """Refuse local states ``saved`` where this rank (``here``) holds other elements of any parameter."""
    if not isinstance(saved, LocalStates):
        raise CheckpointError(f"{what}: param_groups[0][{KEY!r}] is {type(saved).__name__}, not shardplan's marker "
                              f"of local optimizer states; leave the key to shardplan")
    if saved.boxes == here.boxes:
        return
    where = (f"rank {saved.rank} of {saved.world} under plan {saved.plan}; this optimizer is rank {here.rank} of "
             f"{here.world} under plan {here.plan}")
    if len(saved.boxes) != len(here.boxes):
        diff = f"they hold {len(saved.boxes)} parameters' states, this optimizer {len(here.boxes)} parameters"
    else:
        i, (name, box) = next((i, b) for i, b in enumerate(saved.boxes) if b != here.boxes[i])
        mine, my_box = here.boxes[i]
        diff = (f"the saving rank held elements {_fmt(box)} of the optimizer's parameter {i} ({name!r}), this rank "
                f"holds {_fmt(my_box)}" + ("" if mine == name else f" of {mine!r}"))
    raise CheckpointError(
        f"{what}: these are local optimizer states (this rank's shards, from optimizer.state_dict()) of {where}: "
        f"{diff}. Loaded, they would update the wrong elements. A local state dict loads only where the rank holds "
        f"the same shards (the same plan, world size and rank); to reshard, save with shardplan.checkpoint.save(path, "
        f"model, opt) and load with shardplan.checkpoint.load(path, model, opt), which take any world size, plan "
        f"or layout")


def _fmt(box: Box) -> str:
    return "nothing" if box is None else "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def adopt_loaded(optimizer: torch.optim.Optimizer, exe=None) -> None:
    """What ``load_state_dict`` gave an optimizer before shardplan's hooks existed (they come at its first
    ``step()``): the marker checked and taken out of ``param_groups``, DTensor states made this rank's shards,
    as the load hook does. (Plain states of the full shape stay refused by the step's check: built before
    sharding, they cannot be told from loaded ones.) ``exe``: the engine of the optimizer's parameters (found
    when ``None``)."""
    from torch.distributed.tensor import DTensor
    exe = exe if exe is not None else _engine_of(optimizer)
    if exe is None or getattr(exe, "state_dict_hooks", None) is None or getattr(exe, "dtensor_params", False) \
            or exe.plan.offload or getattr(optimizer, "_shardplan_offload", False):
        return
    found = [g[KEY] for g in optimizer.param_groups if KEY in g]
    if found:  # (refused: the marker stays, so that every later step() refuses too)
        check(found[0], marker(optimizer, exe), "optimizer.load_state_dict() (checked at the first step() after it)")
        for g in optimizer.param_groups:
            g.pop(KEY, None)
    names = {id(lp): n for n, lp in exe.local_params().items()}
    for p, st in optimizer.state.items():
        name = names.get(id(p))
        for k, v in list(st.items()):
            if name is not None and isinstance(v, DTensor):
                local = exe.state_dict_hooks.local_value(name, f"state.{name}.{k}", v, p)
                st[k] = torch.zeros_like(p) if local.numel() == 0 else local.clone()


def _engine_of(optimizer: torch.optim.Optimizer):
    """The one engine whose local shards are all of ``optimizer``'s parameters (``None`` otherwise)."""
    engines = set()
    for g in optimizer.param_groups:
        for p in g["params"]:
            ref = p.__dict__.get("_shardplan_engine")
            eng = ref() if ref is not None else None
            if eng is None:
                return None
            engines.add(eng)
    return engines.pop() if len(engines) == 1 else None
