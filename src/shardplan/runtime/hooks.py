"""Module hooks and autograd plumbing that report events to the executor, and nothing else.

* the root module's pre/post forward hooks: ``before_forward`` (and input casting), ``pre_forward`` and
  ``post_forward`` of the root unit;
* each unit module's pre/post forward hooks: ``pre_forward(u)`` / ``post_forward(u)`` (a merged unit
  starts with its first module and ends with its last);
* a hook on every output tensor of a unit: ``pre_backward(u)`` when its gradient arrives;
* a post-accumulate-grad hook on every full parameter: ``on_grad``; one on every sharded local shard raises,
  since a gradient there means the shard was used where shardplan cannot see it; a replicated one's gradient
  (its local tensor is the whole parameter) joins its unit's reduction (``outside_grad``).
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.nn as nn

from ..dtypes import to_torch
from ..errors import RuntimeShardingError
from ..optraffic import tensors_in
from ..planner.schedule import ROOT
from ..units import entry_points, has_forward
from .executor import Executor, in_backward_pass
from .unit import UnitRuntime


def cast_inputs(args, kwargs, dtype_name, fsdp2: bool = False):
    if dtype_name is None:
        return args, kwargs
    target = to_torch(dtype_name)
    if fsdp2:  # the drop-in fully_shard: FSDP2's own traversal (dataclasses, namedtuples, OrderedDicts, sets)
        from torch.distributed.utils import _apply_to_tensors

        def cast_fp(x):
            return x.to(target) if x.is_floating_point() and x.dtype != target else x
        return _apply_to_tensors(cast_fp, args), _apply_to_tensors(cast_fp, kwargs)

    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != target:
            return x.to(target)
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(cast(y) for y in x)
        if isinstance(x, dict) and type(x) is dict:
            return {k: cast(v) for k, v in x.items()}
        return x

    return cast(args), cast(kwargs)


def install(module: nn.Module, exe: Executor, modules_of: dict[str, list[nn.Module]], *, param_hooks: bool = True) -> list:
    """Register every hook; returns the module hooks' handles (``param_hooks``: also the gradient hooks of
    the module face's parameters, which live as long as they do). Hooks hold the executor weakly where
    they live in C++."""
    handles = register(module_hooks(module, exe, modules_of))
    if param_hooks:
        for u in exe.unit_list:
            _hook_params(exe, u)
    return handles


def register(hooks: list) -> list:
    """Register ``(module, forward pre-hook?, fn, with_kwargs)`` entries (from :func:`module_hooks`); returns
    the handles. The functional face makes the entries once and registers them for each call. [Note: the
    entries hold their modules weakly: the functional face keeps them in a cache keyed weakly by the root
    module, which a strong reference from its value would keep alive forever.]"""
    out = []
    for ref, pre, fn, kw in hooks:
        m = ref()
        if m is not None:
            out.append(m.register_forward_pre_hook(fn, with_kwargs=kw) if pre else m.register_forward_hook(fn))
    return out


def module_hooks(module: nn.Module, exe: Executor, modules_of: dict[str, list[nn.Module]]) -> list:
    """The module hooks that report the executor's events, as entries for :func:`register`."""
    timed = _timer(exe)
    watch = _Outputs(exe)
    handles = _root_hooks(module, exe, timed, watch)
    path_of: dict = {}  # filled once, only for containers (the functional face installs at every call)
    unit_paths = [p for u in exe.plan.units[1:] for p in u.module_paths]
    for name, mods in modules_of.items():
        pre, pre_inner, post, entered_post = _unit_hooks(exe, timed, watch, name)
        for k, mod in enumerate(mods):
            if has_forward(mod):
                ref = weakref.ref(mod)
                handles.append((ref, True, pre, True) if k == 0 else (ref, True, pre_inner, False))
                if k == len(mods) - 1:
                    handles.append((ref, False, post, False))
                continue
            # [Note: containers as units] (units.entry_points): a module without a forward is never
            # called; its entry points gather the unit and watch their outputs for its backward. No
            # post_forward: the unit's free runs when the next event moves the cursor past it.
            if not path_of:
                path_of.update((id(m), p) for p, m in module.named_modules())
            for path in entry_points(module, path_of[id(mod)], unit_paths):
                entry = module.get_submodule(path)
                handles.append((weakref.ref(entry), True, pre, True))
                handles.append((weakref.ref(entry), False, entered_post, False))
    return handles


def _timer(exe: Executor):
    """``timed(fn)``: ``fn`` adding its own time to ``exe.hook_seconds``, out of dynamo's sight."""
    clock = time.perf_counter

    def timed(fn):
        # dynamo must not trace the runtime (storage resizes, collectives, module attribute swaps): under
        # torch.compile(model) each hook is a graph break and runs eagerly, as FSDP2's hooks do
        def run(*args):
            t = clock()
            try:
                return fn(*args)
            finally:
                exe.hook_seconds += clock() - t
        return torch._dynamo.disable(run)
    return timed


