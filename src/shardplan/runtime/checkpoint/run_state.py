"""A run's state beside the model and optimizer: the lr scheduler, the data loader's position, every rank's
random number generators and the user's own state, in the same checkpoint directory.

>>> sp.checkpoint.save(path, model, opt, step=step, lr_scheduler=sched, dataloader=loader, rng=True,
...                    extra={"train_state": train_state, "tokens": tokens})
>>> step = sp.checkpoint.load(path, model, opt, lr_scheduler=sched, dataloader=loader, rng=True,
...                           extra={"train_state": train_state, "tokens": tokens})

How each part is stored (DCP keys; objects are ``torch.save`` bytes, which DCP keeps as one opaque entry):

* ``lr_scheduler``: its ``state_dict()``, one copy (rank 0's: every rank steps the same schedule).
* ``dataloader.dp_<i>``: the ``state_dict()`` of data-parallel slice ``i``'s loader (``plan.data_index``;
  ranks that share a slice, tensor-parallel ones, share the entry). A loader's position is a count of
  *its* samples: it does not reshard, so loading needs the same number of slices.
* ``rng.rank_<r>``: rank ``r``'s generators (Python's ``random``, torch's CPU generator, the current CUDA
  device's, and NumPy's global one if NumPy is imported). Loading needs the same world size.
* ``user.<name>``: ``extra[name]``. A tensor (plain, ``DTensor``) is a DCP tensor: plain ones are rank 0's
  value, DTensors reshard like the model; an object with ``state_dict()`` / ``load_state_dict()`` is its
  state; anything else is the value itself (rank 0's), pickled.

Loading reads only the parts asked for; one asked for and not in the checkpoint (or saved by another
number of slices or ranks) raises :class:`~shardplan.errors.CheckpointError` before anything loads, or with
``strict=False`` is skipped with a warning.
"""

from __future__ import annotations

import io
import random
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ...errors import CheckpointError
from .. import collectives as C


@dataclass
class RunState:
    """What a save or load of a run's state involves, besides the model and optimizer."""

    lr_scheduler: Any = None
    dataloader: Any = None
    rng: bool = False
    extra: Optional[dict] = None

    def __post_init__(self):
        if self.dataloader is not None:
            _check_stateful(self.dataloader, "dataloader")
        if self.lr_scheduler is not None:
            _check_stateful(self.lr_scheduler, "lr_scheduler")
        if self.extra is not None and not isinstance(self.extra, dict):
            raise CheckpointError(f"extra={type(self.extra).__name__}: pass a dict of named values, e.g. "
                                  f"extra={{'train_state': state, 'tokens_seen': n}}")
        if not isinstance(self.rng, bool):
            raise CheckpointError(f"rng={self.rng!r}: pass True to save (or restore) every rank's generators")

    @property
    def empty(self) -> bool:
        return self.lr_scheduler is None and self.dataloader is None and not self.rng and not self.extra


