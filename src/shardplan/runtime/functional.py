"""The functional face: pure functions over local-shard pytrees, on the same executor as ``shard``.

>>> local = sp.shard_tree(dict(model.named_parameters()), plan)
>>> loss_fn = lambda params, batch: sp.functional_call(model, plan, params, batch)
>>> loss, grads = sp.value_and_grad(loss_fn, plan)(local, batch)     # grads: local shards, same tree
>>> local, state = opt.update(grads, state, local)                     # sp.optim.adamw(...)

``functional_call`` never changes the module for longer than the call: the executor's hooks and the
full parameters are put in place for the forward and taken away when it returns (as
``torch.func.functional_call`` does with the tensors it is given). The backward runs later, through an
autograd function per unit whose backward reduce-scatters the unit's gradient into its shard layout.
``unshard_tree`` all-gathers a local tree back to full tensors (``shardplan.tree`` holds the pure tree work).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import optree
import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import ShardingError
from ..planner import Plan
from ..planner import geometry as G
from ..rules import leaves_with_paths
from ..tree import check_tree, place, rebuild
from .capture import session as CAP
from . import collectives as C
from .storage import free_storage
from .builder import build, functional_runtimes, groups_for
from .executor import Executor
from .faces import TreeFace
from .hooks import module_hooks, register
from . import tensor_parallel as TP
from . import tp_checks as TPC
from . import axes as AXES
from . import flow_guard as FG

_SESSION = threading.local()


class FunctionalRuntime:
    """The executor of one (module, plan) pair for the functional face, made at the first call."""

    def __init__(self, module: nn.Module, plan: Plan, timeout_s: float, problems: Sequence[str] = ()):
        rt = build(module, plan, timeout_s=timeout_s, problems=problems, face="shardplan.functional_call()")
        self.meshes = rt.meshes
        self.inputs_checked = not self.meshes  # tensor parallelism: the first call checks its inputs
        self.modules_of = rt.modules_of

        def fill(_up, bufs):
            for b in bufs:
                b.make_params()
                if not b.bp.alias:  # the all-gather sends straight from the caller's leaves: no shard of ours
                    free_storage(b.shard)

        units = rt.make_units(fill)
        self.rank, self.device = rt.rank, rt.device
        self.exe = Executor(plan, units, rt.groups, rt.device, rt.rank, timeout_s, None)
        self.exe.root = weakref.ref(module)
        self.face = TreeFace(plan, weakref.ref(self.exe), rt.wrappers)
        self.exe.face = self.face
        slots = rt.slots
        self.face.slots = {u.name: [list(slots[m.name]) for b in u.buffers for m in b.members] for u in units}
        self.originals = [(m, attr, m._parameters[attr]) for places in slots.values() for m, attr in places]
        self.face.originals = self.originals
        self.checked: set = set()
        self.hooks: Optional[list] = None  # the module hooks' entries (hooks.register), made at the first call
        if self.meshes:
            TPC.align_generators(plan, rt.groups.world, rt.device)
            self.exe.partial_check = TPC.PartialCheck(plan, rt.groups.world, rt.device)
        # [Note: compute axes] expert and context parallelism (and any registered axis) are put in place at every
        # call through runtime/axes.py's bind, as shard() installs them once: one module may be called under
        # plans of other meshes in turn, and keeps no hooks between calls

    def leaves_of(self, local_params) -> dict[str, torch.Tensor]:
        paths, leaves, spec = leaves_with_paths(local_params)
        key = (spec, tuple(paths), tuple((tuple(l.shape), l.dtype) for l in leaves)) if spec is not None else None
        if key is None or key not in self.checked:
            check_tree(self.exe.plan, paths, leaves, rank=self.rank, what="local_params")
            if key is not None:
                self.checked.add(key)
        return dict(zip(_plan_names(self.exe.plan, paths), leaves))


def _plan_names(plan: Plan, paths: list[str]) -> list[str]:
    """Each leaf's plan name: a tied parameter's leaf found only under another of its names (``head.weight`` for
    ``emb.weight``) answers for it. (With both names in the tree, the other stays itself: it gets zeros.)"""
    given = set(paths)
    out = []
    for p in paths:
        name = plan.param(p).name if p in plan else p
        out.append(name if name == p or name not in given else p)
    return out


def runtime_of(module: nn.Module, plan: Plan, timeout_s: float = 300.0, local_params=None) -> FunctionalRuntime:
    """The (module, plan) runtime, made at the first call: every rank checks its module, plan and (given)
    local tree, and all exchange the findings, so a rank with a bad tree ends every rank at once."""
    per = functional_runtimes(module)
    key = plan.fingerprint()
    if key not in per:
        problems = []
        if local_params is not None:
            try:
                paths, leaves, _ = leaves_with_paths(local_params)
                check_tree(plan, paths, leaves, rank=dist.get_rank() if dist.is_initialized() else 0,
                           what="local_params")
            except ShardingError as exc:
                problems.append(str(exc))
        per[key] = FunctionalRuntime(module, plan, timeout_s, problems)
    return per[key]


def functional_call(module: nn.Module, plan: Plan, local_params: Any, args: Any = (), kwargs: Optional[dict] = None, *,
                    buffers: Optional[dict] = None, timeout_s: float = 300.0) -> Any:
    """Run ``module`` statelessly with the parameters whose local shards are ``local_params``.

    >>> out = sp.functional_call(model, plan, local, (tokens, targets))
    >>> grads = torch.autograd.grad(out, list(local.values()))   # local-shard gradients (leaves that require grad)

    Units are gathered, prefetched and freed as ``plan.schedule`` says; backward re-gathers (ZeRO-3)
    and reduce-scatters each unit's gradient into its shard layout. ``local_params`` is any pytree whose
    dotted leaf paths are the plan's parameter names, holding this rank's local shards (``shard_tree``).
    ``buffers`` (a ``{name: tensor}`` dict) replaces module buffers for the call. Gradients come back
    from ``torch.autograd.grad`` or :func:`value_and_grad`, not into ``.grad``.
    """
    if not isinstance(args, tuple):
        args = (args,)
    rt = runtime_of(module, plan, timeout_s, local_params)
    leaves = rt.leaves_of(local_params)
    session = getattr(_SESSION, "current", None)
    sources = getattr(_SESSION, "sources", None) if session is not None else None
    if CAP.loads_afresh(rt.exe):  # [Note: stale shards at the capture]: the copy into the shards is recorded
        rt.face.versions.clear()
    if rt.face.load(leaves, sources):
        rt.exe.mark_shards_changed()
    if session is not None:
        session.append(rt)
    if rt.hooks is None:  # made once, registered for the call
        rt.hooks = module_hooks(module, rt.exe, rt.modules_of)
    handles = register(rt.hooks)
    guard: list = []
    if not getattr(rt, "flow_checked", False):  # the first call: what cp or a colwise output would compute per rank
        guard = FG.install(module, plan, TP.active_modules(plan))
        rt.flow_checked = True
    handles += AXES.bind(module, plan, rt.exe.groups, rt.exe)  # this plan's ep groups, cp binding, ... (after
    # the flow check's hooks: see runtime/context_parallel.py's _root_hooks)
    if rt.meshes:
        handles += TP.install_styles(module, plan, rt.meshes, rt.exe)
        if not rt.inputs_checked:
            handles.append(TPC.install_input_check(module, plan, rt.exe.groups.world, rt.device))
            rt.inputs_checked = True
    try:
        if buffers:
            return torch.func.functional_call(module, dict(buffers), args, kwargs or {}, strict=False)
        return module(*args, **(kwargs or {}))  # the parameters are already the call's own (bound per unit)
    finally:
        for h in handles + guard:  # (guard: the check's hooks too, added during the call)
            h.remove()
        rt.face.restore()


def value_and_grad(fn: Callable, plan: Plan, *, argnums: int = 0, has_aux: bool = False) -> Callable[..., tuple[Any, Any]]:
    """Like ``jax.value_and_grad``: ``(loss, grads) = sp.value_and_grad(loss_fn, plan)(local, batch)``.

    ``fn(params, ...)`` calls :func:`functional_call` with ``params`` (argument ``argnums``; once, or several
    times under a plan with ``order='dynamic'``) and returns a
    scalar loss (or ``(loss, aux)`` with ``has_aux``). ``grads`` has the structure of ``params`` and holds
    each local shard's reduced gradient; a parameter the step did not use gets zeros, not a missing
    entry. The caller's tree is not modified.

    >>> loss_fn = lambda params, batch: sp.functional_call(model, plan, params, batch)
    >>> loss, grads = sp.value_and_grad(loss_fn, plan)(local, batch)
    """
    if not isinstance(argnums, int) or isinstance(argnums, bool):
        raise ShardingError(f"value_and_grad: argnums must be one int (the position of the local-parameter tree), got "
                            f"{argnums!r}; pass the trees to differentiate as one pytree (e.g. a dict of them)")
    trained: dict = {}  # tree structure -> which leaves the plan trains

    def wrapped(*args, **kwargs):
        params = args[argnums]
        paths, leaves, spec = leaves_with_paths(params)
        key = (spec, tuple(paths)) if spec is not None else tuple(paths)
        trains = trained.get(key)
        if trains is None:
            trains = trained[key] = [plan.param(p).requires_grad if p in plan else False for p in paths]
        fresh = [l.detach().requires_grad_(t and l.is_floating_point()) for l, t in zip(leaves, trains)]
        tree = dict(zip(paths, fresh)) if spec is None else optree.tree_unflatten(spec, fresh)
        call = args[:argnums] + (tree,) + args[argnums + 1:]
        prev = getattr(_SESSION, "current", None), getattr(_SESSION, "sources", None)
        names = _plan_names(plan, paths)
        _SESSION.current, _SESSION.sources = [], dict(zip(names, leaves))
        try:
            out = fn(*call, **kwargs)
            if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise ShardingError(f"value_and_grad(has_aux=True): fn must return (loss, aux), got "
                                    f"{type(out).__name__}")
            loss, aux = out if has_aux else (out, None)
            if isinstance(loss, torch.Tensor) and loss.numel() != 1:
                raise ShardingError(f"value_and_grad: fn must return a scalar loss, got a tensor of shape "
                                    f"{tuple(loss.shape)} (reduce it, e.g. .mean() or .sum())")
            runtimes = _SESSION.current
        finally:
            _SESSION.current, _SESSION.sources = prev
        if len({id(rt) for rt in runtimes}) != 1:
            raise ShardingError(f"value_and_grad: fn must call shardplan.functional_call with the plan, one module "
                                f"(it called it {len(runtimes)} times, on {len({id(rt) for rt in runtimes})} runtimes)")
        if len(runtimes) > 1 and plan.order != "dynamic":
            # [Note: several calls per backward] a static plan reduces each unit's gradient once per backward,
            # after its single forward: a second call's backward would reach units already reduced
            raise ShardingError(f"value_and_grad: fn called shardplan.functional_call {len(runtimes)} times; a plan "
                                f"with order='static' runs each unit once per step. Call value_and_grad once per "
                                f"micro-batch and add the gradient trees (JAX-style accumulation), or plan with "
                                f"order='dynamic' to call the module several times in one fn")
        rt = runtimes[0]
        want = [t for t in fresh if t.requires_grad]
        if isinstance(loss, torch.Tensor) and loss.requires_grad and want:
            torch.autograd.grad(loss, want, allow_unused=True)  # drives backward; the executor fills the grads
        got, rt.face.grads = rt.face.grads, {}
        grads = [torch.zeros_like(l) if g is None else g if g.dtype == l.dtype else g.to(l.dtype)
                 for g, l in zip(map(got.get, names), leaves)]
        gtree = dict(zip(paths, grads)) if spec is None else optree.tree_unflatten(spec, grads)
        value = loss.detach() if isinstance(loss, torch.Tensor) else loss
        return ((value, aux), gtree) if has_aux else (value, gtree)
    return wrapped


def grad(fn: Callable, plan: Plan, *, argnums: int = 0, has_aux: bool = False) -> Callable[..., Any]:
    """Like ``jax.grad``: the gradient tree only (and ``aux`` with ``has_aux``).

    >>> grads = sp.grad(loss_fn, plan)(local, batch)          # local shards' reduced gradients, same tree
    """
    vg = value_and_grad(fn, plan, argnums=argnums, has_aux=has_aux)

    def wrapped(*args, **kwargs):
        (value, grads) = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads
    return wrapped


# -- a local tree back to full tensors ------------------------------------------------------------------

def unshard_tree(local_tree: Any, plan: Plan, *, timeout_s: float = 300.0) -> Any:
    """Full tensors on *every* rank from each rank's local tree (one all-gather per buffer).

    >>> full = shardplan.unshard_tree(local, plan)     # collective: every rank calls it
    """
    rank = dist.get_rank()
    paths, leaves, spec = leaves_with_paths(local_tree)
    check_tree(plan, paths, leaves, rank=rank, what="local tree")
    local = dict(zip(paths, leaves))
    groups = groups_for(plan, timeout_s)
    out: dict[str, torch.Tensor] = {}
    for b in plan.buffers:
        like = local[b.params[0]]
        if not b.sharded:
            for name in b.params:
                out[name] = local[name].detach().clone()
            continue
        if all(plan.param(n).tp_axis for n in b.params):
            continue  # every piece is gathered over its owner axes below
        flat = torch.zeros(b.shard_numel, dtype=like.dtype, device=like.device)
        for name in b.params:
            n = local[name].numel()
            if n:
                off = plan.piece(name, rank).shard_offset
                flat[off:off + n] = local[name].detach().reshape(-1)
        gathered = torch.empty(b.gathered_numel, dtype=like.dtype, device=like.device)
        C.all_gather(gathered, flat, groups.gather(b.axes), async_op=False)
        for name in b.params:
            if plan.param(name).tp_axis:
                continue  # gathered over its owner axes below
            def piece(r, _n=name):
                box = plan.local_slices(_n, r)
                if box is None:
                    return None
                seg, off = G.segment(plan.mesh, b, r), plan.piece(_n, r).shard_offset
                return gathered[seg * b.shard_numel + off: seg * b.shard_numel + off + math.prod(s.stop - s.start for s in box)]
            out[name] = place(plan, name, piece, like)
    for p in plan.params:  # tensor-parallel pieces: one gather over the ranks holding different pieces
        if p.tp_axis:
            out[p.name] = _gather_pieces(plan, p.name, local[p.name], rank, groups)
    return rebuild(local_tree, spec, paths, [out[p] for p in paths])


def _gather_pieces(plan: Plan, name: str, mine: torch.Tensor, rank: int, groups) -> torch.Tensor:
    """``name`` in full from the local pieces of this rank's owner group (pieces padded to the largest)."""
    axes = G.owner_axes(plan, name)
    owners = plan.mesh.group_of(rank, axes)
    sizes = [math.prod(plan.local_shape(name, r)) for r in owners]
    most = max(sizes)
    send = torch.zeros(most, dtype=mine.dtype, device=mine.device)
    send[:mine.numel()] = mine.detach().reshape(-1)
    got = torch.empty(most * len(owners), dtype=mine.dtype, device=mine.device)
    C.all_gather(got, send, groups.gather(axes), async_op=False)
    pieces = {r: got[i * most:i * most + n] for i, (r, n) in enumerate(zip(owners, sizes))}
    return place(plan, name, pieces.get, mine, owners)
