"""The parameters a user holds before sharding are the ones that train after it.

``shard()`` turns every parameter into this rank's shard. Torch users build optimizers from
``model.parameters()``, and some do it before sharding (or, with the FSDP2 drop-in, before the lazy
compile at the first forward). So the local shards keep the Python identity of the original
parameters: :func:`adopt` swaps the shard into the original object (``torch.utils.swap_tensors``,
keeping its attributes), and an optimizer built earlier steps exactly what the runtime reduces into.

Where the swap is impossible (a tensor subclass, a weak reference torch refuses to move), the original
is marked, and :func:`check_optimizer` (a global optimizer step pre-hook) makes the first ``step()``
that holds a marked parameter raise, naming it and the fix, rather than train nothing. It also refuses
an optimizer whose state was built for the full, unsharded parameters, and, for a plan that offloads the
optimizer to host memory, any optimizer but :func:`shardplan.offload_optimizer`'s.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import RuntimeShardingError
from .local_optim_state import adopt_loaded
from .state_dict import install_torch_optimizer

_REPLACED = "_shardplan_replaced"  # on an original parameter the runtime could not adopt: its plan name
_SUCCESSOR = "_shardplan_successor"  # on one a DTensor parameter replaced (dtensor_params.py): that parameter
_generation = [0]                   # bumped by every shard(): optimizers are checked again once after it
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_installed = [False]


def adopt(original: torch.Tensor, local: nn.Parameter, name: str) -> nn.Parameter:
    """Make ``original`` (the parameter object the user holds) be the local shard ``local``; returns the
    object to use from now on (``original``, or ``local`` where the swap is impossible)."""
    if original is local:
        return local
    if type(original) is not type(local) or original.requires_grad != local.requires_grad:
        original.__dict__[_REPLACED] = name
        return local
    attrs = dict(original.__dict__)
    try:
        # [Note: swap, not .data] ``original.data = shard`` cannot move a meta parameter to a device;
        # swap_tensors exchanges the whole tensor (storage, shape, grad, version counter) and __dict__,
        # so the attributes (hooks, framework flags) are put back on the original afterwards.
        torch.utils.swap_tensors(original, local)
    except RuntimeError:
        original.__dict__[_REPLACED] = name
        return local
    original.__dict__.update(attrs)
    return original


def sharded() -> None:
    """A ``shard()`` happened: check each optimizer once more at its next step."""
    _generation[0] += 1
    if not _installed[0]:
        register_optimizer_step_pre_hook(check_optimizer)
        _installed[0] = True


def check_optimizer(opt: torch.optim.Optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook: refuse to step parameters sharding replaced, or state shaped for the full
    parameters. Once per optimizer after each ``shard()``; a dictionary look-up otherwise."""
    if _checked.get(opt) == _generation[0]:
        return
    adopt_loaded(opt)  # states loaded before the state-dict hooks existed: checked, made this rank's shards
    whole_only = _not_elementwise(opt)
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            name = p.__dict__.get(_REPLACED)
            successor = p.__dict__.get(_SUCCESSOR)
            if name is not None and successor is not None and not opt.state.get(p):
                # [Note: an optimizer built before fully_shard's lazy compile] holds the objects the model had
                # then; the DTensor parameter that replaced each (dtensor_params.py) takes its place in the
                # optimizer, which has no state for it yet: the step trains what the runtime reduces into
                group["params"][i] = p = successor
                name = None
            if name is not None:
                raise RuntimeShardingError(
                    f"shardplan: the optimizer steps parameter {name!r} as it was before sharding; shard() replaced it "
                    f"with this rank's shard, so the step would train nothing. Build the optimizer after "
                    f"shardplan.shard(model, plan) (or after the first forward of a fully_shard model), from "
                    f"model.parameters()")
            if "_shardplan_engine" not in p.__dict__:
                continue
            eng = p.__dict__["_shardplan_engine"]()
            if eng is not None and whole_only:
                _refuse_local_shard(opt, eng, p)
            if eng is not None and eng.plan.offload and not getattr(opt, "_shardplan_offload", False):
                raise RuntimeShardingError(
                    f"shardplan: the plan offloads the optimizer to host memory (offload={eng.plan.offload!r}), so "
                    f"{type(opt).__name__} over model.parameters() would step the device shards and miss the host "
                    f"masters; build the optimizer with shardplan.offload_optimizer(model, lr=..., betas=..., "
                    f"weight_decay=...) (AdamW), or plan without offload")
            for key, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != p.shape:
                    raise RuntimeShardingError(
                        f"shardplan: optimizer state {key!r} of a sharded parameter has shape {tuple(v.shape)}, the "
                        f"parameter (this rank's shard) {tuple(p.shape)}: the state was built before sharding. Build "
                        f"the optimizer after shardplan.shard(), or load its state with shardplan.checkpoint.load / "
                        f"shardplan.checkpoint.load_state_dict, which reshard it")
    _checked[opt] = _generation[0]
    _install_dcp_hooks(opt)