def _stateful(obj) -> bool:
    return (not isinstance(obj, torch.Tensor) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def _check_stateful(obj, what: str) -> None:
    if _stateful(obj):
        return
    hint = ""
    if what == "dataloader":
        hint = (" A torch.utils.data.DataLoader keeps no position: use torchdata's StatefulDataLoader, a drop-in "
                "replacement (pip install torchdata; from torchdata.stateful_dataloader import StatefulDataLoader), "
                "or any iterable with state_dict()/load_state_dict()")
    raise CheckpointError(f"{what}={type(obj).__name__}: it has no state_dict()/load_state_dict() to save and "
                          f"restore.{hint}")


def _pack(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data) -> Any:
    if isinstance(data, (bytes, bytearray)):
        return torch.load(io.BytesIO(data), weights_only=False)
    return data


def rng_state() -> dict:
    """This process's generators: Python's, torch's CPU one, the current CUDA device's, NumPy's if imported."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])


def saved_entries(run: RunState, plan, world, rank: int) -> dict:
    """The DCP entries of ``run`` on this rank (top-level keys ``lr_scheduler``, ``dataloader``, ``rng``,
    ``user``); every rank calls it (plain tensors of ``extra`` are broadcast from rank 0)."""
    out: dict = {}
    if run.lr_scheduler is not None and rank == 0:
        out["lr_scheduler"] = _pack(run.lr_scheduler.state_dict())
    if run.dataloader is not None:
        out["dataloader"] = {f"dp_{plan.data_index(rank)}": _pack(run.dataloader.state_dict())}
    if run.rng:
        out["rng"] = {f"rank_{rank}": _pack(rng_state())}
    if run.extra:
        user = {}
        for name, value in run.extra.items():
            _check_name(name)
            if isinstance(value, torch.Tensor):
                user[name] = _tensor_entry(value, world)
            elif rank == 0:
                user[name] = _pack(value.state_dict() if _stateful(value) else value)
        out["user"] = user
    return out


def _check_name(name) -> None:
    if not isinstance(name, str) or not name or "." in name:
        raise CheckpointError(f"extra key {name!r}: use a non-empty string without dots (DCP joins nested keys "
                              f"with '.')")


def _tensor_entry(value: torch.Tensor, world):
    if hasattr(value, "__create_write_items__"):  # a DTensor: DCP saves (and reshards) it itself
        return value
    t = value.detach().clone()  # rank 0's value, so that the one copy DCP keeps does not depend on the rank
    if world is not None and world.size > 1:
        # as an object: a CPU tensor of user state may meet an NCCL group (state is small; a big one is a DTensor)
        t.copy_(C.broadcast_object(t.cpu(), world.pg))
    return t


@dataclass
class Request:
    """What a load asks DCP for (``entries``, to merge into the state dict handed to DCP), and what to do
    once DCP filled them (``apply(loaded)``: DCP replaces opaque entries in the dict it was given)."""

    entries: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)
    appliers: list = field(default_factory=list)

    def apply(self, loaded: dict) -> None:
        for fn in self.appliers:
            fn(loaded)


def requested(run: RunState, plan, world_size: int, rank: int, meta: dict, path: str) -> Request:
    """The entries of ``run`` to read from the checkpoint whose metadata is ``meta`` (``{flat key: ...}``),
    and the problems found (each a line of the error)."""
    req = Request()
    if run.lr_scheduler is not None:
        if "lr_scheduler" in meta:
            req.entries["lr_scheduler"] = b""
            req.appliers.append(lambda d: run.lr_scheduler.load_state_dict(_unpack(d["lr_scheduler"])))
        else:
            req.problems.append("lr_scheduler: not in the checkpoint (it was saved without lr_scheduler=)")
    if run.dataloader is not None:
        slices = sorted(int(k[len("dataloader.dp_"):]) for k in meta if k.startswith("dataloader.dp_"))
        mine = plan.data_index(rank)
        if not slices:
            req.problems.append("dataloader: not in the checkpoint (it was saved without dataloader=)")
        elif len(slices) != plan.data_size:
            req.problems.append(
                f"dataloader: saved by {len(slices)} data-parallel slices, this run has {plan.data_size}; a loader's "
                f"position counts its own samples and does not reshard: load with dataloader=None and start the "
                f"loader at the sample the step implies (step x global batch), or resume on {len(slices)} slices")
        else:
            req.entries["dataloader"] = {f"dp_{mine}": b""}
            req.appliers.append(lambda d: run.dataloader.load_state_dict(_unpack(d["dataloader"][f"dp_{mine}"])))
    if run.rng:
        ranks = sorted(int(k[len("rng.rank_"):]) for k in meta if k.startswith("rng.rank_"))
        if not ranks:
            req.problems.append("rng: not in the checkpoint (it was saved without rng=True)")
        elif len(ranks) != world_size:
            req.problems.append(
                f"rng: saved by {len(ranks)} ranks, this run has {world_size}; generator streams are per rank: load "
                f"with rng=False (this run's generators go on; the run is then not bit-identical to an "
                f"uninterrupted one), or resume on {len(ranks)} ranks")
        else:
            req.entries["rng"] = {f"rank_{rank}": b""}
            req.appliers.append(lambda d: set_rng_state(_unpack(d["rng"][f"rank_{rank}"])))
    if run.extra:
        user: dict = {}
        for name, value in run.extra.items():
            _check_name(name)
            key = f"user.{name}"
            if key not in meta:
                saved = sorted(k[len("user."):] for k in meta if k.startswith("user."))
                req.problems.append(f"extra[{name!r}]: not in the checkpoint (it holds extra keys {saved})")
                continue
            is_tensor = hasattr(meta[key], "size") and hasattr(meta[key], "properties")
            if isinstance(value, torch.Tensor):
                if not is_tensor:
                    req.problems.append(f"extra[{name!r}]: a tensor here, a Python value in the checkpoint")
                    continue
                if tuple(value.shape) != tuple(meta[key].size):
                    req.problems.append(f"extra[{name!r}]: shape {tuple(value.shape)} here, "
                                        f"{tuple(meta[key].size)} in the checkpoint")
                    continue
                user[name] = value  # DCP loads into it in place
            else:
                if is_tensor:
                    req.problems.append(f"extra[{name!r}]: a tensor in the checkpoint; pass a tensor of shape "
                                        f"{tuple(meta[key].size)} to load it into")
                    continue
                user[name] = b""
                req.appliers.append(_restore_extra(run.extra, name))
        if user:
            req.entries["user"] = user
    return req


def _restore_extra(extra: dict, name: str) -> Callable[[dict], None]:
    def restore(loaded: dict):
        value = _unpack(loaded["user"][name])
        if _stateful(extra[name]):
            extra[name].load_state_dict(value)
        else:
            extra[name] = value  # the caller's dict, filled in place
    return restore


def report(problems: list, path: str, strict: bool) -> None:
    """Raise (``strict``) or warn about the parts of a run's state that cannot be loaded."""
    if not problems:
        return
    text = f"checkpoint {path}: " + "; ".join(problems)
    if strict:
        raise CheckpointError(text + " (strict=False loads the rest and warns)")
    warnings.warn(text + "; those parts keep their current state", stacklevel=3)
