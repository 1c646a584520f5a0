"""What must hold between a captured step's replays: recorded at the capture (``record``), compared before
each replay (``before_replay``), each refusal naming what changed and the fix: the gradients at the start,
Python-number hyper-parameters, what the step trains, the modules and their modes, gradient sync, what the
graph reads in place (inputs, shards, buffers), the state around the call; and the non-finite checks read
after each replay."""

from __future__ import annotations

import operator

import torch

from ...errors import CaptureError
from ..dtensor_params import plain
from ..seams import replaced_local
from .graph import Graph, Phase
from .session import arg_path

_GRAD = operator.attrgetter("grad")
_PTR = torch.Tensor.data_ptr
_RG = operator.attrgetter("requires_grad")
_TRAINING = operator.attrgetter("training")


def record(g: Graph) -> None:
    """At the capture, once it ran: what the replays will be checked against."""
    g.hyper, g.ambient = hyper(g), ambient()
    g.trained = trained(g)
    note_shards(g)
    g.left = [(r, r().stale, r().sync, mode(r())) for r in g.executors if r() is not None]
    for r in g.optimizers:
        opt = r()
        if opt is not None:  # loading a state dict replaces the state tensors (and a tensor lr) the graph reads:
            # capture again (the eager backend too, as its replays would be: the same bookkeeping)
            opt.register_load_state_dict_post_hook(lambda _o, _g=g: setattr(_g, "phase", Phase.STALE))


def before_replay(g: Graph) -> None:
    """Before a replay: the last replay's non-finite checks read, and everything the capture recorded compared."""
    read_checks(g)
    check_addresses(g)
    check_grads(g)
    check_hyper(g)
    check_trained(g)
    check_mode(g)
    check_sync(g)
    if g.ambient is not None and ambient() != g.ambient:
        raise CaptureError(ambient_changed(g.ambient, ambient()))


def local_params(g: Graph) -> list:
    out = []
    for r in g.executors:
        exe = r()
        if exe is not None and getattr(exe.face, "owns_locals", False):
            out += list(exe.local_params().values())
    return out


# [Note: gradients at the start of a replay] autograd adds a gradient to a .grad that exists and assigns one
# where .grad is None; the capture records whichever happened then, and every replay repeats it. A parameter
# without a gradient when the step was captured must be without one at every replay (zeroed with
# set_to_none, inside the step or between calls), or the eager step would add where the replay assigns.
def note_grads_at_start(g: Graph) -> None:
    g.grads_at_start = [p for p in local_params(g) if p.grad is None]


def check_grads(g: Graph) -> None:
    if g.grads_at_start and list(map(_GRAD, g.grads_at_start)).count(None) != len(g.grads_at_start):
        raise CaptureError("shardplan.capture: parameters have gradients in .grad that they did not have when the "
                           "step was captured: eagerly this step would add to them, the replay would not. Zero "
                           "them inside the step (optimizer.zero_grad() after optimizer.step()) or between calls")


# [Note: Python numbers in a captured step] a hyper-parameter held as a Python number (lr=3e-4) is baked into
# the graph when it is captured: a scheduler that changes it afterwards would be silently ignored by every
# replay. The numbers of every optimizer the step used are recorded at the capture and compared before each
# replay (a few per param group; tuples such as betas and flags such as maximize too: [Note: hyper-parameters
# a graph bakes in]); a tensor (lr=torch.tensor(3e-4, device="cuda")) is read by the graph in
# place, so it is recorded as the tensor itself: one assigned in its place (group["lr"] = 0.05, as a manual
# decay loop does) would leave every replay reading the old one, silently.
# An optimizer that steps on the host between the graph's segments (an offloaded one: [Note: a step in
# segments]) reads its param groups there at every replay, as eagerly: what its graph part bakes in instead
# is what its ``graph_constants()`` says (the clipping threshold, say), recorded and compared the same way.
def hyper(g: Graph) -> list:
    out = []
    for r in g.optimizers:
        opt = r()
        if opt is None:
            continue
        if hasattr(opt, "graph_constants"):
            out.append((r, [opt.graph_constants()], "{name}.{k}", ""))
        else:
            out.append((r, [{k: v for k, v in grp.items() if k != "params" and _hyper_value(v)}
                            for grp in opt.param_groups], "{name}.param_groups[{i}][{k!r}]",
                        "Hold it as a tensor on the device ({k}=torch.tensor({v!r}, device='cuda'), and "
                        "capturable=True), which schedulers update in place, or call step.reset() to capture "
                        "again"))
    return out


