"""Context parallelism in the plan: the attention calls of a traced step and the key/value traffic a
``cp`` axis adds to them. Pure functions over the traced shapes; the runtime gathers the keys and values
(:mod:`shardplan.runtime.context_parallel`).

A plan traced with example inputs (``trace=``, as one rank's training step calls the model: with ``cp``
each sequence holds ``T/cp`` tokens, what ``shard_batch`` returns) records every
``F.scaled_dot_product_attention`` call (``sp.context_parallel.attention`` makes one) and the module that
makes it. With ``cp > 1`` each call all-gathers its keys and values over ``cp`` in forward and
reduce-scatters their gradients in backward: four ops per call in the schedule, each of the gathered
tensor's bytes, of which a rank sends ``(cp-1)/cp`` (ring).

>>> plan = sp.plan(model, rules, Mesh(dp=2, cp=2), trace=tokens[:, :T // 2])
>>> plan.comm_bytes()["context_parallel"]          # K/V all-gathers and their gradients' reduce-scatters
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from ..errors import PlanError
from ..mesh import Mesh
from ..units import in_cp_attention, run_traced, trace_args
from .axis import Anchor, ComputeAxis, ModuleOps, Placing, anchors
from .kinds import ACTIVATIONS, ALL_GATHER, MODULE_BACKWARD, MODULE_FORWARD, REDUCE_SCATTER
from .tp_styles import LINEAR
from .ops import Op

CONTEXT_AXIS = "cp"


@dataclass(frozen=True)
class AttentionCall:
    """One traced attention call: the innermost module that made it (``path``), the elements of its local
    keys and values, bytes per element; where its ops sit in the schedule (``unit``, ``after``,
    ``back_after``: :func:`place`)."""

    path: str
    k_numel: int
    v_numel: int
    itemsize: int
    unit: str = ""
    after: str = ""
    back_after: str = ""


def axis_size(mesh: Mesh) -> int:
    return mesh.axis_size(CONTEXT_AXIS) if CONTEXT_AXIS in mesh.axis_names else 1


# [Note: which attention the traced step sees] sp.context_parallel.attention marks its plain call (units.cp_attention);
# a model calling F.scaled_dot_product_attention itself would silently attend over its local chunks
_through_attention = in_cp_attention


HF_ATTENTION = "shardplan_cp"  # runtime.context_parallel.HF_ATTENTION (the planner does not import the runtime)


# attributes of an attention module that transformers passes to its attention function as arguments
# "shardplan_cp" cannot honour (runtime/context_parallel_hf.py:UNSUPPORTED): learned attention sinks (gpt-oss)
UNSUPPORTED_ATTRIBUTES = {"sinks": "learned attention sinks (passed as s_aux=)",
                          "s_aux": "learned attention sinks (passed as s_aux=)"}


def check_hf_attention(model, mesh: Mesh, error=PlanError) -> None:
    """Refuse a Hugging Face model (any module whose ``config`` names an ``_attn_implementation``) that
    attends with anything but shardplan's ``"shardplan_cp"`` under ``cp > 1``: eager, sdpa, flash and flex
    attention, and functions registered under other names, attend over this rank's chunks only. Untraced
    plans included: the name is on the model. Under ``"shardplan_cp"``, a module with an attribute it cannot
    honour (attention sinks) is refused, naming the module and the attribute."""
    cp = axis_size(mesh)
    if cp <= 1 or model is None or not hasattr(model, "named_modules"):
        return
    for path, mod in model.named_modules():
        impl = getattr(getattr(mod, "config", None), "_attn_implementation", None)
        if isinstance(impl, str) and impl != HF_ATTENTION:
            raise error(
                f"module {path or '<root>'!r} ({type(mod).__name__}) attends with Hugging Face's attention "
                f"{impl!r}: under context parallelism (cp={cp}) each rank holds 2 of {2 * cp} chunks of every "
                f"sequence, and {impl!r} would attend over those only (a wrong loss, silently). Fix: run "
                f"sp.context_parallel.hf_attention() (it registers {HF_ATTENTION!r} with transformers' "
                f"AttentionInterface) and build the model with attn_implementation={HF_ATTENTION!r} (or call "
                f"model.set_attn_implementation({HF_ATTENTION!r})); pass position_ids from "
                f"sp.context_parallel.shard_batch; or plan without the cp axis")
        attr = next((a for a in UNSUPPORTED_ATTRIBUTES if getattr(mod, a, None) is not None), None)
        if impl == HF_ATTENTION and attr is not None:
            raise error(
                f"module {path or '<root>'!r} ({type(mod).__name__}) has {attr!r}, "
                f"{UNSUPPORTED_ATTRIBUTES[attr]}: Hugging Face attention {HF_ATTENTION!r} runs causal attention (a "
                f"sliding window and soft-capped logits included) without them. Fix: plan without the cp axis, "
                f"with the model's own attention")


def check_flow(model, trace, mesh: Mesh, tp_modules=(), error=PlanError) -> None:
    """Run the traced forward once under :mod:`shardplan.flow`: refuse an operation that mixes the sequence
    (``cp > 1``: eager attention's softmax over keys, a shift of the labels, ...) or a column-parallel
    module's split features (a reduction over them, a read by anything but its row-parallel sibling)."""
    cp = axis_size(mesh)
    colwise = {m.path: (m.axis, mesh.axis_size(m.axis)) for m in tp_modules
               if m.style == "colwise" and mesh.axis_size(m.axis) > 1}
    rowwise = {m.path: m.axis for m in tp_modules if m.style == "rowwise" and m.kind == LINEAR}
    if cp <= 1 and not colwise:
        return
    args, kwargs = trace_args(trace)
    from ..flow import check  # (keeps import shardplan torch-free: flow.py imports torch)
    check(model, args, kwargs, error, colwise, rowwise, cp, _through_attention,
          run=lambda: run_traced(model, trace, {}, grad=False))


def trace_calls(model, trace, itemsize: Optional[int], mesh: Mesh) -> tuple[AttentionCall, ...]:
    """Run the traced forward once and record every ``scaled_dot_product_attention`` call with the module
    that made it. Raises :class:`PlanError` (with ``cp > 1``) for a call context parallelism cannot run:
    an explicit ``attn_mask``, a local sequence of odd length (the full one must divide by ``2*cp``), or a
    call that does not come through ``sp.context_parallel.attention``."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode


    cp = axis_size(mesh)
    stack: list[str] = [""]
    seen: list[AttentionCall] = []

    sdpa = F.scaled_dot_product_attention

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is sdpa:
                named = dict(zip(("query", "key", "value", "attn_mask"), args), **kwargs)
                q, k, v = named["query"], named["key"], named["value"]
                where = f"attention in {stack[-1] or 'the root module'!r}"
                if cp > 1 and named.get("attn_mask") is not None:
                    raise PlanError(f"{where} passes an attn_mask: context parallelism (cp={cp}) cannot honour an "
                                    f"arbitrary mask over sequence chunks; use is_causal=True (or no mask), or plan "
                                    f"without the cp axis")
                if cp > 1 and q.shape[-2] % 2:
                    raise PlanError(f"{where}: the traced local sequence has {q.shape[-2]} tokens, so the full "
                                    f"sequence ({q.shape[-2] * cp}) is not divisible by 2*cp = {2 * cp}; trace with "
                                    f"an even local length (sp.context_parallel.shard_batch of a sequence divisible "
                                    f"by {2 * cp})")
                if cp > 1 and not _through_attention():
                    raise PlanError(f"{where} calls F.scaled_dot_product_attention itself: under context parallelism "
                                    f"(cp={cp}) it would attend over this rank's chunks only; call "
                                    f"sp.context_parallel.attention(q, k, v, is_causal=True) there instead")
                seen.append(AttentionCall(stack[-1], k.numel(), v.numel(), itemsize or k.element_size()))
            return func(*args, **kwargs)

    def enter(path: str):
        def hook(_m, _inputs) -> None:
            stack.append(path)
        return hook

    def leave(_m, _inputs, _output) -> None:  # (a hook that returns something replaces the output)
        stack.pop()

    handles = []
    for path, mod in model.named_modules():
        handles += [mod.register_forward_pre_hook(enter(path)), mod.register_forward_hook(leave)]
    try:
        with Spy():
            run_traced(model, trace, {}, grad=False)
    finally:
        for h in handles:
            h.remove()
    return tuple(seen)


def per_rank(calls: Sequence[AttentionCall], tp_modules, mesh: Mesh) -> tuple[AttentionCall, ...]:
    """``calls`` with the keys and values one rank holds under tensor parallelism: the traced model has
    global shapes, and a module whose linear projections below it are column-parallel over compute axes
    attends with ``1/tp`` of the heads on each rank (the planner's whole-head check keeps that exact)."""
    out = []
    for c in calls:
        axes = {m.axis for m in tp_modules if m.style == "colwise" and m.kind == "linear"
                and (c.path == "" or m.path.startswith(c.path + "."))}
        d = 1
        for a in axes:
            d *= mesh.axis_size(a)
        out.append(dataclasses.replace(c, k_numel=c.k_numel // d, v_numel=c.v_numel // d) if d > 1 else c)
    return tuple(out)


def place(module, calls: Sequence[AttentionCall], units) -> tuple[AttentionCall, ...]:
    """``calls`` with the unit whose forward makes each and the schedule steps its ops follow."""
    where = anchors(module, sorted({c.path for c in calls}), units)
    return tuple(dataclasses.replace(c, unit=a.unit, after=a.after, back_after=a.back_after)
                 for c in calls for a in [where[c.path]])


def module_ops(calls: Optional[Sequence[AttentionCall]], mesh: Mesh) -> tuple[ModuleOps, ...]:
    """Per placed call over ``cp > 1``: forward all-gathers of its keys and values, backward reduce-scatters
    of their gradients; each op's bytes are the gathered tensor's (``cp`` times the local one)."""
    cp = axis_size(mesh)
    if cp <= 1 or not calls:
        return ()
    out = []
    for c in calls:
        def op(kind, event, numel: int) -> Op:
            return Op(kind=kind, unit=c.unit, what=ACTIVATIONS, event=event, at=c.path, axes=(CONTEXT_AXIS,),
                      bytes=numel * cp * c.itemsize)
        out.append(ModuleOps(Anchor(c.unit, c.after, c.back_after),
                             forward=(op(ALL_GATHER, MODULE_FORWARD, c.k_numel), op(ALL_GATHER, MODULE_FORWARD, c.v_numel)),
                             backward=(op(REDUCE_SCATTER, MODULE_BACKWARD, c.k_numel),
                                       op(REDUCE_SCATTER, MODULE_BACKWARD, c.v_numel))))
    return tuple(out)


def kv_bytes(calls: Sequence[AttentionCall], mesh: Mesh) -> int:
    """Bytes one rank sends per training step for the keys and values of every attention call: the
    all-gathers and the reduce-scatters of their gradients, ``(cp-1)/cp`` of each gathered tensor (each op
    rounded down on its own, as the forecast counts them)."""
    cp = axis_size(mesh)
    if cp <= 1:
        return 0
    return sum(2 * (n * cp * c.itemsize * (cp - 1) // cp) for c in calls for n in (c.k_numel, c.v_numel))


def calls_note(calls: Sequence[AttentionCall], mesh: Mesh) -> str:
    return (f"context parallelism: {len(calls)} attention calls per step, keys and values all-gathered over "
            f"{CONTEXT_AXIS!r} (cp={axis_size(mesh)}) and their gradients reduce-scattered")


# -- the axis ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ContextAxisPlan:
    """Context parallelism in a traced plan (``plan.axis("cp")``; :func:`of`): the attention calls of one step,
    placed (``None``: not traced, or no ``cp`` axis)."""

    calls: Optional[tuple[AttentionCall, ...]]
    kind = "cp"


def of(plan) -> ContextAxisPlan:
    """``plan``'s context parallelism: its ``cp`` axis value, or one without calls (``calls is None``)."""
    return next((v for v in plan.axes if v.kind == "cp"), _NONE)


_NONE = ContextAxisPlan(None)


class ContextAxis(ComputeAxis):
    """The ``cp`` axis: no parameter is computed sharded over it; a traced plan's attention calls gather keys
    and values over it (their ops after the tensor-parallel ones of a step, before the expert ones)."""

    kind, op_order = "cp", 1

    def place(self, ctx: Placing, value: Any) -> Optional[ContextAxisPlan]:
        if ctx.trace is None or CONTEXT_AXIS not in ctx.mesh.axis_names:
            return None
        tpv = ctx.placed.get("tp")
        traced = trace_calls(ctx.module, ctx.trace, ctx.itemsize, ctx.mesh)
        return ContextAxisPlan(place(ctx.module, per_rank(traced, tpv.modules if tpv is not None else (), ctx.mesh),
                                     ctx.units))

    def module_ops(self, value: Optional[ContextAxisPlan], mesh: Mesh) -> tuple[ModuleOps, ...]:
        return module_ops(value.calls if value is not None else None, mesh)

    def comm_bytes(self, plan, value: Optional[ContextAxisPlan]) -> dict:
        if CONTEXT_AXIS not in plan.mesh.axis_names:
            return {}
        return {"context_parallel": None if value is None else kv_bytes(value.calls, plan.mesh)}

    def note(self, value: Optional[ContextAxisPlan], mesh: Mesh) -> Optional[str]:
        return calls_note(value.calls, mesh) if value is not None else None

    def claims(self, op: Op) -> bool:
        return tuple(op.axes) == (CONTEXT_AXIS,) and op.kind in (ALL_GATHER, REDUCE_SCATTER)

    def check_op(self, plan, value: Optional[ContextAxisPlan], op: Op) -> Optional[str]:
        if (op.at, op.unit) not in {(c.path, c.unit) for c in (value.calls if value is not None else ())}:
            return (f"moves keys/values of attention in {op.at!r} (unit {op.unit!r}), which is no traced attention "
                    f"call of the plan")
        if (op.kind, op.event) not in ((ALL_GATHER, MODULE_FORWARD), (REDUCE_SCATTER, MODULE_BACKWARD)):
            return ("context-parallel keys and values are all-gathered at module_forward and their gradients "
                    "reduce-scattered at module_backward")
        return None

    def to_dict(self, value: Optional[ContextAxisPlan]) -> dict:
        return {} if value is None else {"context_calls": [dataclasses.asdict(c) for c in value.calls]}

    def from_dict(self, d: Mapping[str, Any]) -> Optional[ContextAxisPlan]:
        calls = d.get("context_calls")
        return None if calls is None else ContextAxisPlan(tuple(AttentionCall(**c) for c in calls))
