"""FSDP2's face: ``fully_shard`` marks units (compiled into one plan at the first use, ``compile.py``),
``MixedPrecisionPolicy``, and ``ShardPlanModule``, the class every marked module gains, with FSDP2's
``FSDPModule`` methods (honoured, accepted as hints, or refused naming the fix)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from ..errors import ShardingError
from ..runtime.api import engine_of
from .common import _unsupported
from .compile import _compile_root, _ensure_compiled
from .forward_methods import FORWARD_STATE
from .marks import _COMPILING, _MARK, _SYNC_SET, _check_sync_flags, _marked, _marked_of_root


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy``: ``param_dtype`` is the compute dtype parameters are gathered in,
    ``reduce_dtype`` the gradient reduction dtype. FSDP2's own policy objects are accepted too.

    >>> fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch without FSDP2
    FSDPModule = object


class ShardPlanModule(FSDPModule):
    """Mixed into the class of a module ``fully_shard`` was called on (as FSDP2 does): the first use of
    its parameters or forward compiles the plan if no call on an ancestor did. It is a subclass of torch's
    public ``FSDPModule`` (so ``isinstance(m, FSDPModule)`` holds, and torch's ``register_fsdp_forward_method``
    takes it) and overrides every method ``FSDPModule`` defines: each is honoured, or is a scheduling hint the
    plan's schedule already decides (accepted, the numbers cannot change), or raises a :class:`ShardingError`
    naming itself and what to do instead. Nothing of FSDP2's own state or code runs on it."""

    def __new__(cls, *args, **kwargs):
        # not FSDPModule's __new__ (which builds the class two places down its MRO, its own layout's): an
        # ordinary instance of this class, as object's __new__ makes one (``copy.deepcopy`` before the plan compiles)
        new = super(FSDPModule, cls).__new__
        return new(cls) if new is object.__new__ else new(cls, *args, **kwargs)

    def _get_fsdp_state(self):
        """What torch's ``register_fsdp_forward_method`` calls: :class:`~shardplan.dropin.forward_methods.ForwardState`."""
        return FORWARD_STATE

    def _set_unshard_async_op(self, async_op: bool):
        raise ShardingError("FSDPModule._set_unshard_async_op() is not supported by shardplan: each unit is gathered "
                            "by the plan's schedule (shardplan.plan_of(model) shows it). Remove the call")

    def parameters(self, recurse: bool = True):
        _ensure_compiled(self)
        return super().parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        _ensure_compiled(self)
        return super().named_parameters(*args, **kwargs)

    def _apply(self, fn, recurse: bool = True):
        # .to()/.cuda()/.to_empty() compile first, so the sharded module's guard answers them (a meta model is
        # materialised by the plan; .to_empty() after fully_shard raises naming that), as before the first use
        if _MARK in self.__dict__ and not _COMPILING[0] and self.__dict__[_MARK].get("root") is None:
            _ensure_compiled(self)
            if "_apply" in self.__dict__:
                return self.__dict__["_apply"](fn, recurse)
        return super(FSDPModule, self)._apply(fn, recurse)  # nn.Module's (FSDPModule's would reshard first)

    def to_empty(self, *, device, recurse: bool = True):
        """FSDP2's (torchtitan's) start-up: ``fully_shard`` the blocks, then the root, of a model built under
        ``torch.device("meta")``, then ``model.to_empty(device=...)`` and the model's own initialisation
        (``model.init_weights()``). Called on the root before its first use, it compiles the plan with this
        rank's shards given storage on ``device`` and left uninitialised (no ``reset_parameters``), and the
        modules hold FSDP2's DTensor parameters over those shards until the first use (see [Note: the init
        view]), so the model's own init writes the values it writes under FSDP2."""
        if _COMPILING[0] or _MARK not in self.__dict__ or "_shardplan" in self.__dict__ \
                or self.__dict__[_MARK].get("root") is not None:
            return super().to_empty(device=device, recurse=recurse)
        owner = self
        while owner.__dict__[_MARK].get("owner") is not None:
            owner = owner.__dict__[_MARK]["owner"]
        if owner is not self:
            raise ShardingError(f"fully_shard: to_empty() on a {type(self).__name__} that another fully_shard call "
                                f"encloses ({type(owner).__name__}); call to_empty(device=...) on the root model (the "
                                f"module of the last fully_shard call), which gives every unit its storage")
        _compile_root(self, empty_on=torch.device(device))
        return self

    def __deepcopy__(self, memo):
        opts = self.__dict__[_MARK]
        if not _COMPILING[0] and (opts.get("root") is not None or "_shardplan" in self.__dict__):
            raise ShardingError("copy.deepcopy of a fully_shard module is not supported (FSDP2 refuses it too): its "
                                "parameters are this rank's shards, run by the model's plan and process groups. Build "
                                "another model and load the weights into it: set_model_state_dict(copy, "
                                "get_model_state_dict(model)) (torch.distributed.checkpoint.state_dict)")
        import copy
        new = type(self).__new__(type(self))  # before the plan compiles: an ordinary copy, marks included
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        return new

    def state_dict(self, *args, **kwargs):
        _ensure_compiled(self)
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        _ensure_compiled(self)
        return super().load_state_dict(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        _ensure_compiled(self)
        if self.__dict__[_MARK].get("root") is self:
            _check_sync_flags(self)
        return super().__call__(*args, **kwargs)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch for gradient accumulation: ``False`` skips the reductions (``shardplan.no_sync``).
        shardplan switches the whole model at once: the modules' flags must agree by the root's next forward
        (on the root with ``recurse=True``, or on every module), else that forward raises."""
        _SYNC_SET[0] = True
        root = self.__dict__[_MARK].get("root")
        mods = [m for _, m in _marked_of_root(root)] if root is self and recurse else _marked(self, recurse)
        for m in mods:
            m.__dict__[_MARK]["sync"] = bool(requires_gradient_sync)
        if root is not None:
            root.__dict__[_MARK]["sync_checked"] = False  # the root's next forward checks the flags agree
            flags = {m.__dict__[_MARK].get("sync", True) for _, m in _marked_of_root(root)}
            if len(flags) == 1:
                engine_of(root).sync = flags.pop()

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP's all-reduce over replicas: ``True`` (the default) only; skipping it would leave each replica's
        gradients partial at the next ``optimizer.step()``."""
        if requires_all_reduce is not True:
            raise ShardingError("FSDPModule.set_requires_all_reduce(False) is not supported by shardplan: gradients "
                                "are reduced over every data-parallel rank at once. For accumulation use "
                                "set_requires_gradient_sync(False) on the root")

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Before the plan compiles (the root's ``fully_shard`` call, or the first forward), as the argument of
        ``fully_shard``; afterwards only the value the plan already has."""
        if not isinstance(reshard_after_forward, bool):
            raise ShardingError(f"FSDPModule.set_reshard_after_forward({reshard_after_forward!r}): shardplan takes "
                                f"True or False")
        root = self.__dict__[_MARK].get("root")
        mods = _marked(self, recurse)
        if root is None:
            for m in mods:
                m.__dict__[_MARK]["reshard_after_forward"] = reshard_after_forward
            return
        plan = engine_of(root).plan
        names = {id(m): n for n, m in root.named_modules()}
        differ = [names[id(m)] for m in mods if m is not root and names[id(m)] in {u.name for u in plan.units}
                  and plan.unit(names[id(m)]).reshard_after_forward != reshard_after_forward]
        if differ:
            raise ShardingError(f"FSDPModule.set_reshard_after_forward({reshard_after_forward}) after the plan was "
                                f"compiled (units {differ}): shardplan fixes it in the plan. Pass "
                                f"fully_shard(module, reshard_after_forward={reshard_after_forward}) instead")

    def unshard(self, async_op: bool = False):
        raise ShardingError("FSDPModule.unshard() is not supported by shardplan: each unit is gathered by the plan's "
                            "schedule at its forward (and prefetched by it), and the modules hold local shards "
                            "outside it. Remove the call; for prefetching see shardplan.plan_of(model); for the full "
                            "parameters use torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
                            "options=StateDictOptions(full_state_dict=True))")

    def reshard(self) -> None:
        raise ShardingError("FSDPModule.reshard() is not supported by shardplan: the plan's schedule frees each "
                            "unit after its forward and backward. Remove the call (and the unshard() it pairs with)")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """FSDP2's default, the data-parallel world size (a mean), only."""
        _check_divide(self, factor, "set_gradient_divide_factor")

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        _check_divide(self, factor, "set_reduce_scatter_divide_factor")

    # scheduling hints: the plan's schedule decides gathers, frees and prefetches; the numbers are the same
    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted: the end of each backward is found by the runtime; gradients are the same."""

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Accepted: the plan frees each unit after its backward (memory only; gradients are the same)."""

    def set_modules_to_forward_prefetch(self, modules) -> None:
        """Accepted: the plan's schedule prefetches (``shardplan.plan_of(model)`` shows it)."""

    def set_modules_to_backward_prefetch(self, modules) -> None:
        """Accepted: the plan's schedule prefetches (``shardplan.plan_of(model)`` shows it)."""

    def set_post_optim_event(self, event) -> None:
        """Accepted: the next forward's gathers follow the optimizer step on the current stream."""

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Accepted: shardplan gathers a unit for backward whenever its backward needs the parameters."""

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: the reduction gives the mean either way (sum then divide, or ``ReduceOp.AVG``)."""

    def reset_iter_state(self) -> None:
        """Accepted: a forward that raised is abandoned at the next forward."""


def _check_divide(module: nn.Module, factor: float, where: str) -> None:
    root = module.__dict__[_MARK].get("root")
    if root is None:
        _ensure_compiled(module)
        root = module.__dict__[_MARK].get("root") or module
    want = engine_of(root).plan.mesh.size  # fully_shard's mesh is all data parallel (HSDP: replicate x shard)
    if float(factor) != float(want):
        raise ShardingError(f"FSDPModule.{where}({factor}) is not supported by shardplan: gradients are averaged over "
                            f"the {want} data-parallel ranks (FSDP2's default factor, {want}). Scale the loss by "
                            f"{want}/{factor} instead")


def _unsupported_method(name: str):
    def method(self, *args, **kwargs):
        raise ShardingError(f"FSDPModule.{name}() is not supported by shardplan's fully_shard: its collectives are "
                            f"the plan's (shardplan.plan_of(model) shows them). Remove the call")
    method.__name__ = name
    return method


def _fill_fsdp_module_api() -> None:
    """Every other method torch's ``FSDPModule`` defines raises naming itself: none of FSDP2's code runs on a
    shardplan module (each would look for FSDP2's own state)."""
    if FSDPModule is object:  # pragma: no cover - torch without FSDP2
        return
    for name, v in vars(FSDPModule).items():
        if not name.startswith("__") and callable(v) and name not in vars(ShardPlanModule):
            setattr(ShardPlanModule, name, _unsupported_method(name))


_fill_fsdp_module_api()


_CLASSES: dict[type, type] = {}


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, ShardPlanModule):
        return
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ShardPlan{cls.__name__}", (ShardPlanModule, cls), {"__module__": cls.__module__})
    module.__class__ = _CLASSES[cls]


def fully_shard(module: nn.Module, *, mesh: Optional[Any] = None, reshard_after_forward: bool = True,
                shard_placement_fn: Optional[Callable] = None, mp_policy: Optional[Any] = None,
                offload_policy: Optional[Any] = None, ignored_params: Optional[set] = None,
                order: Optional[str] = None, sync_module_states: bool = False) -> nn.Module:
    """FSDP2's ``fully_shard``, built on one shardplan plan: call it on each block, then on the root.

    >>> for block in model.layers: fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    >>> fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    >>> optimizer = torch.optim.AdamW(model.parameters())     # local shards, as with FSDP2's DTensors

    Each call marks a unit (a list of modules: one unit each); the first use of any of them (forward,
    ``parameters()``, ``state_dict()``) compiles the plan of the outermost marked module, as FSDP2 finds its
    root at the first forward, so calls nest to any depth: every parameter sharded on dim 0 (or the dim
    ``shard_placement_fn`` picks, ``torch.chunk`` pieces as FSDP2 makes) over the mesh (a 2-D ``DeviceMesh`` is HSDP: replicate, shard),
    ZeRO-3, each unit resharded after forward unless its call said ``False``. ``order="dynamic"`` (shardplan's
    own argument, on any call) is for models that run a unit more than once per step or in a data-dependent
    order (two forwards, then one backward; a ``generate`` loop with gradients): the plan keeps units gathered
    until the forward ends instead of raising. ``sync_module_states=True`` (shardplan's, FSDP1's name; on any
    call) broadcasts rank 0's parameter and buffer values when the plan compiles, instead of refusing ranks
    whose models hold different values (FSDP2 leaves that check to the user). The module's class gains
    FSDP2's ``set_requires_gradient_sync``. ``model.state_dict()`` gives DTensors, as FSDP2's does, so
    ``torch.distributed.checkpoint`` and ``get_model_state_dict``/``set_model_state_dict`` work unchanged.
    """
    offload_ok = offload_policy is None or type(offload_policy).__name__ == "OffloadPolicy"
    _unsupported("fully_shard", offload_policy=(offload_policy, lambda v: offload_ok),
                 ignored_params=(ignored_params, lambda v: not v),
                 reshard_after_forward=(reshard_after_forward, lambda v: isinstance(v, bool)))
    if mp_policy is not None:
        _unsupported("fully_shard(mp_policy)", output_dtype=(getattr(mp_policy, "output_dtype", None), lambda v: v is None),
                     cast_forward_inputs=(getattr(mp_policy, "cast_forward_inputs", True), lambda v: v is True))
    if isinstance(module, (list, tuple)):  # FSDP2's group of modules: one unit each here (the same numbers)
        for m in module:
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=shard_placement_fn, mp_policy=mp_policy, offload_policy=offload_policy,
                        order=order, sync_module_states=sync_module_states)
        return module
    if "_shardplan" in module.__dict__:
        raise ShardingError("fully_shard: this module is already sharded (its plan was compiled)")
    _refuse_compiled_inside(module)
    module.__dict__[_MARK] = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                                  shard_placement_fn=shard_placement_fn, root=None, order=order, owner=None,
                                  sync_module_states=bool(sync_module_states))
    _swap_class(module)
    # [Note: the plan compiles at first use] FSDP2 finds its root at the first forward, so fully_shard may
    # nest to any depth (experts, then blocks, then the model). The outermost call so far owns every marked
    # module inside it; the first use of any of them (forward, parameters(), state_dict(), ...) compiles
    # the owner's plan.
    for name, m in module.named_modules():
        if name and _MARK in m.__dict__:
            m.__dict__[_MARK]["owner"] = module
    return module


def _refuse_compiled_inside(module: nn.Module) -> None:
    inner = [name for name, m in module.named_modules()
             if name and (m.__dict__.get(_MARK, {}).get("root") is not None or "_shardplan" in m.__dict__)]
    if inner:
        raise ShardingError(f"fully_shard: submodule {inner[0]!r} already runs its own plan (it was used, or "
                            f"sharded, before this call, which made it a root); shardplan compiles one plan per "
                            f"root at the first use. Call fully_shard on every module, innermost first and the "
                            f"root last, before using any of them")