def check_hyper(g: Graph) -> None:
    for r, groups, where, advice in g.hyper:
        opt = r()
        if opt is None:
            continue
        nows = [opt.graph_constants()] if hasattr(opt, "graph_constants") else opt.param_groups
        for i, (grp, then) in enumerate(zip(nows, groups)):
            for k, v in then.items():
                now = grp.get(k)
                if _same_hyper(now, v):
                    continue
                at = where.format(name=type(opt).__name__, i=i, k=k)
                if _has_tensor(v):
                    raise CaptureError(
                        f"shardplan.capture: {at} was replaced (by {now!r}) since the step was captured, but the "
                        f"graph reads the tensor it was captured with. Update that tensor in place "
                        f"({k}.fill_(new), as schedulers and sp.optim.as_lr_scheduler do), or call "
                        f"step.reset() to capture again")
                if isinstance(v, (tuple, list)):
                    advice = ("Hold its numbers as tensors on the device ({k}=(torch.tensor(...), ...), where the "
                              "optimizer takes them) updated in place, or call step.reset() to capture again")
                elif isinstance(v, bool):
                    advice = ""
                raise CaptureError(  # (a tensor put where a number was captured too: the graph reads the number)
                    f"shardplan.capture: {at} changed from {v!r} to {now!r} since the step was captured, but as "
                    f"a Python value it is baked into the graph. "
                    + (advice.format(k=k, v=v) or "Call step.reset() to capture again with the new value"))


# [Note: what a step trains] a graph replays the gradients and the optimizer updates its capture recorded: a
# parameter frozen afterwards (``p.requires_grad_(False)``) would still be trained by every replay, one
# unfrozen not at all, and a param group added to the optimizer (progressive unfreezing) never stepped,
# where the eager step would do each. The parameters' ``requires_grad`` (the local ones and every one an
# optimizer steps) and the optimizers' param groups are recorded at the capture and compared before each
# replay; a change is refused naming the parameter.
def trained(g: Graph) -> tuple:
    names, params, seen = [], [], set()
    for r in g.executors:
        exe = r()
        if exe is not None and getattr(exe.face, "owns_locals", False):
            for name, p in exe.local_params().items():
                names.append(name); params.append(p); seen.add(id(p))  # noqa: E702
    groups = []
    for r in g.optimizers:
        opt = r()
        if opt is None:
            continue
        groups.append((r, list(opt.param_groups), [list(grp["params"]) for grp in opt.param_groups]))
        for i, grp in enumerate(opt.param_groups):
            for j, p in enumerate(grp["params"]):
                if id(p) not in seen:
                    names.append(f"{type(opt).__name__}.param_groups[{i}]['params'][{j}]")
                    params.append(p); seen.add(id(p))  # noqa: E702
    return names, params, list(map(_RG, params)), groups


def check_trained(g: Graph) -> None:
    if g.trained is None:
        return
    names, params, flags, groups = g.trained
    if list(map(_RG, params)) != flags:
        name, now = next((n, p.requires_grad) for n, p, f in zip(names, params, flags) if p.requires_grad != f)
        raise CaptureError(
            f"shardplan.capture: {name} has requires_grad={now} and had {not now} when the step was captured: "
            f"every replay {'trains' if not now else 'leaves'} it as the capture did. Freeze or unfreeze "
            f"parameters before the capture, or call step.reset() to capture again after changing them")
    for r, then, params in groups:
        opt = r()
        if opt is None:
            continue
        now = opt.param_groups
        if len(now) == len(then) and all(map(operator.is_, now, then)) and all(
                len(grp["params"]) == len(ps) and all(map(operator.is_, grp["params"], ps))
                for grp, ps in zip(now, params)):
            continue
        lens, nows = [len(ps) for ps in params], [len(grp["params"]) for grp in now]
        what = (f"{len(then)} groups of {lens} parameters then, {len(now)} of {nows} now" if lens != nows
                else "a parameter of a group replaced by another")
        raise CaptureError(
            f"shardplan.capture: {type(opt).__name__}'s param groups changed since the step was captured "
            f"({what}): every replay steps the parameters it was captured with. Call step.reset() to capture "
            f"again after add_param_group or a change of a group's parameters")


