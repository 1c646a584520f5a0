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


def test_meter_throughput_tflops_mfu_and_eta_leave_out_the_warm_up():
    clock = Clock()
    m = metrics.Meter(tokens_per_step=1000, devices=4, flops_per_token=1e9, peak_tflops=100.0, total_steps=10,
                      clock=clock)
    clock.t = 5.0  # step 1 (steps are numbered from 1): 5 s of warm-up
    first = m.update(1)
    assert first["step_time_s"] == 5.0 and first["eta_s"] == 9 * 5.0
    clock.t = 7.0  # steps 2 and 3: 1 s each
    out = m.update(3)
    assert out["step_time_s"] == 1.0 and out["tokens_per_s"] == 1000 and out["tokens_per_s_per_device"] == 250
    assert out["tflops"] == pytest.approx(1e9 * 1000 / 4 / 1e12)  # achieved, per device
    assert out["mfu"] == pytest.approx(1e9 * 1000 / (4 * 100e12))
    assert out["eta_s"] == 7 * 1.0  # 7 steps left at the steady 1 s, not the warm-up's 5 s
    bare = metrics.Meter(1, 1, total_steps=None).update(1)
    assert bare["mfu"] is None and bare["tflops"] is None
    resumed = metrics.Meter(1, 1, total_steps=10, start_step=4, clock=clock)
    clock.t = 9.0
    assert resumed.update(5)["step_time_s"] == 2.0 and resumed.update(5)["eta_s"] == 5 * 0.0


def test_format_line():
    line = metrics.format_line(3, 40, {"loss": 2.5, "grad_norm": 0.5, "lr": 3e-4, "step_time_s": 0.02,
                                       "tokens_per_s": 1000.0, "tokens_per_s_per_device": 500.0, "mfu": None,
                                       "mem_gib": 1.5 / 1024, "mem_source": "plan", "eta_s": 3725, "eval_loss": 2.25})
    assert line.startswith("step  3/40  loss 2.5000  eval_loss 2.2500")
    for part in ("grad_norm 0.500", "lr 3.00e-04", "20.0 ms", "1,000 tok/s (500/dev)", "mfu n/a", "mem 1.50 MiB (plan)",
                 "eta 1:02:05"):
        assert part in line, part
    assert "mfu 41.0%" in metrics.format_line(1, None, {"mfu": 0.41})
    assert "mem 2.00 GiB 25%" in metrics.format_line(1, None, {"mem_gib": 2.0, "mem_source": "cuda", "mem_frac": 0.25})
    assert "412.3 TFLOP/s" in metrics.format_line(1, None, {"tflops": 412.34})


def test_train_log_writes_lines_and_json_lines_on_rank_0_only(tmp_path):
    out = io.StringIO()
    path = tmp_path / "m.jsonl"
    fields = dict(loss=2.0, lr=torch.tensor(0.1), mfu=None, grad_norm=float("nan"))
    with metrics.TrainLog(4, rank=0, metrics_path=str(path), stream=out, clock=lambda: 1234.5) as log:
        log.log(1, **fields)
        log.print("saved")
    assert out.getvalue().splitlines() == [metrics.format_line(1, 4, fields), "saved"]
    assert "grad_norm nan" in out.getvalue() and "lr 1.00e-01" in out.getvalue()
    rec = json.loads(path.read_text())
    assert rec == {"step": 1, "time": 1234.5, "loss": 2.0, "lr": pytest.approx(0.1), "mfu": None, "grad_norm": "nan"}
    # a resumed run appends, after a restart marker; rank 1 writes nothing
    with metrics.TrainLog(4, rank=0, start_step=1, metrics_path=str(path), stream=out, clock=lambda: 2000.0) as log:
        log.restart(1, "ckpt/step_00000001")
        log.log(2, loss=1.0)
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 1, 2]
    assert records[1] == {"event": "restart", "step": 1, "time": 2000.0, "checkpoint": "ckpt/step_00000001"}
    quiet = io.StringIO()
    with metrics.TrainLog(4, rank=1, metrics_path=str(tmp_path / "r1.jsonl"), stream=quiet) as log:
        log.log(1, loss=1.0)
        log.restart(1)
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
        for step in range(1, 4):
            log.log(step, loss=1.0 / step)
        if kind == "tqdm":
            assert log._bar.n == 3  # steps from 1: the bar is full after step 3
    text = term.getvalue()
    assert "step 3/3" in text and "loss 0.3333" in text
    assert metrics.TrainLog(3, rank=0, stream=io.StringIO())._bar_kind is None  # not a terminal: plain lines


