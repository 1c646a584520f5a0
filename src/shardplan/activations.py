"""Activation memory of a traced training step, measured on the meta device (no memory, no compute).

The planner calls :func:`profile` when a plan is traced with example inputs (``trace=``): one forward and
backward of a meta copy of the model, in the plan's compute dtype, once as it is and once with every
unit checkpointed (``torch.utils.checkpoint``, non-reentrant). A dispatch mode sees every tensor the step
allocates and follows each storage until it dies; parameters are left out (the plan counts them, in its
own layout), their gradients are counted as they form, until their unit completes (``Activations.grads``). At each event the runtime reports (``pre_forward(u)``,
``post_backward(u)``, ...) the profile records the activation bytes alive and the most alive since the
previous event, and the bytes the ops in between that are not matmuls moved (:mod:`shardplan.optraffic`:
what the forecast times at the memory bandwidth); :func:`shardplan.planner.accounting.memory` adds them to the model states at the same events.

>>> acts = profile(model, trace=(tokens, tokens), units=plan.units, compute_dtype="bfloat16")
>>> acts.plain[-1].event, acts.recompute[-1].event
('end_backward', 'end_backward')
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .dtypes import to_torch
from .metatrace import meta_trace, reraise, training_call
from .optraffic import moved_bytes
from .optraffic import tensors_in as _tensors
from .step_call import checkpoint_units, scalar_of, undo_checkpoint, unit_entries
from .units import trace_args, traced_step

ROOT = "<root>"


@dataclass(frozen=True)
class ActivationPoint:
    """Activation bytes at one event of a traced step: ``live`` just after it, ``peak`` the most alive
    between the previous event and this one (the compute in between: a unit's forward, its backward).
    ``moved``: the bytes the ops in between that are not matmuls read and write (norms, activations,
    casts, the loss: :mod:`shardplan.optraffic`), which the forecast times at the memory bandwidth;
    ``None`` in a profile saved before it was counted."""

    event: str
    live: int
    peak: int
    moved: Optional[int] = None


@dataclass(frozen=True)
class Activations:
    """The activation profile of one traced training step (``inputs`` describes the traced inputs):
    ``plain`` as the model runs, ``recompute`` with every unit checkpointed. Measured on the meta device
    by :func:`profile` (the planner calls it for a traced plan); the plan only stores the numbers."""

    inputs: str
    plain: tuple[ActivationPoint, ...]
    recompute: tuple[ActivationPoint, ...]
    # True: the points also count the parameters' gradients from the op that forms each until its unit
    # completes, so the walk counts a unit's unsharded gradient from its reduction on, not from its
    # ``prepare``. False: a profile saved before (gradients left out of it).
    grads: bool = False
    # tokens of the traced step (B x T of its first 2-D integer input; None: not a token model, or a
    # profile saved before): the forecast scales the traced ``moved`` bytes to the batch it forecasts
    tokens: Optional[int] = None

    def points(self, recompute: bool = False) -> tuple[ActivationPoint, ...]:
        return self.recompute if recompute else self.plain


def _fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
    """``scaled_dot_product_attention`` as a GPU runs it: the fused kernels, which keep the output and the
    log-sum-exp for backward instead of the T x T attention weights. [Note: on the meta device torch picks
    the math path, whose saved weights would count tens of GiB a GPU never holds; CPUs have fused kernels
    too.] Grouped-query attention (``enable_gqa``, fewer key/value heads than query heads) without a mask
    goes to the flash kernel too, which takes it natively on GPUs (Hugging Face's Llama calls it so); with
    a mask, or not 4-D, torch's own runs."""
    import torch
    gqa = kw.pop("enable_gqa", False)
    if q.dim() != 4 or (gqa and attn_mask is not None):  # (inside the mode's handler: torch's own function)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                                is_causal=is_causal, scale=scale,
                                                                **({"enable_gqa": gqa} if gqa else {}), **kw)
    if attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask.expand(q.shape[0], q.shape[1], -1, -1),
                                                                   True, dropout_p, is_causal, scale=scale)[0]