def check_mode(g: Graph) -> None:
    for r, _, _, mode in g.left:
        exe = r()
        if exe is None or mode is None:
            continue
        names, modules, flags, (paths, dicts, attrs, kids) = mode
        if not all(map(operator.is_, map(dict.get, dicts, attrs), kids)):  # (one dict read per module)
            path = next(p for p, d, a, c in zip(paths, dicts, attrs, kids) if d.get(a) is not c)
            root = type(exe.root()).__name__
            raise CaptureError(
                f"shardplan.capture: {root}.{path} is another module than when the step was captured (it was "
                f"replaced, or removed): every replay runs the one it was captured with. Call step.reset() to "
                f"capture again after replacing modules")
        if list(map(_TRAINING, modules)) == flags:
            continue
        # [Note: train and eval modes] a graph replays the mode it was captured in (dropout, batch-norm
        # statistics), every module's: a model left in the other (model.eval() for an evaluation, then no
        # model.train()), or one submodule switched (a batch norm frozen with .eval()), would train
        # differently from the eager step, silently. (A step that sets the mode itself runs no Python at a
        # replay: set it before the call.) One flag read per module.
        name, training = next((n, f) for n, m, f in zip(names, modules, flags) if m.training != f)
        now = "eval" if training else "training"
        root = type(exe.root()).__name__
        if not name:
            raise CaptureError(
                f"shardplan.capture: {root} is in {now} mode, the step was captured in "
                f"{'training' if training else 'eval'} mode, which every replay runs. Call "
                f"model.{'train' if training else 'eval'}() before the step (after an evaluation), or capture a "
                f"step for the other mode apart (sp.capture(eval_step))")
        raise CaptureError(
            f"shardplan.capture: {root}.{name} is in {now} mode, it was in {'training' if training else 'eval'} "
            f"mode when the step was captured, which every replay runs. Set it back ({root}.{name}."
            f"{'train' if training else 'eval'}()), or call step.reset() to capture again in the new modes")


# [Note: gradient sync around a replay] the graph reduces the gradients as the capture did: a call made under
# sp.no_sync (or the drop-in's set_requires_gradient_sync(False)) after a capture outside it would reduce
# and step anyway, and one outside it after a capture inside would not reduce, silently. Refused.
def check_sync(g: Graph) -> None:
    for r, _, sync, _ in g.left:
        exe = r()
        if exe is not None and exe.sync != sync:
            name = type(exe.root()).__name__ if exe.root() is not None else "the model"
            raise CaptureError(
                f"shardplan.capture: this call runs {'outside' if exe.sync else 'under'} sp.no_sync({name}), the "
                f"step was captured {'outside' if sync else 'under'} it: a replay reduces the gradients as the "
                f"capture did. Accumulate inside the step (micro-batches under sp.no_sync, the last one outside), "
                f"so that one call is one optimizer step, or call the step function itself for this call")


# [Note: what a replay reads in place] the graph reads its tensor inputs (donated ones are the caller's) and
# each local parameter's piece of its shard at the addresses they had when the step was captured: one list
# of addresses, compared before each replay. A donated input whose storage was replaced (``.data = new``, a
# resize) would be read in its old, freed memory; a replaced parameter (``p.data = new``) would train on its
# old values. On a mismatch the error names the input, or the parameter (the eager step's buffer walk,
# runtime/seams.py)
def note_shards(g: Graph) -> None:
    """Add the local parameters (known once the capture ran) to what the graph reads in place, and the
    models' buffers (compared as the module's attribute: one assigned anew is a new tensor)."""
    params = [t for t in map(plain, local_params(g)) if t.numel()]
    g.held += params
    g.paths += [None] * len(params)
    g.addresses += list(map(_PTR, params))
    g.buffers = [(name, mod, attr, t, t.data_ptr()) for name, mod, attr, t in buffers(g)]


def check_addresses(g: Graph) -> None:
    for name, mod, attr, t, ptr in g.buffers:
        now = mod._buffers.get(attr)
        if now is not t or t.data_ptr() != ptr:
            how = "removed" if now is None else "replaced"
            raise CaptureError(f"shardplan.capture: the buffer {name} was {how} since the step was captured: the "
                               f"replay reads the one it was captured with, in place. Change buffers' values in "
                               f"place ({attr}.copy_(new)), or call step.reset() to capture again")
    if list(map(_PTR, g.held)) == g.addresses:
        return
    path = next(p for t, a, p in zip(g.held, g.addresses, g.paths) if t.data_ptr() != a)
    if path is not None:
        raise CaptureError(f"shardplan.capture: the input at {arg_path(path)} no longer has the storage the step was "
                           f"captured with (its .data was replaced, or it was resized): the replay reads that "
                           f"memory in place. Change donated tensors' values in place (copy_), or call "
                           f"step.reset() to capture again")
    for r in g.executors:
        exe = r()
        if exe is not None and getattr(exe.face, "owns_locals", False):
            why = replaced_local(exe.buffer.values())
            if why:
                raise CaptureError(f"{why} (the captured step reads the shards it was captured with: "
                                   f"capture again after replacing parameters)")
    raise CaptureError("shardplan.capture: a local parameter's storage moved since the step was captured (its "
                       "shard was reallocated): the replay reads the old address. Capture again (step.reset())")


