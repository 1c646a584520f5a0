"""Expert parallelism at run time: tokens to the ranks that hold their experts and back (all-to-all).

An expert module (stacked weights ``[num_experts, ...]``, an integer ``num_experts``) calls
:func:`dispatch` with its tokens and the experts each is routed to, runs its local experts on the rows it
gets, and calls :func:`combine` with the results::

    routed = sp.expert_parallel.dispatch(self, x, top_k_index)     # x: [N, dim], top_k_index: [N, k]
    outs = [expert(l, rows) for l, rows in enumerate(routed.tokens.split(routed.counts))]
    y = sp.expert_parallel.combine(routed, torch.cat(outs))       # [N, k, dim], in x's order

Where ``shard()`` split the module's experts over ``ep`` (a rule with ``ep`` first in dim 0), ``routed``
holds the rows every rank of the ``ep`` group sent to this rank's ``num_experts / ep`` experts;
elsewhere (one process, ``ep=1``, experts replicated) the same code sorts the local tokens by expert.
Routing is dropless: every token reaches its experts whatever the load (no capacity, no overflow), so
a rank may receive all tokens of its group; counts are exchanged first, then the rows, with split sizes.

[Note: expert gradients. A data-parallel step averages gradients over the data axes, and the plan reduces
an expert weight's gradient over the data axes other than ``ep`` only (its ep peers hold other experts).
Autograd already *sums* over the ep group the contributions of every ep rank's tokens, which arrive
through the all-to-all; the average over ep is one more factor 1/ep. The gradient arriving back at the
experts (combine's backward) is scaled by 1/ep and the tokens' gradient leaving them (dispatch's
backward) by ep, so expert weights get exactly the average and everything else is unchanged (both
factors are powers of two for the usual sizes: exact).]
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from ..errors import RuntimeShardingError
from ..flow import routed as report_routed
from ..planner.kinds import ALL_TO_ALL
from ..planner import expert_parallel as EPX
from . import collectives as C
from .axis_ops import BACKWARD, FORWARD, RECOMPUTING, AxisOps

ATTR = "_shardplan_experts"
_DISPATCHED = "_shardplan_dispatched"  # set by dispatch() during the module's forward (see _guard)


@dataclass(frozen=True)
class ExpertGroup:
    """Where a module's experts live: the ``ep`` group (its size and this rank's index) and how many
    experts the whole module has; ``ops``: the plan's all-to-all ops of the module by (``"dispatch"`` or
    ``"combine"``, phase), which :func:`dispatch` and :func:`combine` run through the executor
    (runtime/axis_ops.py)."""

    group: C.Group
    num_experts: int
    ops: AxisOps = field(default_factory=AxisOps)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.group.size


class _AllToAll(torch.autograd.Function):
    """Rows out by ``in_splits``, rows in by ``out_splits``; backward sends the gradients back the other way,
    scaled by ``grad_scale``. ``run(phase, work)`` runs the call's op of ``phase`` through the executor."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, grad_scale, run):
        ctx.splits, ctx.group, ctx.scale, ctx.run = (out_splits, in_splits), group, grad_scale, run

        def send():
            out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
            C.all_to_all_single(out, x.contiguous(), group, out_splits, in_splits)
            return out
        return run(AxisOps.phase(), send)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits

        def send_back():
            back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
            C.all_to_all_single(back, grad.contiguous(), ctx.group, in_splits, out_splits)
            return back
        back = ctx.run(BACKWARD, send_back)
        if ctx.scale != 1:
            back = back * ctx.scale
        return back, None, None, None, None, None


@dataclass
class Routed:
    """The rows this rank's experts compute: ``tokens`` grouped by local expert, ``counts`` rows per local
    expert (a list of ints: ``tokens.split(counts)``), and what :func:`combine` needs to send them back."""

    tokens: torch.Tensor
    counts: list
    _order: torch.Tensor                 # sorted position -> (token, slot) position
    _shape: tuple                        # (N, k)
    _group: Optional[ExpertGroup] = None
    _regroup: Optional[torch.Tensor] = None   # received row order -> by local expert
    _sent: Optional[list] = None          # rows sent to each ep rank
    _received: Optional[list] = None      # rows received from each
    _module: Optional[nn.Module] = None   # the expert module (combine reports it to the flow check)


def group_of(module: nn.Module) -> Optional[ExpertGroup]:
    """The expert group ``shard()`` gave ``module`` (``None``: its experts are all local)."""
    return module.__dict__.get(ATTR)


