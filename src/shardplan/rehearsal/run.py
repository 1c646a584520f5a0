"""``shardplan.rehearse``: one rank of an N-rank plan, trained for a few steps on this machine."""

from __future__ import annotations

import contextlib
import os
import statistics
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from ..step_call import checkpoint_units, scalar_of, token_inputs, undo_checkpoint, unit_entries
from ..errors import RehearsalError, ShardingError
from ..planner import Plan
from ..planner.render import fmt_bytes
from ..planner.schedule import ROOT
from ..forecast.network import Network
from ..runtime import collectives as C
from ..runtime import emulated_time as ET
from . import captured as CAP
from . import timed as TIMED
from .host import _host_rss, _reset_host_peak, fix_host_allocator
from .init import RehearsalInit, _fill_meta_buffers
from .result import Rehearsal, UnitTime
from .timing import Clock, UnitTimer, unit_times
from ..runtime.api import compile_units, engine_of, memory_stats, reset_peak, shard
from ..runtime.offload_optim import offload_optimizer
from ..units import trace_args
from ..metatrace import training_call

START_UP_NOTE = ("start-up checked this rank only: the cross-rank exchange (plans and parameter values equal on "
                 "every rank) is skipped in a rehearsal")


def device_capacity(device: torch.device) -> tuple[int, str]:
    """(bytes free for this process, what they are) on ``device``."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, f"{device} ({torch.cuda.get_device_name(device)}) has {fmt_bytes(free)} free"
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 1 << 62, "the host"
    return free, f"the host has {fmt_bytes(free)} of memory available"


def check(plan: Plan, rank: int, world: Optional[int], device: torch.device, checkpoint: bool,
          capacity: Optional[int] = None) -> None:
    """Refuse, in one line naming the fix, what cannot be rehearsed here: a rank outside the mesh, a world
    that is not the mesh's, a rank whose planned peak exceeds the device. Tensor-parallel plans rehearse too:
    their DTensor collectives run on the fake process group like the others."""
    n = plan.mesh.size
    if world is not None and world != n:
        raise RehearsalError(f"the plan's mesh {plan.mesh!r} has {n} ranks but world={world} was asked for; plan "
                             f"again with a mesh whose axis sizes multiply to {world}, or rehearse world={n}")
    if not isinstance(rank, int) or not 0 <= rank < n:
        raise RehearsalError(f"rank {rank!r} is outside the plan's {n} ranks (mesh {plan.mesh!r}); pick a rank in "
                             f"0..{n - 1}")
    peak = plan.memory(rank, recompute=checkpoint).peak
    if capacity is None:
        capacity, where = device_capacity(device)
    else:
        where = f"{device} has {fmt_bytes(capacity)}"
    if peak > capacity:
        acts = plan.memory(rank, recompute=checkpoint).activations
        fixes = "shard over more ranks (a larger mesh), a higher strategy (optim_grads_params)"
        if acts:
            fixes += ", a smaller batch" + ("" if checkpoint else ", activation checkpointing (checkpoint=True / --checkpoint)")
        raise RehearsalError(f"rank {rank} of {plan.mesh!r} needs {fmt_bytes(peak)} at its planned peak but {where}: "
                             f"the model does not fit this device even for one rank; {fixes}")


def _vocab(model: nn.Module) -> int:
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else 2


def position_limit(model: nn.Module) -> Optional[tuple[int, str]]:
    """``(positions, where)`` when ``model`` looks its positions up in a table (GPT-2's ``wpe``, a learned
    ``pos_embeddings``): an ``nn.Embedding`` named for positions, or one whose size is the config's
    ``max_position_embeddings`` / ``n_positions`` / ``max_seq`` / ``block_size``. Rotary and relative
    positions (Llama, T5) have no table: ``None``."""
    cfg = getattr(model, "config", None)
    sizes = {}
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len", "max_seq", "block_size"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int) and v > 0:
            sizes.setdefault(v, attr)
    for path, m in model.named_modules():
        if not isinstance(m, nn.Embedding):
            continue
        leaf = path.rsplit(".", 1)[-1].lower()
        named = leaf in ("wpe", "pos_emb") or "pos" in leaf
        if named or (m.num_embeddings in sizes and leaf not in ("wte", "embed_tokens", "tok_embeddings")):
            via = f"; config.{sizes[m.num_embeddings]} = {m.num_embeddings}" if m.num_embeddings in sizes else ""
            return m.num_embeddings, f"{path}: nn.Embedding({m.num_embeddings}, {m.embedding_dim}){via}"
    return None


@contextlib.contextmanager
def fake_world(rank: int, world: int, network=None):
    """This process as rank ``rank`` of ``world`` ranks whose collectives are local stand-ins (under ``network``:
    the emulated backend's, timed by it)."""
    C.start_rehearsal(rank, world, network)
    try:
        yield
    finally:
        C.end_rehearsal()


def _default_optimizer(params, device: torch.device) -> torch.optim.Optimizer:
    params = list(params)
    try:  # fused: no foreach temporaries (the plan counts 2 fp32 states per element, nothing more)
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(params, lr=1e-4, foreach=False)


def rehearse(model_fn: Callable[[], nn.Module], plan: Plan, *, rank: int = 0, batch: Union[tuple[int, int], Sequence[int]],
             steps: int = 3, checkpoint: bool = False, world: Optional[int] = None,
             init_fn: Optional[Callable[[nn.Module], None]] = None,
             optimizer_fn: Optional[Callable[..., torch.optim.Optimizer]] = None,
             inputs_fn: Optional[Callable[[nn.Module, torch.Tensor], object]] = None,
             device_memory: Optional[int] = None, capture: bool = False,
             network: Union[str, dict, Network, None] = None, trace: Optional[str] = None,
             compile: bool = False) -> Rehearsal:
    """Run ``steps`` training steps of ``rank`` of ``plan`` on this process's device (a GPU if there is one)
    and measure them; every collective is a local stand-in of the right shape and dtype (torch's fake
    process group), so one GPU (or a CPU) plays one rank of an N-rank job.

    >>> plan = sp.plan(model_on_meta, rules, sp.Mesh(dp=64), units=[r"layers\\.\\d+"], compute_dtype="bf16",
    ...                trace=sp.step_call.token_inputs(model_on_meta, torch.zeros(1, 4096, dtype=torch.long, device="meta")))
    >>> r = sp.rehearse(lambda: gpt.build("70B"), plan, rank=0, batch=(1, 4096), steps=3, checkpoint=True)
    >>> print(r)            # per step: time and peak memory, measured and planned; per unit: compute time

    ``model_fn()`` builds the model (called under ``torch.device("meta")``: only this rank's shards are
    ever materialised, one unit at a time, each module by ``init_fn``, else a Hugging Face model's own
    ``_init_weights``, else its ``reset_parameters``, else a generic init: :class:`RehearsalInit`, which the
    notes report). ``batch``'s T must fit a table of positions the model has (:func:`position_limit`). Each step
    feeds ``batch = (B, T)`` random tokens (``inputs_fn(model, tokens)`` gives the model's arguments
    otherwise: see :func:`shardplan.step_call.token_inputs`), differentiates
    :func:`shardplan.step_call.scalar_of` of the output, and steps ``optimizer_fn(params)`` (AdamW;
    ``shardplan.offload_optimizer`` for a plan with CPU offload). ``host_peak`` reports the process's RSS
    growth (on a CPU, after fixing glibc's mmap threshold: :func:`fix_host_allocator`).
    ``checkpoint=True`` checkpoints every unit (activation checkpointing); compare with
    ``plan.memory(rank, recompute=True)``. ``capture=True`` rehearses the captured step
    (:func:`shardplan.capture`; :mod:`shardplan.rehearsal.captured`): two eager steps and the capture, then
    ``steps`` replays, timed; per-unit times are not measured (one graph), the host time per replay is.
    ``network`` (a preset name, a dict, a JSON file, a ``Network``) times every collective by that network
    model on the emulated backend (docs/emulated.md) and adds :class:`NetworkTiming` (``r.network``): exposed
    communication, overlap, tokens/s and MFU, all EMULATED (:mod:`shardplan.rehearsal.timed` says how they are
    measured); ``trace`` writes one such step as a Chrome trace. ``compile=True`` compiles each unit's forward
    (:func:`shardplan.compile_units`, torchtitan's per-block compile). Must run in a process without a process group.
    """
    b, t = _check_batch(batch, steps)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    check(plan, rank, world, device, checkpoint, device_memory)
    if capture:
        CAP.check(plan)
    net = TIMED.check(plan, network, trace)
    notes = [START_UP_NOTE]
    if plan.activations is None:
        notes.append("the plan was not traced: its peak counts model states only (plan with trace=example inputs, "
                     "CLI --trace-tokens, to count activations)")
    # [Note: host memory] the process's RSS before the model exists is the baseline; its high-water mark is
    # reset here, so ``host_peak`` is what start-up and the steps added: this rank's shards, one gathered unit
    # at a time, the optimizer states, the activations (on a CPU), and what the allocators keep
    if device.type == "cpu":
        fixed = fix_host_allocator()
        if fixed:
            notes.append(fixed)
    host_base = _host_rss()
    host_measured = host_base is not None and _reset_host_peak()
    with fake_world(rank, plan.mesh.size, net):
        model, opt = _start_up(model_fn, plan, (b, t), device, init_fn, optimizer_fn, notes, capture)
        if compile:
            compile_units(model)
            notes.append("each unit's forward compiled (shardplan.compile_units); the first steps include compiling")
        run = _Steps(model, plan, rank, (b, t), device, checkpoint, inputs_fn)
        if net is not None:
            run.net = TIMED.Under(net, model_fn, (b, t), plan, trace)
        note = run.measure(opt, steps, host_base if host_measured else None, capture)
        if note:
            notes.append(note)
    return _result(run, plan, rank, device, (b, t), checkpoint, capture, notes, host_base if host_measured else None)


def _result(run: "_Steps", plan: Plan, rank: int, device: torch.device, batch: tuple[int, int], checkpoint: bool,
            capture: bool, notes: list, host_base: Optional[int]) -> Rehearsal:
    """The :class:`Rehearsal` of the measured steps ``run``."""
    mem = plan.memory(rank, recompute=checkpoint)
    steps = len(run.step_s)
    # step 0 creates the optimizer state (a captured rehearsal shows replays only)
    measured_from = slice(1, None) if steps > 1 and not capture else slice(0, None)
    measured = max(run.peaks[measured_from]) if run.peaks else None
    kept = [u for u in run.per_unit[measured_from] if u is not None]
    unit_list = [ROOT] + run.units
    times = tuple(UnitTime(u, statistics.median(k[u][0] for k in kept), statistics.median(k[u][1] for k in kept))
                  for u in unit_list) if kept else ()
    if device.type != "cuda":
        notes.append("peak device memory is not measured on the CPU; the parameters and gradients the runtime held "
                     "are compared with the plan instead")
    peaks = run.peaks
    return Rehearsal(
        rank=rank, world=plan.mesh.size, mesh=repr(plan.mesh), device=_device_name(device), batch=batch,
        checkpoint=checkpoint, plan_fingerprint=plan.fingerprint(), step_s=tuple(run.step_s), measured_peak=measured,
        measured_peaks=tuple(peaks), peak_source="torch.cuda.max_memory_allocated" if peaks else "CPU",
        planned_peak=mem.peak, planned_states_peak=mem.states_peak, planned_activations=mem.activations,
        activation_inputs=plan.activations.inputs if plan.activations is not None else "",
        states_peak_measured=run.states, states_peak_planned=mem.states_peak - mem.optimizer, units=times,
        host_s_per_unit=statistics.median(run.host_s[measured_from]) / max(len(unit_list), 1),
        optimizer_s=statistics.median(run.opt_s[measured_from]), notes=tuple(notes), library_workspace=run.workspace,
        host_peak=run.host_peak, host_baseline=host_base, captured=capture,
        network=run.timing)


def _check_batch(batch, steps: int) -> tuple[int, int]:
    b, t = (int(x) for x in batch)
    if b <= 0 or t <= 0:
        raise RehearsalError(f"batch {tuple(batch)}: expected (B, T) tokens per rank with positive integers, e.g. (1, 4096)")
    if steps < 1:
        raise RehearsalError(f"steps={steps}: rehearse at least one step")
    return b, t


def _start_up(model_fn: Callable[[], nn.Module], plan: Plan, batch: tuple[int, int], device: torch.device,
              init_fn, optimizer_fn, notes: list[str], capture: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model built on meta, checked against ``batch``'s length, sharded (meta start-up), its meta buffers
    filled, and its optimizer; ``notes`` gains how it was initialised."""
    b, t = batch
    with torch.device("meta"):
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise RehearsalError(f"model_fn returned {type(model).__name__}, not an nn.Module")
    limit = position_limit(model)
    if limit is not None and t > limit[0]:
        raise RehearsalError(f"batch {b}x{t}: {t} tokens per sequence, but {type(model).__name__} has {limit[0]} "
                             f"positions ({limit[1]}); rehearse with at most {limit[0]} tokens, e.g. "
                             f"--batch {b}x{limit[0]}")
    model.train()
    how = RehearsalInit(model, init_fn)
    shard(model, plan, init_fn=how)
    notes.append(how.describe())
    filled = _fill_meta_buffers(model, device)
    if filled:
        notes.append(f"{len(filled)} buffer(s) built on the meta device were filled with ones "
                     f"({', '.join(filled[:3])}{' ...' if len(filled) > 3 else ''})")
    if optimizer_fn is not None:
        opt = optimizer_fn(model.parameters())
    elif plan.offload:  # host master shards and moments: the offloading AdamW steps them (captured too: the
        opt = offload_optimizer(model, lr=1e-4)  # host step between the graph's segments)
    elif capture and device.type == "cuda":  # on a CPU the captured step runs eagerly: the default optimizer
        opt = CAP.capturable_optimizer(model.parameters(), device)
    else:
        opt = _default_optimizer(model.parameters(), device)
    return model, opt


class _Steps:
    """The measured steps of a sharded model: per step its time, the optimizer's, the hooks' host time, each
    unit's forward and backward time and (on a GPU) the peak memory; after them the model states' peak, the
    host's (its RSS high-water mark over ``host_base``, when measured) and the libraries' workspace."""

    def __init__(self, model: nn.Module, plan: Plan, rank: int, batch: tuple[int, int], device: torch.device,
                 checkpoint: bool, inputs_fn):
        self.model, self.plan, self.rank, self.batch, self.device = model, plan, rank, batch, device
        self.checkpoint, self.inputs_fn = checkpoint, inputs_fn
        self.units = [u.name for u in plan.units if u.name != ROOT]
        self.step_s: list = []
        self.peaks: list = []
        self.per_unit: list = []
        self.opt_s: list = []
        self.host_s: list = []
        self.states = self.workspace = self.host_peak = None
        self.net: Optional[TIMED.Under] = None  # rehearse(network=...): what to time the steps by
        self.timing = None

    def measure(self, opt, steps: int, host_base: Optional[int], capture: bool = False) -> Optional[str]:
        """Run and measure ``steps`` steps (``capture``: replays of the captured step; returns its note)."""
        model, plan, device = self.model, self.plan, self.device
        entries = unit_entries(model, [(u.name, u.module_paths) for u in plan.units if u.name != ROOT])
        undo = checkpoint_units(model, entries) if self.checkpoint else []
        gen = torch.Generator(device="cpu").manual_seed(self.rank)
        vocab = _vocab(model)
        timer = None
        note = None
        try:
            ET.reset_ledger()
            if capture:
                note = self._replays(opt, steps, gen, vocab)
            else:
                clock = Clock(device)
                timer = UnitTimer(model, entries, clock)
                self._eager(opt, steps, gen, vocab, clock, timer)
                if self.net is not None:
                    timer.remove()
                    timer = None
                    self.timing = self.net.eager(self, opt, steps, lambda i: self._call(gen, vocab), entries)
            self.states = memory_stats(model)["peak"]
            self.host_peak = _host_rss("VmHWM") - host_base if host_base is not None else None
            self.workspace = _library_workspace(device)
        finally:
            if timer is not None:
                timer.remove()
            undo_checkpoint(undo)
        return note

    def _call(self, gen, vocab):
        b, t = self.batch
        tokens = torch.randint(0, vocab, (b, t), generator=gen).to(self.device)
        return _as_call(self.model, self.inputs_fn(self.model, tokens) if self.inputs_fn else
                        token_inputs(self.model, tokens))

    def _eager(self, opt, steps: int, gen, vocab: int, clock: Clock, timer: UnitTimer) -> None:
        model, device = self.model, self.device
        exe = engine_of(model)
        for i in range(steps):
            args, kwargs = self._call(gen, vocab)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            if i == min(1, steps - 1):
                reset_peak(model)
            hooks0 = exe.hook_seconds
            timer.in_backward = False
            clock.mark("step0")
            loss = scalar_of(model(*args, **kwargs))
            clock.mark("forward1")
            timer.in_backward = True
            loss.backward()
            clock.mark("backward1")
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
            clock.mark("step1")
            marks = clock.read()
            self.host_s.append(exe.hook_seconds - hooks0)
            self.step_s.append(marks["step1"])
            self.opt_s.append(marks["step1"] - marks["backward1"])
            self.per_unit.append(unit_times(marks, self.units, ROOT))
            if device.type == "cuda":
                self.peaks.append(int(torch.cuda.max_memory_allocated(device)))

    def _replays(self, opt, steps: int, gen, vocab: int) -> str:
        """The captured step (rehearsal/captured.py): warm-up and capture unmeasured, then ``steps`` replays."""
        if steps > 1:
            reset_peak(self.model)
        batch_fn = (lambda i: self._call(gen, vocab)) if self.net is None else self.net.ledger_of_step(1, lambda i: self._call(gen, vocab))
        replays = CAP.run(self.model, opt, batch_fn, steps, self.device)
        if self.net is not None:
            self.timing = self.net.captured(self, list(replays.step_s), lambda: CAP.run(self.model, opt, lambda i: self._call(gen, vocab), steps, self.device).step_s)
        self.step_s, self.peaks = list(replays.step_s), list(replays.peaks)
        self.host_s, self.opt_s = [replays.host_s_per_replay] * steps, [0.0] * steps
        self.per_unit = [None] * steps
        return (f"captured step ({replays.backend}): {CAP.WARMUP} eager steps and the capture ran first (not shown); "
                f"the steps shown are replays; per-unit and optimizer times are not measured inside one graph; host "
                f"time per replay {replays.host_s_per_replay * 1e3:.3f} ms")


def _library_workspace(device: torch.device) -> Optional[int]:
    """Bytes the CUDA libraries' workspaces hold (cuBLAS: one per thread and stream, from the caching
    allocator), measured by releasing them; ``None`` on a CPU or where torch cannot release them."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if device.type != "cuda" or clear is None:
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    clear()
    return max(0, before - torch.cuda.memory_allocated(device))


def _as_call(model: nn.Module, inputs) -> tuple[tuple, dict]:
    """The step's call, as the plan's trace makes it (``use_cache=False`` where the forward takes it: see
    :mod:`shardplan.metatrace`; a cache would be appended to twice under ``checkpoint=True``)."""
    try:
        return training_call(model, *trace_args(inputs), where="the rehearsal's step")
    except ShardingError as exc:
        raise RehearsalError(str(exc)) from None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"