def test_missing_tensorboard_is_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    out = io.StringIO()
    with metrics.TrainLog(2, rank=0, tensorboard_dir=str(tmp_path / "tb"), stream=out) as log:
        log.log(1, loss=1.0)
    lines = out.getvalue().splitlines()
    assert lines[0] == (f"--tensorboard {tmp_path / 'tb'}: tensorboard is not installed (pip install tensorboard); "
                        f"training goes on without TensorBoard scalars")
    assert len(lines) == 2


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    with metrics.TrainLog(2, rank=0, tensorboard_dir=str(tmp_path / "tb"), stream=io.StringIO()) as log:
        log.log(1, loss=1.0, lr=0.1, mfu=None)
        log.restart(1, "ckpt")
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_bad_progress_choice():
    with pytest.raises(sp.ShardingError, match="progress"):
        metrics.TrainLog(2, rank=0, progress="fancy")


# -- sinks -------------------------------------------------------------------------------------------------

class Recorder(metrics.Sink):
    def __init__(self):
        self.rows, self.events, self.closed = [], [], False

    def write(self, step, record):
        self.rows.append((step, record))

    def event(self, name, step, info):
        self.events.append((name, step, info))

    def close(self):
        self.closed = True


def test_custom_sink_gets_numbered_timestamped_records_and_events():
    sink = Recorder()
    with metrics.TrainLog(3, rank=0, sinks=[sink], stream=io.StringIO(), clock=lambda: 7.0) as log:
        log.log(1, loss=torch.tensor(2.0), mfu=None)
        log.restart(1, "ck")
    assert sink.rows == [(1, {"time": 7.0, "loss": 2.0, "mfu": None})]
    assert sink.events == [("restart", 1, {"time": 7.0, "checkpoint": "ck"})] and sink.closed
    other = Recorder()
    with metrics.TrainLog(3, rank=1, sinks=[other], stream=io.StringIO()) as log:  # rank 1: nothing
        log.log(1, loss=1.0)
    assert other.rows == [] and not other.closed


@pytest.mark.parametrize("module,make", [("wandb", lambda: metrics.WandbSink(project="p")),
                                         ("mlflow", lambda: metrics.MLflowSink(experiment="e"))])
def test_missing_wandb_or_mlflow_says_how_to_install(monkeypatch, module, make):
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    with pytest.raises(sp.ShardingError, match=rf"needs the {module} package, which is not installed: pip install "
                                               rf"{module} \(or pip install shardplan\[{module}\]\)"):
        make()


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional (pip install shardplan[wandb])")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = metrics.WandbSink(project="shardplan-test", dir=str(tmp_path), config={"lr": 0.1})
    log = metrics.TrainLog(2, rank=0, sinks=[sink], stream=io.StringIO())
    log.log(1, loss=2.0, lr=0.1, mfu=None, mem_source="plan")
    log.log(2, loss=1.5, lr=0.1, mfu=None, mem_source="plan")
    log.restart(2, "ckpt/step_00000002")
    assert sink.run.offline and sink.run.config["lr"] == 0.1
    assert sink.run.summary["loss"] == 1.5 and sink.run.summary["_step"] == 2  # at the log's step numbers
    assert sink.run.summary["restart_step"] == 2 and sink.run.summary["restart_checkpoint"] == "ckpt/step_00000002"
    assert not {"mfu", "mem_source"} & set(sink.run.summary.keys())  # numbers only
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # what `wandb sync` uploads
    assert len(runs) == 1
    assert runs[0].stat().st_size > 0