def dispatch(module: nn.Module, x: torch.Tensor, expert_ids: torch.Tensor) -> Routed:
    """Send each row of ``x`` ([N, dim]) to the rank holding each of its experts (``expert_ids``: [N, k] or
    [N], global expert indices) and return the rows this rank's experts compute, grouped by local expert.

    >>> routed = dispatch(self, x, top_k_index); routed.tokens.split(routed.counts)
    """
    num = getattr(module, "num_experts", None)
    if not isinstance(num, int):
        raise RuntimeShardingError(f"dispatch: {type(module).__name__} has no integer num_experts; an expert module "
                                   f"says how many experts it stacks (dim 0 of its weights)")
    ids = expert_ids if expert_ids.dim() == 2 else expert_ids[:, None]
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x[order // k]                                   # each (token, slot) pair, sorted by expert
    report_routed(module, "dispatch")  # dropless: every token reaches its experts (flow_tokens.py's Note)
    if flat.device.type == "meta":  # the planner's traced step: routing has no values; assume it balanced
        even, extra = divmod(n * k, num)
        return Routed(rows, [even + (e < extra) for e in range(num)], order, (n, k), _module=module)
    counts = torch.bincount(flat, minlength=num)
    module.__dict__[_DISPATCHED] = True
    eg = group_of(module)
    if eg is None or eg.group.pg is None:  # experts all local (a real group of one: SHARDPLAN_SINGLETON_GROUPS=1)
        return Routed(rows, counts.tolist(), order, (n, k), _module=module)
    size, local = eg.group.size, eg.local_experts
    recv = torch.empty_like(counts)
    C.all_to_all_single(recv, counts, eg.group)            # [src rank, local expert] counts, flattened
    recv = recv.view(size, local)
    sent = counts.view(size, local).sum(1).tolist()
    received = recv.sum(1).tolist()
    got = _AllToAll.apply(rows, received, sent, eg.group, float(size),
                          lambda phase, work: eg.ops.run("dispatch", phase, 0, work))
    # the rows arrive by source rank, then by local expert; the experts want them by local expert
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=recv.device).repeat(size), recv.reshape(-1))
    regroup = torch.argsort(expert_of_row, stable=True)
    return Routed(got[regroup], recv.sum(0).tolist(), order, (n, k), eg, regroup, sent, received, module)


def combine(routed: Routed, y: torch.Tensor) -> torch.Tensor:
    """The experts' outputs ``y`` (rows in ``routed.tokens``' order) back on the ranks and in the order of
    the tokens: ``[N, k, ...]`` (slot ``j`` of token ``i``: its ``j``-th expert's output)."""
    if routed._group is not None:
        back = torch.empty_like(routed._regroup)
        back[routed._regroup] = torch.arange(routed._regroup.numel(), device=back.device)
        eg = routed._group
        y = _AllToAll.apply(y[back], routed._sent, routed._received, eg.group, 1.0 / eg.group.size,
                            lambda phase, work: eg.ops.run("combine", phase, 0, work))
    inverse = torch.empty_like(routed._order)
    inverse[routed._order] = torch.arange(routed._order.numel(), device=inverse.device)
    n, k = routed._shape
    out = y[inverse].view(n, k, *y.shape[1:])
    report_routed(routed._module, "combine")  # every row back in its token's place
    return out


def install(module: nn.Module, plan, groups, exe=None) -> None:
    """Give each expert module the plan splits its ``ep`` group (``group_of`` reads it), with its ops in the
    plan for ``record_ops`` (one call per step: a module called several times records its first call's)."""
    for m in EPX.of(plan).modules:
        # forward: dispatch then combine; backward: combine's then dispatch's
        ops = AxisOps.of(plan, exe, lambda o, _p=m.path: o.kind == ALL_TO_ALL and o.at == _p, key=lambda o: "",
                         per_key=2)
        mine = {}
        for phase in (FORWARD, RECOMPUTING, BACKWARD):
            got = ops.ops.get(("", phase), ())
            if len(got) == 2:
                first, second = got if phase != BACKWARD else got[::-1]
                mine.update({("dispatch", phase): (first,), ("combine", phase): (second,)})
        mod = module.get_submodule(m.path)
        eg = mod.__dict__[ATTR] = ExpertGroup(groups.axis(m.axis), m.num_experts, AxisOps(mine, ops.engine))
        if eg.group.size > 1:
            if is_hf_experts(mod) and not getattr(mod.forward, "_shardplan_ep_guard", False):
                _hf_dispatching(mod)
            _guard(mod, m.path, m.axis, eg)


_BOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # root module -> its executor now in place
_OF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()      # executor -> ((expert module, group), ...)


