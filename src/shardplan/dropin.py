"""Drop-in entry points: switch from FSDP2 or Megatron-FSDP by changing an import. Each one compiles an
ordinary :class:`Plan` (``shardplan.plan_of(model)``), which prints, dry-runs and turns back into rules
(``plan.to_source()``) like any other.

>>> from shardplan import fully_shard, MixedPrecisionPolicy            # was: torch.distributed.fsdp
>>> for block in model.layers: fully_shard(block, mp_policy=mp)
>>> fully_shard(model, mp_policy=mp)                                    # one plan, compiled at first use

>>> from shardplan import fully_shard_model, fully_shard_optimizer     # was: megatron_fsdp
>>> model = fully_shard_model(model, fsdp_unit_modules=[Block], zero_dp_strategy=3)
>>> optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters()))
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from .errors import RuntimeShardingError, ShardingError
from .mesh import Mesh
from .plan import Plan, plan as make_plan
from .plan.schedule import STRATEGIES
from .runtime.api import engine_of, shard
from .runtime.builder import FIRST_USE, FULLY_SHARD_MARK
from .spec import P
from .runtime import state_dict as SD
from .runtime import collectives as C
from .runtime.startup import device_for
from .runtime.identity import _REPLACED

_MARK = FULLY_SHARD_MARK


def plan_of(module: nn.Module) -> Plan:
    """The plan a sharded module runs (whichever entry point sharded it).

    >>> fully_shard(model); print(sp.plan_of(model))           # the schedule FSDP2's calls compiled into
    """
    _ensure_compiled(module)
    return engine_of(module).plan


def _brief(value) -> str:
    if isinstance(value, (set, list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return f"<{len(value)} parameters>"
    return repr(value)


def _unsupported(where: str, **given) -> None:
    for name, (value, ok) in given.items():
        if not ok(value):
            raise ShardingError(f"{where}: {name}={_brief(value)} is not supported by shardplan (it would be ignored); "
                                f"leave it at its default or remove it")


def _mesh_from(device_mesh, default_axis: str) -> Mesh:
    if device_mesh is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        return Mesh(**{default_axis: world})
    if device_mesh.mesh_dim_names is None:
        if device_mesh.ndim == 1:
            return Mesh(**{default_axis: device_mesh.size()})
        if device_mesh.ndim == 2:  # FSDP2's HSDP convention: (replicate, shard)
            return Mesh(replicate=device_mesh.size(0), shard=device_mesh.size(1))
        raise ShardingError("a DeviceMesh of more than two dimensions needs mesh_dim_names")
    return Mesh.from_device_mesh(device_mesh)


def _dim0_rules(axis: str, placement_fn: Optional[Callable] = None):
    """Every parameter sharded on dim 0 over ``axis`` (FSDP2's and Megatron-FSDP's default); scalars
    replicated; ``placement_fn(param) -> Shard(d) | None`` (FSDP2's ``shard_placement_fn``) picks another dim."""
    def spec(path, leaf):
        if leaf.dim() == 0:
            return P()
        d = 0
        if placement_fn is not None:
            placement = placement_fn(leaf)
            if placement is not None:
                d = getattr(placement, "dim", 0)
        return P(*([None] * d + [axis]))
    return [(r".*", spec)]


# -- FSDP2 ------------------------------------------------------------------------------------------------

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


class ShardPlanModule:
    """Mixed into the class of a module ``fully_shard`` was called on (as FSDP2 does): the first use of
    its parameters or forward compiles the plan if no call on an ancestor did. It has FSDP2's ``FSDPModule``
    methods: each is honoured, or is a scheduling hint the plan's schedule already decides (accepted, the
    numbers cannot change), or raises a :class:`ShardingError` naming itself and what to do instead."""

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
        return super()._apply(fn, recurse)

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


def _marked(module: nn.Module, recurse: bool) -> list:
    if not recurse:
        return [module]
    return [m for m in module.modules() if _MARK in m.__dict__]


_SYNC_SET = [False]  # set_requires_gradient_sync was called: the root's forwards check the flags agree


def _marked_of_root(root: nn.Module) -> list:
    """``(name, module)`` of every marked module under a compiled root, walked once (the structure is fixed
    once the plan compiled): torchtitan calls ``set_requires_gradient_sync`` at every micro-step."""
    got = root.__dict__[_MARK].get("marked_modules")
    if got is None:
        got = root.__dict__[_MARK]["marked_modules"] = [(name or "<root>", m) for name, m in root.named_modules()
                                                        if _MARK in m.__dict__]
    return got


def _check_sync_flags(root: nn.Module) -> None:
    """At the root's forward: the modules' gradient-sync flags agree (checked again only after a change)."""
    if not _SYNC_SET[0] or root.__dict__[_MARK].get("sync_checked"):
        return
    flags = {}
    for name, m in _marked_of_root(root):
        flags.setdefault(m.__dict__[_MARK].get("sync", True), []).append(name)
    if len(flags) <= 1:
        root.__dict__[_MARK]["sync_checked"] = True
    if len(flags) > 1:
        raise ShardingError(f"set_requires_gradient_sync: shardplan synchronises the gradients of the whole model at "
                            f"once, but modules {flags[False][:5]} have requires_gradient_sync=False and "
                            f"{flags[True][:5]} True. Call model.set_requires_gradient_sync(flag) on the root "
                            f"(recurse=True)")


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
    """Every other public method of torch's ``FSDPModule`` raises naming itself, not ``AttributeError``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    for name in dir(FSDPModule):
        if not name.startswith("_") and callable(getattr(FSDPModule, name)) and not hasattr(ShardPlanModule, name):
            setattr(ShardPlanModule, name, _unsupported_method(name))


_fill_fsdp_module_api()


_CLASSES: dict[type, type] = {}
_COMPILING = [False]


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, ShardPlanModule):
        return
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ShardPlan{cls.__name__}", (ShardPlanModule, cls), {"__module__": cls.__module__})
    module.__class__ = _CLASSES[cls]


def _ensure_compiled(module: nn.Module) -> None:
    opts = module.__dict__.get(_MARK)
    if _INIT_VIEWS[0] and opts is not None and not _COMPILING[0]:  # the first use after to_empty: the modules
        root = opts.get("root")                                    # get their shards back
        if root is not None and "init_views" in root.__dict__[_MARK]:
            _close_init_view(root)
    if _COMPILING[0] or opts is None or opts.get("root") is not None or "_shardplan" in module.__dict__:
        return
    while opts.get("owner") is not None:  # see [Note: the plan compiles at first use]
        module = opts["owner"]
        opts = module.__dict__[_MARK]
    if opts.get("root") is None and "_shardplan" not in module.__dict__:
        _compile_root(module)


FIRST_USE.append(_ensure_compiled)  # shardplan's functions (engine_of) on a fully_shard model are a first use


def _compile_root(root: nn.Module, empty_on: Optional[torch.device] = None) -> None:
    """Compile and shard ``root``'s plan. ``empty_on`` (``to_empty(device=...)`` before the first use): a meta
    model's shards get storage on that device, uninitialised, and the init view opens."""
    opts = root.__dict__[_MARK]
    marked = [(name, m) for name, m in root.named_modules() if name and _MARK in m.__dict__]
    # a call without mp_policy has FSDP2's default policy (no mixed precision): its module computes in fp32
    by_policy: dict = {}
    for name, o in [("<root>", opts["mp_policy"])] + [(n, m.__dict__[_MARK]["mp_policy"]) for n, m in marked]:
        key = (getattr(o, "param_dtype", None), getattr(o, "reduce_dtype", None))
        by_policy.setdefault(key, []).append(name)
    if len(by_policy) > 1:
        said = "; ".join(f"param_dtype={k[0]}, reduce_dtype={k[1]} for {v[:3]}{' ...' if len(v) > 3 else ''}"
                         for k, v in by_policy.items())
        raise ShardingError(f"fully_shard: shardplan runs one mixed-precision policy per plan, but the calls under this "
                            f"root differ ({said}; a call without mp_policy is FSDP2's default, no mixed precision). "
                            f"Give every fully_shard call the same mp_policy")
    compute, reduce = next(iter(by_policy))
    for arg in ("mesh", "shard_placement_fn"):  # the root's is the plan's: another on an inner call would be ignored
        same = (lambda a, b: _mesh_from(a, "dp") == _mesh_from(b, "dp")) if arg == "mesh" else (lambda a, b: a is b)
        other = [n for n, m in marked if not same(m.__dict__[_MARK][arg], opts[arg])]
        if other:
            raise ShardingError(f"fully_shard: {arg} of the calls on {other[:3]} differs from the root's; shardplan "
                                f"compiles one plan over one mesh with one placement function. Pass the same {arg} "
                                f"to every fully_shard call")
    orders = {o for o in [opts.get("order")] + [m.__dict__[_MARK].get("order") for _, m in marked] if o is not None}
    if len(orders) > 1:
        raise ShardingError(f"fully_shard: the calls under this root ask for order={sorted(orders)}; a plan has one "
                            f"order: give every call the same (or only the root's call)")
    order = orders.pop() if orders else "static"
    mesh = _mesh_from(opts["mesh"], "dp")
    axis = "shard" if "shard" in mesh.axis_names else mesh.axis_names[-1]
    _COMPILING[0] = True
    try:
        p = make_plan(root, _dim0_rules(axis, opts["shard_placement_fn"]), mesh, strategy="optim_grads_params",
                      units=[re.escape(name) for name, _ in marked], compute_dtype=compute, reduce_dtype=reduce,
                      min_unit_bytes=0, layout="chunked", order=order)  # torch.chunk shards: DTensor state dicts
        flags = {u.name: root.get_submodule(u.name).__dict__[_MARK]["reshard_after_forward"]
                 for u in p.units[1:] if u.name in dict(marked)}
        if any(f is False for f in flags.values()):
            p = p.with_reshard_after_forward(flags)
        if empty_on is not None:
            _check_empty_device(root, empty_on)
        sync = any(o.get("sync_module_states") for o in [opts] + [m.__dict__[_MARK] for _, m in marked])
        try:
            shard(root, p, init_fn=_leave_uninitialised if empty_on is not None else None, sync_module_states=sync)
        except RuntimeShardingError as exc:
            if getattr(exc, "uninitialised", None) is None:
                raise
            kind, names = exc.uninitialised
            raise ShardingError(
                f"fully_shard: the model is on the meta device and {kind} (owning {names[:3]}) has no "
                f"reset_parameters(), so its first use cannot initialise it. Use FSDP2's (torchtitan's) order: after "
                f"the fully_shard calls, model.to_empty(device=...), then the model's own init (e.g. "
                f"model.init_weights()), before the first use; or load weights with set_model_state_dict") from None
    finally:
        _COMPILING[0] = False
    eng = engine_of(root)
    if empty_on is not None:
        _empty_buffers(root, eng.device)
    eng.fsdp2_optimizer_state = True  # optimizers over it give DTensor states, as FSDP2's do
    eng.fsdp2_inputs = True  # inputs cast at every marked module, through dataclasses etc., as FSDP2 casts them
    eng.shard_used_hint = ("Use it inside its module's forward, or keep that module gathered from its forward to "
                           "its backward: fully_shard(<the module holding it>, reshard_after_forward=False), then "
                           "read it after that module's forward (or do not fully_shard that module: its parameters "
                           "join the enclosing one's)")
    eng.cursor.fix_hint = ("A unit that runs more than once per step (two forwards then one backward, a generate "
                           "loop with gradients) or in a data-dependent order needs fully_shard(model, "
                           "order='dynamic') (shardplan's argument, on the root's call: units stay gathered until "
                           "the forward ends); FSDP2 re-gathers such units instead")
    _watch_optimizers()
    opts["root"] = root
    for _, m in marked:
        m.__dict__[_MARK]["root"] = root
    flags = {m.__dict__[_MARK].get("sync", True) for m in _marked(root, True)}
    if len(flags) == 1:  # set_requires_gradient_sync called before the plan compiled
        eng.sync = flags.pop()
    if empty_on is not None:
        _open_init_view(root, eng)


def _leave_uninitialised(module: nn.Module) -> None:
    """``init_fn`` of ``to_empty``'s compile: storage only, as ``to_empty`` gives; the model's init follows."""


def _check_empty_device(root: nn.Module, device: torch.device) -> None:
    if not dist.is_initialized():
        return  # shard() raises naming the process group
    have = device_for(root, dist.get_backend())[0]
    if have.type != device.type or (device.index is not None and device.index != have.index):
        raise ShardingError(f"fully_shard: to_empty(device={str(device)!r}), but this rank's shards live on {have} "
                            f"(the process group's backend {dist.get_backend()!r} and the current device decide it); "
                            f"pass device={str(have)!r}")


def _empty_buffers(root: nn.Module, device: torch.device) -> None:
    """Buffers still on the meta device get storage, as ``to_empty`` gives them (the model's init fills them)."""
    for m in root.modules():
        for k, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[k] = torch.empty_like(b, device=device)


# [Note: the init view]
# FSDP2's parameters are DTensors, and a model's own init (torchtitan's init_weights, nn.init.*, a module's
# reset_parameters) runs on them: shapes read as global (fan-in and fan-out as for the whole weight), random
# ops through DTensor's RNG (on a GPU each shard draws its own part of one stream, not the same numbers on every
# rank). From to_empty until the model's first use (forward, parameters(), state_dict(), ...) the modules hold
# such DTensors, views of this rank's shards (the placements model.state_dict() gives), so that init writes
# the shards exactly as it writes FSDP2's; the first use puts the local shards back. A DTensor an optimizer
# was built on would train nothing: identity.check_optimizer refuses it at step().
_INIT_VIEWS = [0]  # how many roots' modules hold their init view (each root's list: its options' "init_views")


def _open_init_view(root: nn.Module, eng) -> None:
    hooks = eng.state_dict_hooks
    if hooks.bad is not None:  # (never with fully_shard's chunked layout)
        return
    made = {}
    for name, lp in eng.local_params().items():
        dt = nn.Parameter(hooks.value(name, lp), requires_grad=lp.requires_grad)
        dt.__dict__[_REPLACED] = name
        made[id(lp)] = dt
    views = []
    for slots in eng.face.slots.values():
        for m, attr, lp, _ in slots:
            m._parameters[attr] = made[id(lp)]
            views.append((m, attr, made[id(lp)], lp))
    root.__dict__[_MARK]["init_views"] = views
    _INIT_VIEWS[0] += 1


def _close_init_view(root: nn.Module) -> None:
    views = root.__dict__[_MARK].pop("init_views")
    _INIT_VIEWS[0] -= 1
    bad = [(m, attr) for m, attr, dt, lp in views if m._parameters.get(attr) is not dt
           or (lp.numel() and dt._local_tensor.data_ptr() != lp.data_ptr())]
    for m, attr, _, lp in views:
        m._parameters[attr] = lp
    if bad:
        path = {id(m): n for n, m in root.named_modules()}
        where = [f"{path.get(id(m), type(m).__name__)}.{attr}".lstrip(".") for m, attr in bad]
        raise ShardingError(f"fully_shard: parameter(s) {where[:3]} were replaced between to_empty() and the "
                            f"model's first use (an assignment module.weight = ..., or p.data = ...), so the "
                            f"shards kept their uninitialised values. Initialise parameters in place (nn.init.*, "
                            f"or p.copy_(value) under torch.no_grad()), as under FSDP2")


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """FSDP2's ``register_fsdp_forward_method``: ``module.<method_name>(...)`` gathers and frees like
    ``module(...)`` (shardplan's forward hooks of ``module`` run around it), for methods such as ``generate``
    that call ``self.forward`` directly. A module ``fully_shard`` was not called on: nothing to do, as in torch.

    >>> fully_shard(model); register_fsdp_forward_method(model, "generate")

    torch's own function does the same for a shardplan module once shardplan is imported (it would do nothing,
    and ``generate`` would compute with the local shards)."""
    if not isinstance(module, ShardPlanModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    orig = getattr(module, method_name)

    def wrapped(self, *args, **kwargs):
        _ensure_compiled(self)
        root = self.__dict__[_MARK].get("root") or self
        if root is self:
            _check_sync_flags(self)
        ids = {h.id for h in engine_of(root).handles}
        pre = [(k, h) for k, h in self._forward_pre_hooks.items() if k in ids]
        post = [h for k, h in self._forward_hooks.items() if k in ids]
        for k, hook in pre:
            if k in self._forward_pre_hooks_with_kwargs:
                res = hook(self, args, kwargs)
                if res is not None:
                    args, kwargs = res
            else:
                res = hook(self, args)
                if res is not None:
                    args = res if isinstance(res, tuple) else (res,)
        out = orig(*args, **kwargs)
        for hook in post:
            res = hook(self, args, out)
            if res is not None:
                out = res
        return out

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def _route_torch_register() -> None:
    """[Note: torch's register_fsdp_forward_method] It returns at once for a module that is not torch's
    ``FSDPModule``, so on a shardplan module the method would run with the local shards (a shape error, or
    silently wrong numbers for a method that only reduces a parameter). Its code is swapped for a call of
    shardplan's, which hands any other module back to torch's original: names bound before shardplan was
    imported are covered too."""
    try:
        from torch.distributed.fsdp._fully_shard import _fully_shard as T
    except ImportError:  # pragma: no cover
        return
    fn = getattr(T, "register_fsdp_forward_method", None)
    if fn is None or "_shardplan_register" in fn.__globals__ or fn.__code__.co_freevars or fn.__code__.co_argcount != 2:
        return
    import types
    original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)

    def route(module, method_name):
        if isinstance(module, ShardPlanModule):
            return register_fsdp_forward_method(module, method_name)
        return original(module, method_name)

    fn.__globals__["_shardplan_register"] = route  # where the swapped code looks it up (its defining module)

    def routed(module, method_name):  # the code torch's function now runs, in torch's module
        return _shardplan_register(module, method_name)  # noqa: F821 - a global of torch's module

    fn.__code__ = routed.__code__


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


_WATCHING = [False]


def _watch_optimizers() -> None:
    if not _WATCHING[0]:
        from torch.optim import optimizer as O
        handle = O.register_optimizer_step_pre_hook(_dtensor_optimizer_state)
        hooks = getattr(O, "_global_optimizer_pre_hooks", None)
        if hasattr(hooks, "move_to_end"):  # before shardplan's check of the states' shapes (runtime/identity.py)
            hooks.move_to_end(handle.id, last=False)
        _WATCHING[0] = True


def _dtensor_optimizer_state(opt: torch.optim.Optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook (once per optimizer): one that steps a ``fully_shard`` model's parameters gives
    its states as DTensors from ``state_dict()`` and takes them back in ``load_state_dict``, as FSDP2's does.

    [Note: FSDP2's optimizer states are DTensors] Without this an optimizer's moments are this rank's shards
    as plain tensors under the parameters' names: ``get_optimizer_state_dict(full_state_dict=True)`` would
    return one rank's shard as the "full" state, and ``dcp.save`` would keep one rank's copy for every rank
    (plain tensors are taken as replicated): silently wrong. Installed at the first step, which
    ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` run on an optimizer without state."""
    if "_shardplan_dtensor_state" in opt.__dict__:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    engines = {id(e): e for e in (getattr(p, "_shardplan_engine", lambda: None)() for p in params) if e is not None}
    ours = [e for e in engines.values() if getattr(e, "fsdp2_optimizer_state", False)]
    opt.__dict__["_shardplan_dtensor_state"] = False
    if not ours:
        return
    if len(engines) > 1 or any(getattr(p, "_shardplan_engine", None) is None for p in params):
        def refuse(*_):  # training is right; only its state dict could not be: refuse that, not the step
            raise ShardingError("optimizer.state_dict() / load_state_dict(): this optimizer holds parameters of a "
                                "shardplan fully_shard model and other parameters (or another model's); their states "
                                "cannot be given as FSDP2's DTensors. Build one optimizer per fully_shard model, on "
                                "model.parameters()")
        opt.register_state_dict_pre_hook(refuse)
        opt.register_load_state_dict_pre_hook(refuse)
        return
    SD.install_optimizer(opt, ours[0])
    opt.__dict__["_shardplan_dtensor_state"] = True
    _local_states(opt, ours[0])


def _local_states(opt: torch.optim.Optimizer, eng) -> None:
    """DTensor states a never-stepped optimizer was given by ``load_state_dict`` before its hooks existed (FSDP2's
    or shardplan's ``optimizer.state_dict()``, loaded directly): this rank's pieces, as the hook would have."""
    from torch.distributed.tensor import DTensor
    names = {id(lp): n for n, lp in eng.local_params().items()}
    for p, st in opt.state.items():
        for k, v in list(st.items()):
            if isinstance(v, DTensor):
                local = eng.state_dict_hooks.local_value(names[id(p)], f"state.{names[id(p)]}.{k}", v, p)
                st[k] = torch.zeros_like(p) if local.numel() == 0 else local.clone()


# -- Megatron-FSDP --------------------------------------------------------------------------------------------

_NOT_OURS = dict(  # Megatron-FSDP arguments shardplan has no counterpart for, with the defaults it accepts
    hybrid_fsdp_expt_group=None, expt_device_mesh=None, calculate_per_token_loss=False, keep_fp8_transpose_cache=False,
    nccl_ub=False, fsdp_double_buffer=False, fsdp_db_use_persist_buf_on_alloc_fail=False,
    disable_symmetric_registration=False, enable_fine_grained_param_gather=False, disable_bucketing=False,
    overlap_grad_reduce=True, sync_model_each_microbatch=True,
)


def fully_shard_model(module: nn.Module, device_mesh: Optional[Any] = None, dp_shard_dim: Optional[str] = None,
                      dp_outer_dim: Optional[str] = None, tp_dim: Optional[str] = None,
                      hybrid_fsdp_group: Optional[Any] = None, fsdp_unit_modules: Optional[Sequence] = None,
                      zero_dp_strategy: Union[int, str] = 3, outer_dp_sharding_strategy: Union[int, str] = 0,
                      device: Optional[torch.device] = None,
                      init_model_with_meta_device: bool = False, grad_reduce_in_fp32: bool = False,
                      preserve_fp32_weights: bool = True, overlap_param_gather: bool = True,
                      preproc_state_dict_for_dcp_ckpt: bool = True, check_for_nan_in_grad: bool = True,
                      average_in_collective: bool = False, mixed_precision_policy: Optional[Any] = None,
                      **rest) -> nn.Module:
    """Megatron-FSDP's ``fully_shard_model`` (same argument names and meanings), built on one plan.

    >>> model = fully_shard_model(model, fsdp_unit_modules=[Block], zero_dp_strategy="optim_grads_params")

    ``zero_dp_strategy`` 0-3 or its names; ``device_mesh`` with ``dp_shard_dim`` (and ``dp_outer_dim`` for
    HSDP: replicated over it); ``fsdp_unit_modules`` classes or import paths. The model computes in its
    own dtype; with ``preserve_fp32_weights`` (or a policy's ``main_params_dtype=float32``) low-precision
    parameters are kept as fp32 masters and gathered in the model's dtype; ``grad_reduce_in_fp32`` (or
    ``grad_comm_dtype``) sets the reduction dtype. Returns the module, sharded in place; an argument
    shardplan cannot honour raises, naming it. Accepted either way, as they change nothing here:
    ``preproc_state_dict_for_dcp_ckpt`` (``model.state_dict()`` gives ``torch.chunk``-placed DTensors, which
    DCP takes without preprocessing), ``average_in_collective`` (gradients are averaged in the reduction,
    ``ReduceOp.AVG``, the same mean Megatron-FSDP's pre-division gives up to rounding) and
    ``init_model_with_meta_device`` (a model on the meta device is materialised unit by unit regardless).
    """
    where = "fully_shard_model"
    unknown = [k for k in rest if k not in _NOT_OURS]
    if unknown:
        raise ShardingError(f"{where}: unknown argument(s) {unknown}")
    _unsupported(where, **{k: (v, lambda v, d=_NOT_OURS[k]: v == d) for k, v in rest.items()},
                 outer_dp_sharding_strategy=(outer_dp_sharding_strategy, lambda v: v in (0, "no_shard")))
    level = STRATEGIES.index(zero_dp_strategy) if zero_dp_strategy in STRATEGIES else zero_dp_strategy
    if level not in (0, 1, 2, 3):
        raise ShardingError(f"{where}: zero_dp_strategy={zero_dp_strategy!r}; use 0-3 or one of {STRATEGIES}")
    shard_dim = dp_shard_dim or "fsdp"
    mesh = _mesh_from(device_mesh, shard_dim)
    if tp_dim is not None and tp_dim in mesh.axis_names and mesh.shape[tp_dim] > 1:
        raise ShardingError(f"{where}: tp_dim={tp_dim!r} has size {mesh.shape[tp_dim]}; tensor parallelism is not "
                            f"available through this entry point")
    if shard_dim not in mesh.axis_names:
        raise ShardingError(f"{where}: dp_shard_dim={shard_dim!r} is not a dimension of the mesh {mesh!r}")
    if dp_outer_dim is not None and dp_outer_dim not in mesh.axis_names:
        raise ShardingError(f"{where}: dp_outer_dim={dp_outer_dim!r} is not a dimension of the mesh {mesh!r}")
    if hybrid_fsdp_group is not None and dp_outer_dim is not None:
        want = mesh.axis_size((dp_outer_dim, shard_dim))
        if dist.get_world_size(hybrid_fsdp_group) != want:
            raise ShardingError(f"{where}: hybrid_fsdp_group has {dist.get_world_size(hybrid_fsdp_group)} ranks, "
                                f"dp_outer x dp_shard is {want}")
    if init_model_with_meta_device and level == 0:
        raise ShardingError(f"{where}: init_model_with_meta_device is not supported with the no_shard strategy "
                            f"(as in Megatron-FSDP)")
    compute, reduce = _megatron_dtypes(module, where, preserve_fp32_weights, grad_reduce_in_fp32, mixed_precision_policy)
    if device is not None and not init_model_with_meta_device:
        module.to(device)
    p = make_plan(module, _dim0_rules(shard_dim), mesh, strategy=level, units=list(fsdp_unit_modules or ()),
                  compute_dtype=compute, reduce_dtype=reduce, prefetch=1 if overlap_param_gather else 0,
                  min_unit_bytes=0, layout="chunked")  # DTensor state dicts, as Megatron-FSDP gives
    sharded = shard(module, p)
    engine_of(sharded).check_for_nan_in_grad = check_for_nan_in_grad
    return sharded


def _megatron_dtypes(module: nn.Module, where: str, preserve_fp32: bool, reduce_fp32: bool, policy):
    """(compute dtype, reduce dtype) from Megatron-FSDP's precision arguments; converts low-precision
    parameters to fp32 masters when they are to be preserved."""
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    model_dtype = dtypes.pop() if len(dtypes) == 1 else None
    main = torch.float32 if preserve_fp32 else None
    reduce = torch.float32 if reduce_fp32 else None
    if policy is not None:
        main = getattr(policy, "main_params_dtype", main)
        comm = getattr(policy, "grad_comm_dtype", None)
        reduce = comm if comm is not None else reduce
        grads = getattr(policy, "main_grads_dtype", None)
        if grads is not None and grads != (main or model_dtype):
            raise ShardingError(f"{where}: main_grads_dtype={grads} must equal the main parameters' dtype "
                                f"({main or model_dtype}): the local gradients are in the optimizer's dtype")
        accum = getattr(policy, "grad_accum_dtype", None)
        if accum is not None and accum not in (model_dtype, reduce):
            raise ShardingError(f"{where}: grad_accum_dtype={accum} is not supported: gradients accumulate in the "
                                f"compute dtype ({model_dtype}) and reduce in {reduce or model_dtype}; pass "
                                f"grad_accum_dtype=None")
    compute = None
    if main is not None and model_dtype is not None and model_dtype != main:
        if model_dtype.itemsize >= main.itemsize:
            raise ShardingError(f"{where}: main_params_dtype={main} is narrower than the model's {model_dtype}")
        compute = model_dtype
        module.to(main)  # fp32 masters: the shards the optimizer steps; gathered in the model's dtype
    return compute, reduce


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, preproc_state_dict_for_dcp_ckpt: bool = True):
    """Megatron-FSDP's ``fully_shard_optimizer``: checks the optimizer steps a sharded model's local shards
    and, if the model asked for ``check_for_nan_in_grad``, makes ``step`` refuse non-finite gradients.

    >>> optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters()))
    >>> dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)

    Every argument is honoured as Megatron-FSDP means it, or refused:

    * ``preproc_state_dict_for_dcp_ckpt=True``: ``optimizer.state_dict()`` is ready for DCP: its moments are
      DTensors over the model's mesh (as ``model.state_dict()`` gives the parameters), and
      ``optimizer.load_state_dict`` takes them back; ``False``: torch's own, this rank's local shards.
    * ``step(sync_grad_before_optimizer_step=...)``: either value. Megatron-FSDP waits for the gradient
      reduction only when the model does not sync by itself (``sync_model_each_microbatch=False``, refused by
      :func:`fully_shard_model`); shardplan's backward has always reduced the gradients before ``step``.
    * ``step(install_optimized_model_weights=True)``: the default; the next forward gathers the stepped
      shards. ``False`` (keep the model's weights stale until a later install) raises: the optimizer steps
      the shards the model gathers from, in place, so there is nothing to defer.
    * ``zero_grad(zero_grad_buffer=True)``: the default, ``zero_grad`` as usual; ``False`` (keep Megatron's
      separate gradient buffer) raises: the local shards' ``.grad`` are the only gradient buffer.
    """
    if not isinstance(preproc_state_dict_for_dcp_ckpt, bool):
        raise ShardingError(f"fully_shard_optimizer: preproc_state_dict_for_dcp_ckpt={preproc_state_dict_for_dcp_ckpt!r}"
                            f" must be True or False")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        raise ShardingError("fully_shard_optimizer: the optimizer has no parameters")
    engines = {id(e): e for e in (getattr(p, "_shardplan_engine", lambda: None)() for p in params) if e is not None}
    if len(engines) != 1 or any(getattr(p, "_shardplan_engine", None) is None for p in params):
        raise ShardingError("fully_shard_optimizer: build the optimizer on model.parameters() after "
                            "fully_shard_model(model, ...) (its parameters are then the local shards)")
    eng = next(iter(engines.values()))
    base_step, base_zero_grad = type(optimizer).step, type(optimizer).zero_grad

    def step(self, *args, sync_grad_before_optimizer_step: bool = True, install_optimized_model_weights: bool = True,
             **kwargs):
        # [Note: sync_grad_before_optimizer_step is accepted either way: gradients were reduced by backward]
        if install_optimized_model_weights is not True:
            raise ShardingError("optimizer.step: install_optimized_model_weights=False is not supported by shardplan: "
                                "the optimizer steps the shards the model gathers from, in place, so the next "
                                "forward always uses the new weights; call step() without it")
        if getattr(eng, "check_for_nan_in_grad", False):
            _check_finite(eng, params)
        return base_step(self, *args, **kwargs)

    def zero_grad(self, *args, zero_grad_buffer: bool = True, **kwargs):
        if zero_grad_buffer is not True:
            raise ShardingError("optimizer.zero_grad: zero_grad_buffer=False is not supported by shardplan: the local "
                                "shards' .grad are the only gradient buffer; call zero_grad() without it")
        return base_zero_grad(self, *args, **kwargs)

    optimizer.step = step.__get__(optimizer)
    optimizer.zero_grad = zero_grad.__get__(optimizer)
    optimizer.__dict__["_shardplan_dtensor_state"] = preproc_state_dict_for_dcp_ckpt
    if preproc_state_dict_for_dcp_ckpt:
        SD.install_optimizer(optimizer, eng)
    return optimizer


def _check_finite(eng, params) -> None:
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel()]
    bad = torch.zeros((), device=eng.device)
    if grads:
        bad = (~torch.stack([g.isfinite().all() for g in grads])).any().float()
    C.all_reduce(bad, eng.groups.world, async_op=False, op=dist.ReduceOp.MAX)
    if bad.item():
        names = {id(lp): n for n, lp in eng.local_params().items()}
        local = [names.get(id(p), "?") for p in params if p.grad is not None and not p.grad.isfinite().all()]
        raise FloatingPointError(f"fully_shard_optimizer: non-finite gradients (check_for_nan_in_grad=True); "
                                 f"on this rank: {local[:5] or 'none (another rank)'}")


_route_torch_register()
