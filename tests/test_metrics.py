"""sp.metrics: the peak table, FLOPs per token, the meter's throughput, MFU and ETA, and the logger's sinks
(lines, a progress bar on a terminal, JSON lines, TensorBoard or its one-line absence)."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest
import torch

import shardplan as sp
from shardplan import metrics


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA A10G", 70.0), ("NVIDIA A10", 125.0),
    ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.0), ("NVIDIA B200", 2250.0), ("AMD Instinct MI300X", 1307.0),
    ("NVIDIA GeForce GTX 1080", None),
])
def test_peak_table(name, peak):
    assert metrics.peak_of_name(name) == peak


def test_no_peak_on_cpu():
    assert metrics.peak_tflops(torch.device("cpu")) is None


def test_flops_per_token_counts_linear_weights_once_and_attention():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import gpt
    with torch.device("meta"):
        model = gpt.build("small")
    c = model.config
    hd = c.dim // c.heads
    per_layer = c.dim * c.heads * hd * 2 + c.dim * c.kv_heads * hd * 2 + 3 * c.dim * c.ffn
    linear = c.layers * per_layer + c.vocab * c.dim  # the output projection (tied to the embedding: counted once)
    assert metrics.flops_per_token(model) == 6 * linear
    assert metrics.flops_per_token(model, seq=128, layers=c.layers, dim=c.dim) == 6 * linear + 12 * c.layers * c.dim * 128


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_meter_throughput_mfu_and_eta_leave_out_the_warm_up():
    clock = Clock()
    m = metrics.Meter(tokens_per_step=1000, devices=4, flops_per_token=1e9, peak_tflops=100.0, total_steps=10,
                      clock=clock)
    clock.t = 5.0  # the first step: 5 s of warm-up
    first = m.update(0)
    assert first["step_time_s"] == 5.0 and first["eta_s"] == 9 * 5.0
    clock.t = 7.0  # steps 1 and 2: 1 s each
    out = m.update(2)
    assert out["step_time_s"] == 1.0 and out["tokens_per_s"] == 1000 and out["tokens_per_s_per_device"] == 250
    assert out["mfu"] == pytest.approx(1e9 * 1000 / (4 * 100e12))
    assert out["eta_s"] == 7 * 1.0  # 7 steps left at the steady 1 s, not the warm-up's 5 s
    assert metrics.Meter(1, 1, total_steps=None).update(0)["mfu"] is None


def test_format_line():
    line = metrics.format_line(3, 40, {"loss": 2.5, "grad_norm": 0.5, "lr": 3e-4, "step_time_s": 0.02,
                                       "tokens_per_s": 1000.0, "tokens_per_s_per_device": 500.0, "mfu": None,
                                       "mem_gib": 1.5 / 1024, "mem_source": "plan", "eta_s": 3725})
    assert line.startswith("step  3/40  loss 2.5000")
    for part in ("grad_norm 0.500", "lr 3.00e-04", "20.0 ms", "1,000 tok/s (500/dev)", "mfu n/a", "mem 1.50 MiB (plan)",
                 "eta 1:02:05"):
        assert part in line, part
    assert "mfu 41.0%" in metrics.format_line(0, None, {"mfu": 0.41})


def test_train_log_writes_lines_and_json_lines_on_rank_0_only(tmp_path):
    out = io.StringIO()
    path = tmp_path / "m.jsonl"
    fields = dict(loss=2.0, lr=torch.tensor(0.1), mfu=None, grad_norm=float("nan"))
    with metrics.TrainLog(4, rank=0, metrics_path=str(path), stream=out) as log:
        log.log(0, **fields)
        log.print("saved")
    assert out.getvalue().splitlines() == [metrics.format_line(0, 4, fields), "saved"]
    assert "grad_norm nan" in out.getvalue() and "lr 1.00e-01" in out.getvalue()
    rec = json.loads(path.read_text())
    assert rec == {"step": 0, "loss": 2.0, "lr": pytest.approx(0.1), "mfu": None, "grad_norm": "nan"}
    # a resumed run appends; rank 1 writes nothing
    with metrics.TrainLog(4, rank=0, start_step=1, metrics_path=str(path), stream=out) as log:
        log.log(1, loss=1.0)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1]
    quiet = io.StringIO()
    with metrics.TrainLog(4, rank=1, metrics_path=str(tmp_path / "r1.jsonl"), stream=quiet) as log:
        log.log(0, loss=1.0)
        log.print("hello")
    assert quiet.getvalue() == "" and not (tmp_path / "r1.jsonl").exists()


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("kind", ["tqdm", "rich"])
def test_progress_bar_on_a_terminal(kind):
    pytest.importorskip(kind)
    term = Terminal()
    with metrics.TrainLog(3, rank=0, stream=term, progress=kind if kind == "rich" else "auto") as log:
        assert log._bar_kind == kind
        for step in range(3):
            log.log(step, loss=1.0 / (step + 1))
    text = term.getvalue()
    assert "step 2/3" in text and "loss 0.3333" in text
    assert metrics.TrainLog(3, rank=0, stream=io.StringIO())._bar_kind is None  # not a terminal: plain lines


def test_missing_tensorboard_is_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    out = io.StringIO()
    with metrics.TrainLog(2, rank=0, tensorboard_dir=str(tmp_path / "tb"), stream=out) as log:
        log.log(0, loss=1.0)
    lines = out.getvalue().splitlines()
    assert lines[0] == (f"--tensorboard {tmp_path / 'tb'}: tensorboard is not installed (pip install tensorboard); "
                        f"training goes on without TensorBoard scalars")
    assert len(lines) == 2


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    with metrics.TrainLog(2, rank=0, tensorboard_dir=str(tmp_path / "tb"), stream=io.StringIO()) as log:
        log.log(0, loss=1.0, lr=0.1, mfu=None)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_bad_progress_choice():
    with pytest.raises(sp.ShardingError, match="progress"):
        metrics.TrainLog(2, rank=0, progress="fancy")
