"""What a training log reports: FLOPs (a formula, or counted by torch's ``FlopCounterMode``), MFU and TFLOP/s,
throughput and ETA, peak memory (and its fraction of the device), and one logger that writes lines (or a
progress bar on a terminal) and hands every logged step to sinks: JSON lines, TensorBoard, Weights & Biases,
MLflow, or your own.

>>> fpt = sp.metrics.flops_per_token(model, seq=2048, layers=16, dim=2048)   # before sp.shard: full shapes
>>> meter = sp.metrics.Meter(tokens_per_step=batch * seq, devices=world, flops_per_token=fpt,
...                          peak_tflops=sp.metrics.peak_tflops(), total_steps=steps)
>>> log = sp.metrics.TrainLog(total_steps=steps, rank=rank, metrics_path="out.jsonl",
...                           sinks=[sp.metrics.WandbSink(project="gpt")])
>>> log.log(step, loss=2.3, lr=3e-4, **meter.update(step), **sp.metrics.memory(plan, rank))   # step: 1, 2, ...

Steps are numbered from 1 (the number of optimizer steps done), as torchtitan's logs are. Nothing here
talks to other ranks: the caller reduces the loss. torch, tqdm, rich, tensorboard, wandb and mlflow are
imported only when used (all optional: ``pip install shardplan[train]``, ``shardplan[wandb]``,
``shardplan[mlflow]``). docs/metrics.md shows every field and sink.
"""

from __future__ import annotations

import math
import re
import sys
import time
from typing import IO, TYPE_CHECKING, Optional

from .errors import ShardingError
# [Note: the profilers and the sinks live in metrics_profile.py and metrics_sinks.py; ``sp.metrics`` names them
# here, as it always has (``__all__`` is the module's surface, the page docs/api.md renders)]
from .metrics_profile import MemorySnapshot, StepProfiler, parse_steps
from .metrics_sinks import JsonLinesSink, MLflowSink, Sink, TensorBoardSink, WandbSink, _jsonable, sink_available

__all__ = ["PEAK_BF16_TFLOPS", "peak_tflops", "peak_of_name", "flops_per_token", "peak_memory_gib", "memory_fraction",
           "memory", "count_flops", "Meter", "format_line", "parse_steps", "StepProfiler", "MemorySnapshot", "Sink",
           "JsonLinesSink", "TensorBoardSink", "sink_available", "WandbSink", "MLflowSink", "TrainLog"]

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

# bf16 dense tensor-core peaks (no sparsity), TFLOP/s per device, from the vendors' data sheets; the first
# pattern that matches torch.cuda.get_device_name() wins, so specific variants come before their family
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"GB200", 2500.0),
    (r"B200", 2250.0),
    (r"B100", 1750.0),
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"H200|H100|H800|GH200", 989.0),
    (r"H20\b", 148.0),
    (r"A100|A800", 312.0),
    (r"A10G", 70.0),
    (r"A10\b", 125.0),
    (r"L40S", 362.0),
    (r"L40\b", 181.0),
    (r"L4\b", 121.0),
    (r"RTX 6000 Ada", 364.0),
    (r"RTX 4090", 165.0),
    (r"RTX 3090", 71.0),
    (r"MI325X|MI300X", 1307.0),
    (r"MI250X", 383.0),
)


def peak_tflops(device: Optional[torch.device] = None) -> Optional[float]:
    """The device's bf16 dense peak in TFLOP/s from :data:`PEAK_BF16_TFLOPS`; ``None`` on a CPU or an
    unknown device (MFU is then reported as n/a; pass the peak yourself, e.g. ``--peak-tflops``)."""
    import torch
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    return peak_of_name(torch.cuda.get_device_name(device))


