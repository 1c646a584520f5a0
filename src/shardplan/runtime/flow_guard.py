"""The first forward of an untraced plan with ``cp > 1`` or column-parallel modules, run under
:mod:`shardplan.flow`: an operation that would compute per-rank pieces silently (attention over this
rank's sequence chunks, a shift of the labels, a reduction over a column-parallel output's features, ...)
raises :class:`~shardplan.errors.RuntimeShardingError` before any gradient forms, with the message a
traced plan gives at plan time. A traced plan was checked by the planner; later forwards run unobserved.
"""

from __future__ import annotations

import torch

from ..errors import RuntimeShardingError
from ..planner.context_parallel import CONTEXT_AXIS, check_hf_attention
from ..planner.tensor_parallel import LINEAR
from ..planner import context_parallel as CPX, tensor_parallel as TPX
from .context_parallel import active
from ..flow import FlowCheck


def _sizes(plan, active_tp) -> tuple[int, dict, dict]:
    cp = plan.mesh.axis_size(CONTEXT_AXIS) if CONTEXT_AXIS in plan.mesh.axis_names else 1
    colwise = {m.path: (m.axis, plan.mesh.axis_size(m.axis)) for m in active_tp
               if m.style == "colwise" and plan.mesh.axis_size(m.axis) > 1}
    rowwise = {m.path: m.axis for m in active_tp if m.style == "rowwise" and m.kind == LINEAR}
    return cp, colwise, rowwise


def install(module, plan, active_tp) -> list:
    """Check the model's Hugging Face attention now (``cp > 1``), and the dataflow of its first forward
    (an untraced plan); returns the hooks' handles (they remove themselves after that forward)."""
    check_hf_attention(module, plan.mesh, RuntimeShardingError)
    cp, colwise, rowwise = _sizes(plan, active_tp)
    check_cp = cp > 1 and CPX.of(plan).calls is None
    check_tp = bool(colwise) and TPX.of(plan).activations is None
    if not (check_cp or check_tp):
        return []

    state: dict = {}

    @torch._dynamo.disable
    def before(_mod, args, kwargs):
        if state.get("done"):  # (hooks are removed here, not while the module iterates over them)
            for h in list(handles):
                h.remove()
            return None
        if state:
            return None
        g = active()
        mode = FlowCheck(RuntimeShardingError, colwise if check_tp else {}, rowwise,
                         g.size if check_cp and g is not None else 1)
        mode.mark_inputs(args, kwargs)
        state["hooks"] = mode.hooks(module)
        handles.extend(state["hooks"])  # (the list returned: a caller that removes it removes these too)
        state["mode"] = mode
        mode.__enter__()
        return None

    @torch._dynamo.disable
    def after(_mod, _args, _kwargs, out):
        mode = state.get("mode")
        if mode is None or state.get("done"):
            return None
        state["done"] = True
        mode.__exit__(None, None, None)
        mode.live = False  # its hooks stay until the next forward (removed there), doing nothing
        mode.check_root_output(out)
        return None

    # [Note: the exit hook runs always (a refusal raises mid-forward: always_call), and checks the root's output
    # itself: the mode's own hooks, registered at the first forward, run after it]
    handles = [module.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
               module.register_forward_hook(after, with_kwargs=True, always_call=True)]
    return handles
