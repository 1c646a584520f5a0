"""Replicated parameters inside a tensor-parallel region: read on activations sharded over a compute axis,
their gradients are partial sums (:func:`trace_partial_grads` follows a traced forward, :func:`assumed_partial_grads`
judges an untraced one by size). Pure functions over the planner's traced step."""

from __future__ import annotations

from typing import Mapping, Sequence

from ..errors import PlanError
from ..units import run_traced
from .heads import _head_dim
from .tp_styles import LINEAR, TPModule

# -- replicated parameters inside a tensor-parallel region -----------------------------------------------
# [Note: partial gradients. Between a column-parallel module and its row-parallel sibling each rank holds
# the activations of its own heads (features). A replicated parameter read there (Qwen3's and Gemma3's
# per-head ``q_norm`` / ``k_norm``, applied to the viewed heads of ``q_proj``'s output) computes correctly,
# but its gradient on each rank sums over that rank's heads only: a partial sum over the compute axis.
# Such parameters get buffers of their own (``BufferPlan.partial_axes``) whose gradients are all-reduced
# (summed) over the compute axis before the unit's reduction: one ``all_reduce partial_grads`` op per unit,
# in the schedule. A traced plan follows the activations (which tensors derive from a column-parallel
# output, which parameters meet them); an untraced one judges the modules inside a tensor-parallel block
# by their parameters' size (a head_dim-sized one is per head, a hidden-sized one reads the block's
# replicated input) and warns about the rest. A parameter read on both kinds of activations is refused:
# part of its gradient is partial and part is whole, which no single reduction fixes.]

def _tp_blocks(modules: Sequence[TPModule]) -> dict[str, str]:
    """Parent module path -> compute axis, for parents holding a column-parallel module and a row-parallel
    one: the blocks whose activations are sharded in between."""
    kinds: dict[str, dict[str, str]] = {}
    for m in modules:
        if m.kind != LINEAR or m.style not in ("colwise", "rowwise"):
            continue
        parent = m.path.rpartition(".")[0]
        kinds.setdefault(parent, {})[m.style] = m.axis
    return {p: k["colwise"] for p, k in kinds.items() if "colwise" in k and "rowwise" in k}


def _replicated_owners(module, modules: Sequence[TPModule], tracked: Mapping[str, str]):
    """(module path, module, [(attribute, plan name)]) of the non-tensor-parallel modules holding tracked
    (replicated, trainable) parameters directly."""
    tp_paths = {m.path for m in modules}
    for path, mod in module.named_modules():
        if path in tp_paths:
            continue
        own = [(attr, tracked[f"{path}.{attr}" if path else attr]) for attr, _ in mod.named_parameters(recurse=False)
               if (f"{path}.{attr}" if path else attr) in tracked]
        if own:
            yield path, mod, own


def assumed_partial_grads(module, modules: Sequence[TPModule], tracked: Mapping[str, str]
                          ) -> tuple[dict[str, str], list[str]]:
    """Without a trace: ({plan name: compute axis} of the replicated parameters taken to read sharded
    activations, [descriptions of the ones inside a tensor-parallel block that cannot be judged]).
    ``tracked``: every name (aliases too) of the replicated trainable parameters -> plan name."""
    blocks = _tp_blocks(modules)
    if not blocks:
        return {}, []
    mods = dict(module.named_modules())
    partial: dict[str, str] = {}
    unsure: list[str] = []
    for path, mod, own in _replicated_owners(module, modules, tracked):
        block = next((b for b in sorted(blocks, key=len, reverse=True) if path.startswith(b + ".") or
                      (b == "" and path)), None)
        if block is None:
            continue
        parent = mods[block]
        head_dim, _ = _head_dim(parent, getattr(parent, "config", None) or getattr(module, "config", None))
        widths = {mods[m.path].weight.shape[1] for m in modules
                  if m.path.rpartition(".")[0] == block and m.style == "colwise" and hasattr(mods[m.path], "weight")}
        shapes = [tuple(getattr(mod, attr).shape) for attr, _ in own]
        if all(len(s) == 1 and head_dim and s[0] == head_dim and s[0] not in widths for s in shapes):
            partial.update((name, blocks[block]) for _, name in own)   # per head: reads the heads this rank holds
        elif not all(len(s) == 1 and s[0] in widths for s in shapes):  # (hidden-sized: the block's replicated input)
            unsure.append(f"module {path!r} in block {block!r} ({', '.join(f'{n} {s}' for (_, n), s in zip(own, shapes))})")
    return partial, unsure


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)