def peak_of_name(name: str) -> Optional[float]:
    """``peak_of_name("NVIDIA H100 80GB HBM3") == 989.0``; ``None`` for a name not in the table."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, name):
            return tflops
    return None


def flops_per_token(model: nn.Module, seq: int = 0, *, layers: int = 0, dim: int = 0) -> float:
    """Training FLOPs (forward + backward) per token: 6 x the weights of the model's ``nn.Linear`` layers
    (each multiplies every token once; embedding look-ups are free) plus ``12 x layers x dim x seq`` for the
    attention scores and values (PaLM, appendix B; the causal mask is not discounted, as torchtitan and
    nanoGPT count). Call it on the unsharded model (any device, ``meta`` too): after ``sp.shard`` the
    parameters are local shards.

    >>> sp.metrics.flops_per_token(model, seq=2048, layers=16, dim=2048)
    """
    import torch
    import torch.nn as nn
    seen, weights = set(), 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, nn.Linear) and isinstance(w, torch.Tensor) and id(m) not in seen:
            seen.add(id(m))
            weights += w.numel()
    return 6.0 * weights + 12.0 * layers * dim * seq


def peak_memory_gib(plan=None, rank: int = 0, device: Optional[torch.device] = None) -> tuple[float, str]:
    """``(GiB, source)``: on a GPU the most this process allocated (``torch.cuda.max_memory_allocated``,
    source ``"cuda"``); elsewhere the plan's peak for ``rank`` (``plan.memory(rank).peak``, source
    ``"plan"``: parameters, gradients, optimizer state and gathered buffers, no activations)."""
    import torch
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**30, "cuda"
    if plan is not None:
        return plan.memory(rank).peak / 2**30, "plan"
    return float("nan"), "n/a"


def memory_fraction(device: Optional[torch.device] = None) -> Optional[float]:
    """The peak memory this process took from the device (``torch.cuda.max_memory_reserved``: what the
    caching allocator holds, the figure an out-of-memory error is about) as a fraction of the device's
    total memory; ``None`` on a CPU."""
    import torch
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    return torch.cuda.max_memory_reserved(device) / torch.cuda.get_device_properties(device).total_memory


def memory(plan=None, rank: int = 0, device: Optional[torch.device] = None) -> dict:
    """The log's memory fields: ``mem_gib`` and ``mem_source`` (:func:`peak_memory_gib`) and ``mem_frac``
    (:func:`memory_fraction`; ``None`` on a CPU).

    >>> log.log(step, loss=loss, **sp.metrics.memory(plan, rank))
    """
    gib, source = peak_memory_gib(plan, rank, device)
    return {"mem_gib": gib, "mem_source": source, "mem_frac": memory_fraction(device)}


def count_flops(fn, *args, **kwargs) -> tuple:
    """``(fn(*args, **kwargs), flops)``: the floating-point operations ``fn`` ran on this process, counted
    op by op by ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions, attention; a backward
    inside ``fn`` counts too). For models the formula of :func:`flops_per_token` does not describe (mixtures
    of experts, convolutions, other attention): count one training step and divide by its tokens.

    >>> _, flops = sp.metrics.count_flops(lambda: model(x, y).backward())
    >>> fpt = flops / x.numel()            # this rank's FLOPs per token (sum over ranks for the run's)
    """
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False, custom_mapping=_cpu_attention_formulas())
    with counter:
        out = fn(*args, **kwargs)
    return out, counter.get_total_flops()


def _cpu_attention_formulas() -> dict:
    """FLOP formulas for the CPU kernels of ``scaled_dot_product_attention``, which torch's counter has none
    for (it counts the CUDA ones): the same counts as its flash-attention formulas, so a CPU step counts what
    a GPU step (and the meta device) does. Passed through ``FlopCounterMode(custom_mapping=...)``."""
    import torch
    from torch.utils import flop_counter as fc
    aten = torch.ops.aten
    out = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        def forward(query, key, value, *args, out_shape=None, **kwargs):
            return fc.sdpa_flop_count(query, key, value)

        def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
            return fc.sdpa_backward_flop_count(grad_out, query, key, value)

        out[aten._scaled_dot_product_flash_attention_for_cpu] = forward
        if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
            out[aten._scaled_dot_product_flash_attention_for_cpu_backward] = backward
    return out


class Meter:
    """Throughput, TFLOP/s, MFU and ETA from the wall time between logged steps (so that unlogged steps need no
    device sync). Call :meth:`update` at each logged step with the number of steps done (1 after the first),
    after something synchronised the device (reading the loss does).

    >>> meter = Meter(tokens_per_step=8 * 64, devices=2, flops_per_token=fpt, peak_tflops=None, total_steps=40)
    >>> meter.update(step)   # {"step_time_s", "tokens_per_s", "tokens_per_s_per_device", "tflops", "mfu", "eta_s"}

    ``tflops`` is the achieved TFLOP/s per device (``flops_per_token`` x tokens/s / devices), ``mfu`` that
    over ``peak_tflops``; both ``None`` without the FLOPs (or the peak).
    """

    def __init__(self, tokens_per_step: int, devices: int, *, flops_per_token: Optional[float] = None,
                 peak_tflops: Optional[float] = None, total_steps: Optional[int] = None, start_step: int = 0,
                 clock=time.perf_counter):
        self.tokens_per_step, self.devices = tokens_per_step, devices
        self.flops_per_token, self.peak_tflops, self.total_steps = flops_per_token, peak_tflops, total_steps
        self.clock = clock
        self.last_step, self.last_time = start_step, clock()
        self.windows = 0
        self.steady_time, self.steady_steps = 0.0, 0

    def reset_clock(self) -> None:
        """Start timing now (after a checkpoint save, say, which is not a training step)."""
        self.last_time = self.clock()

    def update(self, step: int) -> dict:
        now = self.clock()
        steps = max(step - self.last_step, 1)
        dt = (now - self.last_time) / steps
        if self.windows:  # the first window holds the warm-up: the ETA leaves it out
            self.steady_time += now - self.last_time
            self.steady_steps += steps
        self.windows += 1
        self.last_step, self.last_time = step, now
        tps = self.tokens_per_step / dt if dt > 0 else float("nan")
        out = {"step_time_s": dt, "tokens_per_s": tps, "tokens_per_s_per_device": tps / self.devices,
               "tflops": None, "mfu": None}
        if self.flops_per_token:
            out["tflops"] = self.flops_per_token * tps / (self.devices * 1e12)
            if self.peak_tflops:
                out["mfu"] = out["tflops"] / self.peak_tflops
        if self.total_steps is not None:
            mean = self.steady_time / self.steady_steps if self.steady_steps else dt
            out["eta_s"] = max(self.total_steps - step, 0) * mean
        return out


def _duration(s: Optional[float]) -> str:
    if s is None or not math.isfinite(s):
        return "?"
    s = int(round(s))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def format_line(step: int, total: Optional[int], fields: dict) -> str:
    """One human line of a logged step's fields (any missing field is left out)."""
    width = len(str(total)) if total else 4
    parts = [f"step {step:{width}d}" + (f"/{total}" if total else "")]
    f = fields.get
    if f("loss") is not None:
        parts.append(f"loss {f('loss'):.4f}")
    if f("eval_loss") is not None:
        parts.append(f"eval_loss {f('eval_loss'):.4f}")
    if f("grad_norm") is not None:
        parts.append(f"grad_norm {f('grad_norm'):.3f}")
    if f("lr") is not None:
        parts.append(f"lr {f('lr'):.2e}")
    if f("step_time_s") is not None:
        parts.append(f"{1000 * f('step_time_s'):.1f} ms")
    if f("tokens_per_s") is not None:
        parts.append(f"{f('tokens_per_s'):,.0f} tok/s ({f('tokens_per_s_per_device'):,.0f}/dev)")
    if f("tflops") is not None:
        parts.append(f"{f('tflops'):.1f} TFLOP/s")
    if "mfu" in fields:
        parts.append("mfu n/a" if f("mfu") is None else f"mfu {100 * f('mfu'):.1f}%")
    if f("mem_gib") is not None and math.isfinite(f("mem_gib")):
        gib = f("mem_gib")
        size = f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.2f} MiB" if gib >= 1 / 1024 else f"{gib * 2**20:.1f} KiB"
        parts.append(f"mem {size}" + (" (plan)" if f("mem_source") == "plan" else "")
                     + (f" {100 * f('mem_frac'):.0f}%" if f("mem_frac") is not None else ""))
    if "eta_s" in fields:
        parts.append(f"eta {_duration(f('eta_s'))}")
    return "  ".join(parts)