# torch's optimizers whose update of a parameter reads more than its own elements: Adafactor (row and column
# means of the second moment), LBFGS (dot products over every gradient), Muon (the whole matrix)
_NOT_ELEMENTWISE = ("Adafactor", "LBFGS", "Muon")


def _not_elementwise(opt) -> bool:
    return any(c.__name__ in _NOT_ELEMENTWISE and c.__module__.startswith("torch.optim") for c in type(opt).__mro__)


def _refuse_local_shard(opt, eng, p) -> None:
    """[Note: a non-elementwise optimizer over local shards] over this rank's piece of a parameter (a plain
    tensor of the piece's shape), such an optimizer computes another update than one process, silently; over
    DTensor parameters torch computes its reductions globally, or raises where DTensor cannot."""
    from torch.distributed.tensor import DTensor
    if isinstance(p, DTensor) or not p.requires_grad:  # (a frozen parameter is never updated)
        return
    names = eng.__dict__.get("_local_names")
    if names is None:
        by_name = getattr(getattr(eng, "face", None), "by_name", None) or {}
        names = eng.__dict__["_local_names"] = {id(lp): n for n, lp in by_name.items()}
    name = names.get(id(p))
    pp = next((q for q in eng.plan.params if q.name == name), None) if name is not None else None
    if pp is None or tuple(pp.shape) == tuple(p.shape):
        return  # replicated on this rank: its own elements are all of it
    raise RuntimeShardingError(
        f"shardplan: {type(opt).__name__} updates a parameter from more than its own elements, but {name!r} is this "
        f"rank's piece {tuple(p.shape)} of {tuple(pp.shape)} (rule {pp.rule!r}): every rank would compute another "
        f"update than one process does, silently. Use an elementwise optimizer (AdamW, SGD, ...) or replicate this "
        f"parameter (a rule with P()); over DTensor parameters (shardplan.fully_shard, or shardplan.shard(model, "
        f"plan, dtensor_params=True) on a plan of layout='chunked') torch computes such an update globally where "
        f"its DTensor support covers the optimizer (Adafactor's does not in torch 2.13: it raises there)")


def _install_dcp_hooks(opt: torch.optim.Optimizer) -> None:
    """A plain torch optimizer over one sharded model's local shards gets the hooks that make its
    ``state_dict()`` give its states as DTensors, as FSDP2's do (runtime/state_dict.py)."""
    if getattr(opt, "_shardplan_dcp_hooks", False) or getattr(opt, "_shardplan_offload", False):
        return
    engines = set()
    for group in opt.param_groups:
        for p in group["params"]:
            ref = p.__dict__.get("_shardplan_engine")
            eng = ref() if ref is not None else None
            if eng is None or getattr(eng, "state_dict_hooks", None) is None:
                return  # not (only) a sharded model's shards: torch's own state dict
            engines.add(eng)
    if len(engines) == 1:
        eng = engines.pop()
        if eng.plan.offload:
            return
        install_torch_optimizer(opt, eng)