def test_mlflow_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is optional (pip install shardplan[mlflow])")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow >= 3.x: the file store is opt-in
    uri = (tmp_path / "mlruns").as_uri()
    sink = metrics.MLflowSink(experiment="shardplan-test", tracking_uri=uri, params={"lr": 0.1})
    with metrics.TrainLog(2, rank=0, sinks=[sink], stream=io.StringIO(), clock=lambda: 100.0) as log:
        log.log(1, loss=2.0, mfu=None, mem_source="plan")
        log.log(2, loss=1.5, mfu=None, mem_source="plan")
        log.restart(2, "ck")
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(sink.run_id, "loss")
    assert [(m.step, m.value, m.timestamp) for m in history] == [(1, 2.0, 100_000), (2, 1.5, 100_000)]
    run = client.get_run(sink.run_id)
    assert run.data.params == {"lr": "0.1"} and run.data.tags["restart_step"] == "2"
    assert run.info.status == "FINISHED"


# -- FLOPs, counted -------------------------------------------------------------------------------------

def test_count_flops_is_exact_for_a_linear_forward_and_backward():
    lin = torch.nn.Linear(16, 32)
    x = torch.randn(4, 16, requires_grad=True)
    out, flops = metrics.count_flops(lambda: lin(x).sum().backward())
    assert out is None and flops == 3 * 2 * 4 * 16 * 32  # forward, and the input's and weight's gradients


def test_counted_flops_of_the_gpt_equal_the_formula_on_the_meta_device():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import gpt
    with torch.device("meta"):
        model = gpt.build("tiny")
        c = model.config
        x = torch.zeros(2, 32, dtype=torch.long)
        _, flops = metrics.count_flops(lambda: model(x, x).backward())
    formula = metrics.flops_per_token(model, seq=32, layers=c.layers, dim=c.dim)
    assert flops / x.numel() == pytest.approx(formula, rel=1e-9)


def test_counted_flops_include_attention_on_the_cpu():
    # torch's counter has formulas for the CUDA attention kernels only; count_flops adds the CPU ones
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import gpt
    model = gpt.build("tiny", max_seq=32)
    c = model.config
    x = torch.randint(0, c.vocab, (2, 32))
    _, flops = metrics.count_flops(lambda: model(x, x).backward())
    linear = metrics.flops_per_token(model)
    attention = 12 * c.layers * c.dim * 32  # the formula's; the CPU kernel's backward recomputes the scores too
    assert flops / x.numel() == linear + attention + 2 * c.layers * c.dim * 32


# -- looking inside a run --------------------------------------------------------------------------------

def test_parse_steps():
    assert metrics.parse_steps("3:5") == (3, 5) and metrics.parse_steps("4") == (4, 4)
    for bad in ("0:2", "5:3", "a:b", ""):
        with pytest.raises(sp.ShardingError, match="steps"):
            metrics.parse_steps(bad)


def test_step_profiler_traces_only_its_steps(tmp_path):
    prof = metrics.StepProfiler("2:3", str(tmp_path / "prof"), rank=1)
    lin = torch.nn.Linear(8, 8)
    written = []
    for step in range(1, 6):
        prof.begin(step)
        assert prof.active == (2 <= step <= 3)
        lin(torch.randn(2, 8)).sum().backward()
        written.append(prof.end(step))
    assert written == [None, None, str(tmp_path / "prof" / "rank1.trace.json"), None, None]
    trace = json.loads((tmp_path / "prof" / "rank1.trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::addmm" in names and sum(n.startswith("ProfilerStep#") for n in names if n) == 2
    cut = metrics.StepProfiler("1:9", str(tmp_path / "cut"))  # a run that ends inside the range
    cut.begin(1)
    assert cut.end(1) is None and cut.close() == str(tmp_path / "cut" / "rank0.trace.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_memory_snapshot_needs_a_gpu(tmp_path):
    with pytest.raises(sp.ShardingError, match="needs a GPU"):
        metrics.MemorySnapshot(str(tmp_path))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA caching allocator's history needs a GPU")
def test_memory_snapshot_on_a_gpu(tmp_path):
    import pickle
    snap = metrics.MemorySnapshot(str(tmp_path), rank=0, at_step=2)
    lin = torch.nn.Linear(256, 256).cuda()
    written = []
    for step in range(1, 4):
        lin(torch.randn(64, 256, device="cuda")).sum().backward()
        written.append(snap.end(step))
    assert written == [None, str(tmp_path / "rank0.pickle"), None]
    with open(tmp_path / "rank0.pickle", "rb") as f:
        data = pickle.load(f)
    assert data["segments"] and any(t for t in data["device_traces"])
    assert metrics.memory_fraction() > 0 and metrics.memory()["mem_source"] == "cuda"