# -- looking inside a run: a profiler trace of chosen steps, the allocator's memory snapshot -----------------

# -- the log -------------------------------------------------------------------------------------------

class TrainLog:
    """Logged steps to a terminal (lines, and a progress bar when stdout is a terminal and tqdm or rich is
    installed) and to sinks: ``metrics_path`` (JSON lines), ``tensorboard_dir`` (TensorBoard scalars) and
    any :class:`Sink` in ``sinks`` (:class:`WandbSink`, :class:`MLflowSink`, yours). Only ``rank`` 0
    writes; other ranks' calls do nothing (build sinks on rank 0 only).

    Steps are numbered from 1: ``log(step)`` takes the number of steps done. ``start_step``: the steps a
    resumed run starts after (its checkpoint's step); the JSON-lines file is then appended to, else
    rewritten, and :meth:`restart` puts a marker in it. ``progress``: ``"auto"`` (a bar on a terminal if tqdm
    or rich is installed), ``"tqdm"``, ``"rich"`` or ``"none"``. Every record carries ``time`` (Unix seconds).

    >>> log = TrainLog(total_steps=1000, rank=rank, metrics_path="out.jsonl")
    >>> log.restart(start, "ckpt/step_00000100")   # after --resume: {"event": "restart", "step": 100, ...}
    >>> log.log(step, loss=2.31, lr=3e-4)       # a line (above the bar), a record to every sink
    >>> log.print("saved checkpoint")           # a message that does not break the bar
    >>> log.close()
    """

    def __init__(self, total_steps: Optional[int] = None, *, rank: int = 0, start_step: int = 0,
                 metrics_path: Optional[str] = None, tensorboard_dir: Optional[str] = None,
                 sinks: Optional[list] = None, progress: str = "auto", stream: Optional[IO[str]] = None,
                 clock=time.time):
        self.total, self.rank, self.start = total_steps, rank, start_step
        self.stream = stream if stream is not None else sys.stdout
        self.clock = clock
        self.sinks: list = []
        self._bar = None
        self._bar_kind = None
        if rank != 0:
            return
        if metrics_path:
            self.sinks.append(JsonLinesSink(metrics_path, append=start_step > 0))
        if tensorboard_dir:
            try:
                self.sinks.append(TensorBoardSink(tensorboard_dir, purge_step=start_step + 1 if start_step > 0 else None))
            except ImportError:  # torch's module raises ImportError when the tensorboard package is missing
                self.print(f"--tensorboard {tensorboard_dir}: tensorboard is not installed (pip install tensorboard); "
                           f"training goes on without TensorBoard scalars")
        self.sinks.extend(sinks or [])
        self._open_bar(progress)

    def _open_bar(self, progress: str) -> None:
        if progress not in ("auto", "tqdm", "rich", "none"):
            raise ShardingError(f"progress={progress!r}: choose auto, tqdm, rich or none")
        if progress == "none" or self.total is None:
            return
        if progress == "auto" and not (hasattr(self.stream, "isatty") and self.stream.isatty()):
            return
        for kind in (("tqdm", "rich") if progress == "auto" else (progress,)):
            try:
                if kind == "tqdm":
                    from tqdm.auto import tqdm
                    self._bar = tqdm(total=self.total, initial=self.start, unit="step", file=self.stream,
                                     dynamic_ncols=True, leave=True)
                else:
                    from rich.console import Console
                    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                               TimeRemainingColumn)
                    console = Console(file=self.stream)
                    self._bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                         TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console)
                    self._bar.start()
                    self._task = self._bar.add_task("train", total=self.total, completed=self.start, info="")
                self._bar_kind = kind
                return
            except ImportError:
                continue
        if progress != "auto":
            self.print(f"progress={progress!r}: {progress} is not installed (pip install {progress}); plain lines")

    # -- writing --------------------------------------------------------------------------------------
    def print(self, text: str) -> None:
        """A message on rank 0 (above the progress bar if there is one)."""
        if self.rank != 0:
            return
        if self._bar_kind == "tqdm":
            self._bar.write(text, file=self.stream)
        elif self._bar_kind == "rich":
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def log(self, step: int, **fields) -> None:
        """One logged step (``step``: steps done, 1 for the first): numbers (``None`` for unknown, as MFU on a
        CPU) and short strings."""
        if self.rank != 0:
            return
        self.print(format_line(step, self.total, fields))
        if self._bar_kind == "tqdm":
            self._bar.update(step - self._bar.n)
            if fields.get("loss") is not None:
                self._bar.set_postfix(loss=f"{fields['loss']:.4f}", refresh=False)
        elif self._bar_kind == "rich":
            info = f"loss {fields['loss']:.4f}" if fields.get("loss") is not None else ""
            self._bar.update(self._task, completed=step, info=info)
        record = {"time": self.clock(), **{k: _jsonable(v) for k, v in fields.items()}}
        for sink in self.sinks:
            sink.write(step, record)

    def event(self, name: str, step: int, **info) -> None:
        """Something that happened at ``step`` besides training (a restart, an evaluation's start): to every
        sink (a JSON line ``{"event": name, "step": step, "time": ...}``)."""
        if self.rank != 0:
            return
        info = {"time": self.clock(), **info}
        for sink in self.sinks:
            if hasattr(sink, "event"):
                sink.event(name, step, info)

    def restart(self, step: int, checkpoint: Optional[str] = None) -> None:
        """The restart marker of a resumed run: ``{"event": "restart", "step": step, "checkpoint": ...}``
        (steps after it come from the resumed run; records of the killed run after ``step`` are stale)."""
        self.event("restart", step, checkpoint=checkpoint)

    def close(self) -> None:
        if self._bar_kind == "tqdm":
            self._bar.close()
        elif self._bar_kind == "rich":
            self._bar.stop()
        self._bar = self._bar_kind = None
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