def bind(module: nn.Module, plan, groups, exe) -> list:
    """``functional_call``'s form of :func:`install` (runtime/axes.py): this plan's expert groups on the expert
    modules and those of the module's other plans taken away (installed at the plan's first call). They stay
    when the call returns: a checkpointed unit's recompute in the backward dispatches with them."""
    mine = _OF.get(exe)
    if mine is None:
        install(module, plan, groups, exe)
        mods = (module.get_submodule(e.path) for e in EPX.of(plan).modules)
        mine = _OF[exe] = tuple((weakref.ref(m), m.__dict__[ATTR]) for m in mods if ATTR in m.__dict__)
    now = _BOUND.get(module)
    if now is not None and now() is exe:  # (one plan called again: in place already)
        return []
    keep = {id(ref()) for ref, _ in mine}
    for m in module.modules():
        if ATTR in m.__dict__ and id(m) not in keep:
            del m.__dict__[ATTR]
    for ref, eg in mine:
        m = ref()
        if m is not None:
            m.__dict__[ATTR] = eg
    _BOUND[module] = weakref.ref(exe)
    return []


def is_hf_experts(mod: nn.Module) -> bool:
    """A Hugging Face experts module (transformers 5's ``@use_experts_implementation`` classes:
    ``MixtralExperts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``DeepseekV3Experts``, ...): stacked
    ``gate_up_proj`` (or ``up_proj``) ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``, called as
    ``experts(hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]``."""
    return (type(mod).__module__.startswith("transformers.") and callable(getattr(mod, "_apply_gate", None))
            and all(hasattr(mod, a) for a in ("has_gate", "has_bias", "is_transposed", "down_proj")))


def _hf_linear(mod: nn.Module, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
    w = getattr(mod, name)[e]
    b = getattr(mod, name + "_bias")[e] if mod.has_bias else None
    if mod.is_transposed:   # [in, out]
        return x @ w + b if b is not None else x @ w
    return torch.nn.functional.linear(x, w, b)


def _hf_dispatching(mod: nn.Module) -> None:
    """Give a Hugging Face experts module split over ``ep`` a forward that computes what its own does (the
    eager loop: each expert's gated MLP on its tokens, weighted by the router's ``top_k_weights``, summed over
    the top-k) with its tokens sent to the ranks holding their experts: :func:`dispatch`, this rank's
    experts over the rows it received, :func:`combine`. [Note: its own forward indexes the stacked weights
    by global expert id, and this rank holds ``num_experts / ep`` of them; Hugging Face's own expert
    parallelism (``_is_expert_parallel``, DTensor tensor-parallel plans) is not used. Local experts run one
    after another (the ``eager`` implementation's order of work), whatever ``config._experts_implementation``
    says.]"""
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        routed = dispatch(mod, hidden_states, top_k_index)
        outs = []
        for e, rows in enumerate(routed.tokens.split(routed.counts)):
            h = _hf_linear(mod, rows, "gate_up_proj" if mod.has_gate else "up_proj", e)
            h = mod._apply_gate(h) if mod.has_gate else mod.act_fn(h)
            h = _hf_linear(mod, h, "down_proj", e)
            if getattr(mod, "has_post_expert_norm", False):
                h = mod.post_expert_norm(h)
            outs.append(h)
        y = combine(routed, torch.cat(outs))                                    # [N, k, H]
        return (y * top_k_weights.unsqueeze(-1)).sum(1).to(hidden_states.dtype)

    mod.forward = forward


def _guard(mod: nn.Module, path: str, axis: str, eg: ExpertGroup) -> None:
    """Refuse a forward of an expert module split over ``ep`` that never calls :func:`dispatch`: it would
    compute with this rank's ``num_experts / ep`` experts as if they were all of them (a Hugging Face MoE
    module's own forward indexes its stacked weights by global expert id): a crash deep inside the model,
    or, where the ids happen to fit, silently another expert's weights."""
    if getattr(mod.forward, "_shardplan_ep_guard", False):
        return
    inner = mod.forward

    def why() -> str:
        return (f"expert module {path!r} ({type(mod).__name__}) has its {eg.num_experts} experts split over "
                f"{axis!r} ({eg.local_experts} per rank), but its forward ran without calling "
                f"shardplan.expert_parallel.dispatch: it would compute with this rank's experts as if they were all "
                f"of them. Fix: keep {axis!r} out of dim 0 of its "
                f"weights' specs (e.g. P('dp', None, None): experts gathered like any parameter), or make its "
                f"forward call sp.expert_parallel.dispatch / combine (docs/expert_parallel.md)")

    def forward(*args, **kwargs):
        mod.__dict__[_DISPATCHED] = False
        try:
            out = inner(*args, **kwargs)
        except Exception as exc:
            if not mod.__dict__.get(_DISPATCHED):
                raise RuntimeShardingError(why()) from exc
            raise
        if not mod.__dict__.get(_DISPATCHED):
            raise RuntimeShardingError(why())
        return out

    forward._shardplan_ep_guard = True
    mod.forward = forward