def _fused_mode():
    """A ``TorchFunctionMode`` under which ``F.scaled_dot_product_attention`` runs as :func:`_fused_attention`
    (torch's function itself is left as it is: every call is seen through torch's override protocol, whether the
    model looked the function up on ``F`` or bound it to a name of its own)."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class FusedAttention(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                return _fused_attention(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))
    return FusedAttention()


class _Tracker:
    """Live bytes of the storages a step allocates (parameters excluded), with the most seen per interval."""

    def __init__(self, skip: set):
        from torch.multiprocessing.reductions import StorageWeakRef
        self._ref = StorageWeakRef
        self.skip = skip                      # storage ids (parameters) left out
        self.live: dict[int, tuple[Any, int]] = {}
        self.total = 0
        self.high = 0                          # most since the last event
        self.moved = 0                         # bytes moved by memory-bound ops since the last event

    def add(self, t) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.skip:
            return
        held = self.live.get(key)
        if held is not None and not held[0].expired():
            return
        n = st.nbytes()
        if held is not None:
            self.total -= held[1]
        self.live[key] = (self._ref(st), n)
        self.total += n

    def purge(self) -> int:
        dead = [k for k, (w, _) in self.live.items() if w.expired()]
        for k in dead:
            self.total -= self.live.pop(k)[1]
        return self.total

    def after_op(self) -> None:
        self.high = max(self.high, self.purge())

    def point(self, event: str) -> ActivationPoint:
        live = self.purge()
        p = ActivationPoint(event, live, max(self.high, live), self.moved)
        self.high, self.moved = live, 0
        return p


def _run(model, trace, entries: dict[str, list[str]], checkpointed: bool,
         finished: Optional[dict] = None) -> tuple[ActivationPoint, ...]:
    import torch
    from torch.utils._pytree import tree_map

    run = _Run(model, entries, finished)
    handles = run.hooks()
    # [Note: the fused stand-in in backward] torch runs the backward with no TorchFunctionMode active (the mode
    # handles the backward call itself, with itself off the stack), so each unit's recompute enters the mode
    # again (checkpoint's context_fn). A model's own checkpointing recomputes with torch's attention (on meta:
    # the math path), and so does nn.MultiheadAttention's attention (the mode sees multi_head_attention_forward,
    # not the call inside it)
    undo = checkpoint_units(model, entries, _fused_mode) if checkpointed else []
    fused = _fused_mode()
    args, kwargs = training_call(model, *trace_args(trace))  # as a training step calls it (no KV cache)
    # a leaf input that takes a gradient stays one (its copy to meta would send the gradient back to its device)
    args, kwargs = tree_map(lambda x: x.detach().to("meta").requires_grad_(x.requires_grad)
                            if isinstance(x, torch.Tensor) else x, (args, kwargs))
    try:
        with fused:
            run.step(args, kwargs)
    except Exception as exc:
        reraise(model, exc, "the activation profile's traced step" + (" (every unit checkpointed)" if checkpointed else ""))
    finally:
        for h in handles:
            h.remove()
        undo_checkpoint(undo)
    return tuple(run.points)


class _Run:
    """One traced step's profile in the making: the tracker, the points recorded at each event, and the
    hooks that record them (each unit's forward and backward, its parameters' gradients as they form);
    ``finished``: {module path: whether its forward ran to its end inside a recompute}, filled in."""

    def __init__(self, model, entries: dict[str, list[str]], finished: Optional[dict]):
        self.model, self.entries, self.finished = model, entries, finished
        self.params = [p for p in model.parameters()]
        self.tracker = _Tracker({p.untyped_storage()._cdata for p in self.params})
        self.points: list[ActivationPoint] = []
        self.backward = False
        pending = {u: 0 for u in entries}
        self.owner: dict = {}
        for u, paths in entries.items():
            for p in paths:
                for q in model.get_submodule(p).parameters():
                    if q.requires_grad and id(q) not in self.owner:
                        self.owner[id(q)] = u
                        pending[u] += 1
        self.waiting = dict(pending)
        self.started: set = set()
        # [Note: gradients as they form] a parameter's gradient is counted from the op that forms it until
        # its unit completes, as autograd holds it on ``.grad`` until the runtime lands it in the unit's flat
        # gradient (``BufferState.collect_grads``); the plan's walk then leaves a unit's unsharded gradient
        # out of the peak until its reduction (``Activations.grads``). Counting the whole flat gradient from
        # ``prepare`` instead counted the root's (embeddings and head: 2 GiB at Llama-3 8B shapes) through
        # the head's backward, before any of it exists, and the head's weight gradient twice.
        self.members: dict = {u: [q for q in self.params if self.owner.get(id(q)) == u] for u in entries}

    def mark(self, event: str) -> None:
        self.points.append(self.tracker.point(event))

    def mode(self):
        """The dispatch mode that sees every tensor the step allocates and the bytes each op moves."""
        from torch.utils._python_dispatch import TorchDispatchMode
        tracker = self.tracker

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker.moved += moved_bytes(func, args, kwargs or {}, out)
                for t in _tensors(out, []):
                    if t.device.type == "meta":
                        tracker.add(t)
                tracker.after_op()
                return out
        return Mode()

    def tail(self, u):
        # [Note: a unit's backward ends with its input's gradient, which may form after its parameters'
        # gradients (post_backward(u)): the bytes moved in between (the first norm's input gradient, the
        # residual's add) are added to post_backward(u)'s point, so its ``moved`` is the whole backward]
        points, tracker = self.points, self.tracker

        def hook(_g):
            if points and points[-1].event == f"post_backward({u})" and tracker.moved:
                points[-1] = dataclasses.replace(points[-1], moved=points[-1].moved + tracker.moved)
                tracker.moved = 0
        return hook

    def fwd_pre(self, u):
        import torch

        def hook(_m, _a):
            if not self.backward and u not in self.started:
                self.started.add(u)
                self.mark(f"pre_forward({u})")
                if _a and isinstance(_a[0], torch.Tensor) and _a[0].requires_grad:
                    _a[0].register_hook(self.tail(u))
        return hook

    def fwd_post(self, u, last):
        def hook(_m, _a, out):
            if self.backward:
                return out
            if last:
                self.mark(f"post_forward({u})")
            fired = []

            def grad_hook(_g):
                if not fired:
                    fired.append(1)
                    self.mark(f"pre_backward({u})")
            for t in _tensors(out, []):
                if t.requires_grad:
                    t.register_hook(grad_hook)
            return out
        return hook

    def release(self, u) -> None:
        for q in self.members[u] if u is not None else [q for q in self.params if id(q) not in self.owner]:
            q.grad = None

    def on_grad(self, u):
        def hook(p):
            self.waiting[u] -= 1
            if self.waiting[u] == 0:
                self.release(u)
                self.mark(f"post_backward({u})")
        return hook

    def recomputed(self, path):  # the module's forward ran to its end inside a recompute (backward)
        def hook(_m, _a, _out):
            if self.backward:
                self.finished[path] = True
        return hook

    def hooks(self) -> list:
        model, handles = self.model, []
        for path in self.finished or ():
            handles.append(model.get_submodule(path).register_forward_hook(self.recomputed(path)))
        for u, paths in self.entries.items():
            for k, p in enumerate(paths):
                m = model.get_submodule(p)
                handles.append(m.register_forward_pre_hook(self.fwd_pre(u)))
                handles.append(m.register_forward_hook(self.fwd_post(u, k == len(paths) - 1)))
        for q in self.params:
            if q.requires_grad:
                u = self.owner.get(id(q))
                if u:
                    handles.append(q.register_post_accumulate_grad_hook(self.on_grad(u)))
        return handles

    def step(self, args, kwargs) -> None:
        """One forward and backward of the meta model on ``args, kwargs`` (already on meta), marked."""
        import torch
        with torch.enable_grad(), meta_trace(), self.mode():
            for x in _tensors((args, kwargs), []):
                self.tracker.add(x)
            self.mark("before_forward")
            loss = scalar_of(self.model(*args, **kwargs))
            self.mark(f"post_forward({ROOT})")
            self.backward = True
            self.mark("begin_backward")
            loss.backward()
            del loss
            self.release(None)  # the root's gradients: landed when the backward ends
            for q in self.params:
                q.grad = None
            self.mark("end_backward")


def _tensor_parallel(meta, local_shapes: dict, styles: Sequence[tuple[str, str, str, int]]) -> None:
    """Make the meta copy compute as one tensor-parallel rank does: its parameters in their tp-local shapes
    (``local_shapes``: name -> shape), and at each module the activation its style moves
    (``styles``: ``(module path, kind, style, axis size)``): a ``colwise_gather`` output all-gathered to its
    full last dimension, a ``rowwise_split`` linear's replicated input split to this rank's part; a
    ``colwise`` output stays local and a ``rowwise`` output (all-reduced) has the full shape already.

    [Note: the profile then holds local shapes where the runtime's DTensors do; the collectives' own
    buffers (an all-reduce in place, an all-gather's output) are what these stand-ins allocate]"""
    import torch
    for name, shape in local_shapes.items():
        p = meta.get_parameter(name)
        if tuple(p.shape) != tuple(shape):
            p.data = torch.empty(shape, dtype=p.dtype, device="meta")
    for path, kind, style, n in styles:
        mod = meta.get_submodule(path)
        if style == "colwise_gather":
            mod.register_forward_hook(lambda _m, _a, out, n=n: torch.cat([out] * n, dim=-1))
        elif style == "rowwise_split" and kind == "linear":
            mod.register_forward_pre_hook(
                lambda _m, args, n=n: (args[0].narrow(-1, 0, args[0].shape[-1] // n),) + tuple(args[1:]))


def profile(model, trace, units: Sequence[tuple[str, Sequence[str]]], compute_dtype: Optional[str] = None,
            describe: str = "", local_shapes: Optional[dict] = None,
            styles: Sequence[tuple[str, str, str, int]] = (), recomputed: Optional[dict] = None) -> Activations:
    """The activation profile of one training step on ``trace`` (see the module's docstring).

    ``units``: ``[(unit name, module paths)]`` without the root, as the plan has them. Under tensor
    parallelism ``local_shapes`` and ``styles`` make it one tp rank's step (:func:`_tensor_parallel`).
    ``recomputed``: ``{module path: False}``, set to ``True`` for each module whose forward the checkpointed
    step's recompute ran to its end (torch's default early stop ends a recompute once backward has every
    saved tensor: see [Note: checkpoint early stop] in planner/tensor_parallel.py)."""
    import torch
    meta = copy.deepcopy(model).to("meta") if any(p.device.type != "meta" for p in model.parameters()) \
        else copy.deepcopy(model)
    # [Note: ``.to("meta")`` makes each module its own Parameter, so tied weights (a Hugging Face LM head sharing
    # the embedding) come apart: tie them again, or the tensor-parallel-local shape reaches only one of them]
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            path, _, attr = name.rpartition(".")
            setattr(meta.get_submodule(path) if path else meta, attr, meta.get_parameter(first[id(p)]))
        else:
            first[id(p)] = name
    if compute_dtype:
        dt = to_torch(compute_dtype)
        for p in meta.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dt)
    if local_shapes or styles:
        _tensor_parallel(meta, local_shapes or {}, styles)
    meta.train()
    entries = unit_entries(meta, units)
    ins = _tensors(trace_args(trace), [])
    what = describe or ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in ins)
    with torch.random.fork_rng(devices=[]), traced_step():
        plain = _run(meta, trace, entries, checkpointed=False)
        recompute = _run(meta, trace, entries, checkpointed=True, finished=recomputed)
    tokens = next((t.numel() for t in ins if t.dim() == 2 and not t.is_floating_point() and not t.is_complex()), None)
    return Activations(inputs=what, plain=plain, recompute=recompute, grads=True, tokens=tokens)