class _Reads:
    """What :func:`trace_partial_grads` follows through one traced forward: which tensors are sharded over a
    compute axis, which were computed from replicated parameters alone, and which parameters met which."""

    def __init__(self, tracked: Mapping[int, str]):
        from torch.utils.weak import WeakIdKeyDictionary  # (the planner imports torch only when it traces)
        self.tracked = tracked
        self.sharded = WeakIdKeyDictionary()   # tensor -> compute axis: a colwise output, or computed from one
        self.derived = WeakIdKeyDictionary()   # tensor -> plan names of the parameters it was computed from alone
        self.partial: dict[str, tuple[str, str]] = {}  # name -> (axis, where)
        self.whole: dict[str, str] = {}                # name -> where it met replicated activations
        self.mixed: list = []                  # (axis, where, module): a replicated activation with a gradient met
        self.inside = 0                        # depth of tensor-parallel module calls (DTensor handles theirs)
        self.stack: list[str] = []             # the module calls the forward is in

    def read(self, func, args, kwargs, out) -> None:
        """One torch function call of the traced forward: ``func(*args, **kwargs)`` returned ``out``."""
        import torch
        from torch.utils._pytree import tree_leaves
        if self.inside:
            return
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        axes = sorted({self.sharded[t] for t in ins if t in self.sharded})
        params: set = set()
        other = False
        for t in ins:
            n = self.tracked.get(id(t))
            if n is not None:
                params.add(n)
            elif t in self.derived:
                params |= self.derived[t]
            elif isinstance(t, torch.nn.Parameter) and t not in self.sharded:
                pass  # one the plan sums nothing of: split with its heads (heads.py), frozen, an expert's
            elif t not in self.sharded:
                other = True
                if axes and t.requires_grad and not isinstance(t, torch.nn.Parameter) and not self.mixed:
                    self.mixed.append((axes[0], _name(func), self.stack[-1] if self.stack else ""))
        if not ins or (not axes and not params and other):
            return
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if axes:
            for n in params:
                self.partial.setdefault(n, (axes[0], _name(func)))
            for t in outs:
                self.sharded[t] = axes[0]
        elif other:
            for n in params:
                self.whole.setdefault(n, _name(func))
        else:
            for t in outs:
                self.derived[t] = frozenset(params) | self.derived.get(t, frozenset())

    def hooks(self, model, modules: Sequence[TPModule]) -> list:
        """Module hooks that keep the call stack and mark the column-parallel outputs; their handles."""
        import torch
        from torch.utils._pytree import tree_leaves

        def enter(_m, _a):
            self.inside += 1

        def leave(m):
            def hook(_m, _a, out):
                self.inside -= 1
                if m.style == "colwise":
                    for t in tree_leaves(out):
                        if isinstance(t, torch.Tensor):
                            self.sharded[t] = m.axis
            return hook

        def push(path):
            def hook(_m, _a):
                self.stack.append(path)
            return hook

        def pop(_m, _a, _out):
            if self.stack:
                self.stack.pop()

        mods = dict(model.named_modules())
        handles = []
        for path, mod in mods.items():
            handles.append(mod.register_forward_pre_hook(push(path or "<root>")))
            handles.append(mod.register_forward_hook(pop))
        for m in modules:
            handles.append(mods[m.path].register_forward_pre_hook(enter))
            handles.append(mods[m.path].register_forward_hook(leave(m)))
        return handles


def trace_partial_grads(model, modules: Sequence[TPModule], trace, tracked: Mapping[int, str]) -> dict[str, str]:
    """{plan name: compute axis} of the replicated parameters that the traced forward combines with
    activations computed from a column-parallel output (before its row-parallel sibling reduces them).
    ``tracked``: ``id(parameter)`` -> plan name of the replicated trainable parameters. A parameter read on
    both sharded and replicated activations raises :class:`PlanError`."""
    from torch.overrides import TorchFunctionMode
    reads = _Reads(tracked)

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            reads.read(func, args, kwargs, out)
            return out

    handles = []
    try:
        handles = reads.hooks(model, modules)
        with Reads():
            run_traced(model, trace, {}, grad=True)  # (with autograd: which activations take a gradient)
    finally:
        for h in handles:
            h.remove()
    partial, whole = reads.partial, reads.whole
    if reads.mixed:
        axis, where, path = reads.mixed[0]
        raise PlanError(
            f"the traced forward of module {path!r} combines (at {where}) activations sharded over compute axis "
            f"{axis!r} (computed from a column-parallel module's output) with a replicated activation that takes a "
            f"gradient (e.g. keys or values whose projection keeps {axis!r} out of its spec, read by sharded queries): "
            f"on each rank that activation's gradient would sum over this rank's heads only, a partial sum no "
            f"collective adds up, so the parameters and inputs behind it would train on a wrong gradient. Fix: shard "
            f"that projection over {axis!r} too (column-parallel, whole heads per rank), or keep {axis!r} out of the "
            f"specs of the column-parallel projection(s) it meets")
    both = sorted(set(partial) & set(whole))
    if both:
        n = both[0]
        raise PlanError(
            f"parameter {n!r} is replicated over compute axis {partial[n][0]!r} but the traced forward reads it both "
            f"on activations sharded over {partial[n][0]!r} (a column-parallel module's output, at {partial[n][1]}) "
            f"and on replicated ones (at {whole[n]}): its gradient would be partly a per-rank partial sum and partly "
            f"whole, which no single reduction makes right. Fix: give the two uses separate parameters (modules), or "
            f"keep {partial[n][0]!r} out of the specs of the column-parallel projection feeding it")
    return {n: a for n, (a, _) in partial.items()}


def partial_note(partial: Mapping[str, str], traced: bool, unsure: Sequence[str] = ()) -> str:
    """The plan's note on replicated parameters read on sharded activations."""
    names = sorted(partial)
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    how = "the traced forward reads them on" if traced else "by their size (head_dim) they read"
    return (f"{len(names)} replicated parameter(s) ({shown}): {how} activations sharded over "
            f"{sorted(set(partial.values()))} (between a column-parallel module and its row-parallel sibling), so "
            f"each rank's gradient is a partial sum: their buffers' gradients are all-reduced (summed) over it "
            f"before the reduction (all_reduce partial_grads)")


def unsure_warning(unsure: Sequence[str]) -> str:
    return (f"{len(unsure)} replicated parameter(s) sit inside tensor-parallel blocks (between a column-parallel "
            f"module and its row-parallel sibling): {'; '.join(unsure[:4])}{' ...' if len(unsure) > 4 else ''}. "
            f"Without trace= the planner assumes they read the block's replicated activations; one that reads the "
            f"column-parallel output (per-head features) would get a per-rank partial gradient. Plan with "
            f"trace=example inputs: the planner then follows the activations and sums such gradients over the "
            f"compute axis")