class _Outputs:
    """The tensors a unit's forward produced, watched for its ``pre_backward``.

    [Note: passthrough outputs]
    A unit may return a tensor it was given (HF T5 blocks return ``position_bias`` unchanged). Its
    gradient is complete only once every consumer ran backward, the unit's own earlier use and the
    units *before* it included, so a hook on it would report ``pre_backward(u)`` long after ``u``'s
    backward finished and its gradients were reduced. Such a tensor says nothing about ``u``: only
    tensors the unit produced are watched. Inputs are held (not their ids) until the unit's post-forward."""

    def __init__(self, exe: Executor):
        self.me = weakref.ref(exe)
        self.inputs: dict[str, list] = {}

    def note_inputs(self, name: str, args, kwargs) -> None:
        if not torch.is_grad_enabled() or in_backward_pass():
            return
        seen = [t for t in tensors_in(args) + tensors_in(kwargs) if t.requires_grad]
        if seen:
            self.inputs.setdefault(name, []).extend(seen)

    def watch_outputs(self, name: str, output) -> None:
        given = self.inputs.pop(name, ())
        if not torch.is_grad_enabled() or in_backward_pass():
            return
        me = self.me
        for t in tensors_in(output):
            if t.requires_grad and not any(t is g for g in given):
                t.register_hook(_timed_backward(me, lambda _g, _n=name: me().pre_backward(_n)))


def _root_hooks(module: nn.Module, exe: Executor, timed, watch: _Outputs) -> list:
    """The root's pre-forward (``before_forward``, the inputs cast to the compute dtype) and post-forward."""

    @timed
    def root_pre(_m, args, kwargs):
        exe.before_forward()
        watch.inputs.clear()
        args, kwargs = cast_inputs(args, kwargs, exe.plan.compute_dtype, exe.fsdp2_inputs)
        watch.note_inputs(ROOT, args, kwargs)
        exe.pre_forward(ROOT)
        return args, kwargs

    @timed
    def root_post(_m, _args, output):
        exe.post_forward(ROOT)
        watch.watch_outputs(ROOT, output)
        return output

    return [(weakref.ref(module), True, root_pre, True), (weakref.ref(module), False, root_post, False)]


def _unit_hooks(exe: Executor, timed, watch: _Outputs, name: str) -> tuple:
    """Unit ``name``'s hooks: (pre-forward of its first module, of a later one, post-forward of its last,
    post-forward of an entry point of a container unit)."""

    @timed
    def pre(_m, args, kwargs, _name=name):
        if exe.fsdp2_inputs:  # FSDP2 casts every fully_shard module's inputs, not only the root's
            args, kwargs = cast_inputs(args, kwargs, exe.plan.compute_dtype, True)
        watch.note_inputs(_name, args, kwargs)
        exe.pre_forward(_name)
        return (args, kwargs) if exe.fsdp2_inputs else None

    @timed
    def pre_inner(_m, _args, _name=name):  # a later module of a merged unit: its inputs come from inside
        exe.pre_forward(_name)

    @timed
    def post(_m, _args, output, _name=name):
        exe.post_forward(_name)
        watch.watch_outputs(_name, output)
        return output

    @timed
    def entered_post(_m, _args, output, _name=name):
        watch.watch_outputs(_name, output)  # the unit ends when the schedule moves past it
        return output

    return pre, pre_inner, post, entered_post


def _hook_params(exe: Executor, u: UnitRuntime) -> None:
    me, unit_ref = weakref.ref(exe), u.name
    clock = time.perf_counter

    def arrived(index: int):
        def hook(_p):  # one call per parameter and backward: timed inline, no wrapper
            t = clock()
            e = me()
            e.on_grad(unit_ref, index)
            e.backward_seconds += clock() - t
        return hook

    def outside(buffer: int, k: int):  # (indices, not the member: it holds the parameter this hook lives on)
        def hook(g):  # the gradient goes to the unit's reduction; the local .grad gets zeros (see the Note)
            t = clock()
            e = me()
            e.outside_grad(unit_ref, buffer, k, g)
            e.backward_seconds += clock() - t
            return torch.zeros_like(g)
        return hook

    for b in u.buffers:
        whole = not b.sharded and not b.tw  # replicated: this rank's local tensor is the whole parameter
        for k, m in enumerate(b.members):
            fp, lp = m.full, m.local
            if not fp.requires_grad:
                continue
            u.expected += 1
            # weak references: a hook lives in C++, where the garbage collector cannot see the cycle
            # parameter -> hook -> executor -> parameter, so strong ones would leak the model
            fp.register_post_accumulate_grad_hook(arrived(m.index))
            if whole and m.wrap is None:
                # [Note: a replicated parameter used outside its unit] (read by the root's forward after its
                # block ran, where the module holds the local tensor): that tensor is the whole value, so its
                # gradient is this rank's gradient of the parameter. The hook hands it to the unit's reduction
                # (added to the full parameter's, averaged over the data-parallel ranks with it) and lets
                # autograd accumulate zeros into the local .grad instead, which the reduced gradient then joins
                lp.register_hook(outside(b.bp.index, k))
            else:
                lp.register_post_accumulate_grad_hook(lambda _p, _name=m.info.name: _shard_used(_name, me))


def _timed_backward(me, fn):
    """``fn`` (a hook autograd calls in backward), its time added to the executor's ``backward_seconds``."""
    clock = time.perf_counter

    def run(*args):
        t = clock()
        try:
            return fn(*args)
        finally:
            exe = me()
            if exe is not None:
                exe.backward_seconds += clock() - t
    return run


def _shard_used(name: str, me=None) -> None:
    exe = me() if me is not None else None
    fix = getattr(exe, "shard_used_hint", None) or (
        "Use it inside a module's forward, or keep it gathered: put it in the root unit (units=...) or "
        "plan.with_reshard_after_forward({unit: False})")
    raise RuntimeShardingError(
        f"shardplan: the local shard of parameter {name!r} received a gradient: it was used outside the forward of "
        f"its unit, where the modules hold local shards (after the unit's forward under optim_grads_params, or "
        f"outside a training step). It is sharded (this rank holds part of it), so its gradient would be wrong. "
        f"{fix}")