def copy_checks(g: Graph) -> None:
    """After a replay: the non-finite checks' indices to pinned host memory, without waiting."""
    if not g.checks:
        return
    idx = torch.stack([i.to(torch.int64) for _, _, i in g.checks])
    host = torch.empty(idx.shape, dtype=torch.int64, pin_memory=True)
    host.copy_(idx, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    g.checked = (host, ev)


def read_checks(g: Graph) -> None:
    """Raise for what the last replay's non-finite checks found (the step before this call), naming the
    parameter as the eager check does."""
    if g.checked is None:
        return
    host, ev = g.checked
    g.checked = None
    ev.synchronize()
    for (buffer, kind, _), k in zip(g.checks, host.tolist()):
        buffer.raise_non_finite(kind, k)


# [Note: hyper-parameters a graph bakes in] a torch optimizer's group values reach its kernels as Python numbers
# (baked into the graph at the capture) or as tensors (read in place at every replay): numbers, flags and tuples
# of them (``betas``: a beta2 schedule sets a new tuple; ``maximize``, ``amsgrad``) are recorded at the capture
# and compared before every replay, tensors by identity (one replaced is not the one the graph reads).
def _hyper_value(v) -> bool:
    if isinstance(v, (tuple, list)):
        return bool(v) and all(_hyper_value(x) for x in v)
    return isinstance(v, (int, float, bool, torch.Tensor))


def _has_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and any(map(_has_tensor, v)))


def _same_hyper(now, then) -> bool:
    if isinstance(then, torch.Tensor) or isinstance(now, torch.Tensor):
        return now is then
    if isinstance(then, (tuple, list)):
        return (isinstance(now, (tuple, list)) and len(now) == len(then)
                and all(map(_same_hyper, now, then)))
    return bool(now == then)


# [Note: the state around a call] what a caller's context sets for the step's torch calls is baked into the
# graph as the capture saw it: gradient mode (a replay under torch.no_grad() still runs its backward and
# optimizer step; eagerly, backward would raise) and autocast entered around the call (a replay computes in the
# capture's dtypes, eagerly the step would follow the new context). Recorded at the capture, compared before
# each replay; a call in another context is refused.
_AUTOCAST = ("cuda", "cpu")


def ambient() -> tuple:
    # (an autocast's dtype only where it is on: a disabled one's default dtype changes nothing the step runs)
    return (torch.is_grad_enabled(),) + tuple((e, torch.get_autocast_dtype(d) if e else None)
                                               for d in _AUTOCAST for e in (torch.is_autocast_enabled(d),))


def ambient_changed(then: tuple, now: tuple) -> str:
    parts = []
    if then[0] != now[0]:
        parts.append(f"gradients {'enabled' if now[0] else 'disabled (torch.no_grad())'} around this call, "
                     f"{'enabled' if then[0] else 'disabled'} around the capture")
    for d, (te, td), (ne, nd) in zip(_AUTOCAST, then[1:], now[1:]):
        if (te, td) != (ne, nd):
            what = lambda e, t: f"autocast({d!r}, dtype={t})" if e else f"no {d} autocast"  # noqa: E731
            parts.append(f"{what(ne, nd)} around this call, {what(te, td)} around the capture")
    return (f"shardplan.capture: {'; '.join(parts)}: a replay runs the step as it was captured in its context. "
            f"Call it in the same context, enter autocast (or no_grad) inside the step function, or capture a step "
            f"for the other context apart")


def buffers(g: Graph) -> list:
    """(name, module, attribute, tensor) of every buffer of the modules the step's executors run."""
    roots = {id(m): m for m in (r().root() for r in g.executors if r() is not None) if m is not None}
    return [(f"{type(root).__name__}.{name}", mod, attr, t)
            for root in roots.values() for name, mod in root.named_modules()
            for attr, t in mod._buffers.items() if t is not None
            for name in (f"{name}.{attr}" if name else attr,)]


def check_buffers_kept(before: list) -> None:
    """At the capture: a buffer the step itself assigns anew (``self.x = self.x * 2`` in a forward) would be read by
    every replay where the capture found it (memory the module no longer holds), not the one the step made."""
    for name, mod, attr, t in before:
        if mod._buffers.get(attr) is not t:
            raise CaptureError(f"shardplan.capture: the step assigns the buffer {name} anew (a module attribute set to "
                               f"a new tensor): a replay would read the tensor the capture started from, not the one "
                               f"the step made. Update it in place ({attr}.copy_(new), {attr}.mul_(...)), or keep it "
                               f"out of the captured step")


def mode(exe):
    """The training flags of the modules an executor runs, with their names (``None``: no module, the
    functional face)."""
    root = exe.root()
    if root is None:
        return None
    names, modules = zip(*root.named_modules())
    children = [(f"{prefix}.{n}" if prefix else n, m._modules, n, c)
                for prefix, m in zip(names, modules) for n, c in m._modules.items()]
    return list(names), list(modules), list(map(_TRAINING, modules)), tuple(map(list, zip(*children))) or ([],) * 4
