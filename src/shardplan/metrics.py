"""What a training log reports: FLOPs and MFU, throughput and ETA, peak memory, and one logger that writes
lines (or a progress bar on a terminal), JSON lines and TensorBoard scalars.

>>> fpt = sp.metrics.flops_per_token(model, seq=2048, layers=16, dim=2048)   # before sp.shard: full shapes
>>> meter = sp.metrics.Meter(tokens_per_step=batch * seq, devices=world, flops_per_token=fpt,
...                          peak_tflops=sp.metrics.peak_tflops(), total_steps=steps)
>>> log = sp.metrics.TrainLog(total_steps=steps, rank=rank, metrics_path="out.jsonl", tensorboard_dir=None)
>>> log.log(step, loss=2.3, lr=3e-4, grad_norm=0.9, **meter.update(step), mem_gib=sp.metrics.peak_memory_gib(plan, rank))

Nothing here talks to other ranks: the caller reduces the loss. torch, tqdm, rich and tensorboard are
imported only when used (tqdm, rich and tensorboard are optional: ``pip install shardplan[train]``).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from typing import IO, TYPE_CHECKING, Optional

from .errors import ShardingError

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


class Meter:
    """Throughput, MFU and ETA from the wall time between logged steps (so that unlogged steps need no
    device sync). Call :meth:`update` at each logged step, after something synchronised the device (reading
    the loss does).

    >>> meter = Meter(tokens_per_step=8 * 64, devices=2, flops_per_token=fpt, peak_tflops=None, total_steps=40)
    >>> meter.update(step)   # {"step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "eta_s"}
    """

    def __init__(self, tokens_per_step: int, devices: int, *, flops_per_token: Optional[float] = None,
                 peak_tflops: Optional[float] = None, total_steps: Optional[int] = None, start_step: int = 0,
                 clock=time.perf_counter):
        self.tokens_per_step, self.devices = tokens_per_step, devices
        self.flops_per_token, self.peak_tflops, self.total_steps = flops_per_token, peak_tflops, total_steps
        self.clock = clock
        self.last_step, self.last_time = start_step - 1, clock()
        self.first_step = start_step
        self.steady_time, self.steady_steps = 0.0, 0

    def reset_clock(self) -> None:
        """Start timing now (after a checkpoint save, say, which is not a training step)."""
        self.last_time = self.clock()

    def update(self, step: int) -> dict:
        now = self.clock()
        steps = max(step - self.last_step, 1)
        dt = (now - self.last_time) / steps
        if self.last_step >= self.first_step:  # the first window holds the warm-up: the ETA leaves it out
            self.steady_time += now - self.last_time
            self.steady_steps += steps
        self.last_step, self.last_time = step, now
        tps = self.tokens_per_step / dt if dt > 0 else float("nan")
        out = {"step_time_s": dt, "tokens_per_s": tps, "tokens_per_s_per_device": tps / self.devices, "mfu": None}
        if self.flops_per_token and self.peak_tflops:
            out["mfu"] = self.flops_per_token * tps / (self.devices * self.peak_tflops * 1e12)
        if self.total_steps is not None:
            mean = self.steady_time / self.steady_steps if self.steady_steps else dt
            out["eta_s"] = max(self.total_steps - step - 1, 0) * mean
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
    if f("grad_norm") is not None:
        parts.append(f"grad_norm {f('grad_norm'):.3f}")
    if f("lr") is not None:
        parts.append(f"lr {f('lr'):.2e}")
    if f("step_time_s") is not None:
        parts.append(f"{1000 * f('step_time_s'):.1f} ms")
    if f("tokens_per_s") is not None:
        parts.append(f"{f('tokens_per_s'):,.0f} tok/s ({f('tokens_per_s_per_device'):,.0f}/dev)")
    if "mfu" in fields:
        parts.append("mfu n/a" if f("mfu") is None else f"mfu {100 * f('mfu'):.1f}%")
    if f("mem_gib") is not None and math.isfinite(f("mem_gib")):
        gib = f("mem_gib")
        size = f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.2f} MiB" if gib >= 1 / 1024 else f"{gib * 2**20:.1f} KiB"
        parts.append(f"mem {size}" + (" (plan)" if f("mem_source") == "plan" else ""))
    if "eta_s" in fields:
        parts.append(f"eta {_duration(f('eta_s'))}")
    return "  ".join(parts)


class TrainLog:
    """Logged steps to a terminal (lines, and a progress bar when stdout is a terminal and tqdm or rich is
    installed), to a JSON-lines file (one object per logged step) and to TensorBoard. Only ``rank`` 0
    writes; other ranks' calls do nothing.

    ``progress``: ``"auto"`` (a bar on a terminal if tqdm or rich is installed), ``"tqdm"``, ``"rich"`` or
    ``"none"``. ``metrics_path`` is appended to when ``start_step > 0`` (a resumed run), else rewritten.

    >>> log = TrainLog(total_steps=1000, rank=rank, metrics_path="out.jsonl")
    >>> log.log(step, loss=2.31, lr=3e-4)       # a line (above the bar), a JSON object, TensorBoard scalars
    >>> log.print("saved checkpoint")           # a message that does not break the bar
    >>> log.close()
    """

    def __init__(self, total_steps: Optional[int] = None, *, rank: int = 0, start_step: int = 0,
                 metrics_path: Optional[str] = None, tensorboard_dir: Optional[str] = None,
                 progress: str = "auto", stream: Optional[IO[str]] = None):
        self.total, self.rank, self.start = total_steps, rank, start_step
        self.stream = stream if stream is not None else sys.stdout
        self._jsonl = self._tb = self._bar = None
        self._bar_kind = None
        if rank != 0:
            return
        if metrics_path:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_path)), exist_ok=True)
            self._jsonl = open(metrics_path, "a" if start_step > 0 else "w")
        if tensorboard_dir:
            self._tb = self._tensorboard(tensorboard_dir)
        self._open_bar(progress)

    # -- sinks ----------------------------------------------------------------------------------------
    def _tensorboard(self, logdir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's module raises ImportError when the tensorboard package is missing
            self.print(f"--tensorboard {logdir}: tensorboard is not installed (pip install tensorboard); "
                       f"training goes on without TensorBoard scalars")
            return None
        return SummaryWriter(log_dir=logdir, purge_step=self.start if self.start > 0 else None)

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
        """One logged step: numbers (``None`` for unknown, as MFU on a CPU) and short strings."""
        if self.rank != 0:
            return
        self.print(format_line(step, self.total, fields))
        if self._bar_kind == "tqdm":
            self._bar.update(step + 1 - self._bar.n)
            if fields.get("loss") is not None:
                self._bar.set_postfix(loss=f"{fields['loss']:.4f}", refresh=False)
        elif self._bar_kind == "rich":
            info = f"loss {fields['loss']:.4f}" if fields.get("loss") is not None else ""
            self._bar.update(self._task, completed=step + 1, info=info)
        if self._jsonl is not None:
            record = {"step": step, **{k: _jsonable(v) for k, v in fields.items()}}
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in fields.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(f"train/{k}", v, step)

    def close(self) -> None:
        if self._bar_kind == "tqdm":
            self._bar.close()
        elif self._bar_kind == "rich":
            self._bar.stop()
        self._bar = self._bar_kind = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _jsonable(v):
    if hasattr(v, "item") and hasattr(v, "numel"):  # a one-element tensor
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN or infinity; "nan" / "inf" keep the line parseable
    return v
