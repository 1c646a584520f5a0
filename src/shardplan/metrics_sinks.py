"""Where a :class:`~shardplan.metrics.TrainLog`'s logged steps go (:mod:`shardplan.metrics` re-exports these):
the :class:`Sink` protocol, JSON lines, TensorBoard, Weights & Biases and MLflow (each imported only when its
sink is built: ``pip install shardplan[wandb]``, ``shardplan[mlflow]``), and the values a record holds."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Optional

from .errors import ShardingError


class Sink:
    """Where a :class:`TrainLog` sends each logged step (rank 0 only). Subclass it, or pass any object with
    these methods: ``write(step, record)`` (``record``: ``{"time": unix seconds, field: value}``, values are
    numbers, ``None`` or short strings), ``event(name, step, info)`` (a restart, say) and ``close()``.

    >>> class Print(sp.metrics.Sink):
    ...     def write(self, step, record): print(step, record["loss"])
    """

    def write(self, step: int, record: dict) -> None:
        raise NotImplementedError

    def event(self, name: str, step: int, info: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _numbers(record: dict) -> dict:
    """The finite numbers of a record (what scalar dashboards take), ``time`` left out."""
    return {k: v for k, v in record.items()
            if k != "time" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class JsonLinesSink(Sink):
    """One JSON object per logged step, ``{"step": 1, "time": ..., "loss": ...}``, and one per event,
    ``{"event": "restart", "step": ..., "time": ..., ...}``. ``append``: add to an existing file (a resumed
    run) instead of rewriting it."""

    def __init__(self, path: str, *, append: bool = False):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path, self._f = path, open(path, "a" if append else "w")

    def _line(self, obj: dict) -> None:
        self._f.write(json.dumps(obj) + "\n")
        self._f.flush()

    def write(self, step: int, record: dict) -> None:
        self._line({"step": step, **{k: _jsonable(v) for k, v in record.items()}})

    def event(self, name: str, step: int, info: dict) -> None:
        self._line({"event": name, "step": step, **{k: _jsonable(v) for k, v in info.items()}})

    def close(self) -> None:
        self._f.close()


class TensorBoardSink(Sink):
    """Scalars under ``train/<field>`` (``torch.utils.tensorboard``; needs the tensorboard package); an event
    is a text entry. ``purge_step``: a resumed run's first step (TensorBoard drops what a killed run logged
    after it)."""

    def __init__(self, logdir: str, *, purge_step: Optional[int] = None):
        from torch.utils.tensorboard import SummaryWriter  # ImportError when tensorboard is missing
        self.writer = SummaryWriter(log_dir=logdir, purge_step=purge_step)

    def write(self, step: int, record: dict) -> None:
        for k, v in _numbers(record).items():
            self.writer.add_scalar(f"train/{k}", v, step, walltime=record.get("time"))

    def event(self, name: str, step: int, info: dict) -> None:
        self.writer.add_text(f"events/{name}", json.dumps({k: _jsonable(v) for k, v in info.items()}), step)

    def close(self) -> None:
        self.writer.close()


def _require(module: str, sink: str, extra: str):
    """``import module``, or a :class:`~shardplan.errors.ShardingError` that says how to install it."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ShardingError(f"{sink} needs the {module} package, which is not installed: pip install {module} "
                            f"(or pip install shardplan[{extra}]); or leave {sink} out") from exc


def sink_available(module: str) -> bool:
    """Whether ``wandb`` / ``mlflow`` can be imported (without importing it): check it on every rank before
    building a sink on rank 0, so that a missing package stops every rank, not rank 0 alone."""
    import importlib.util
    return importlib.util.find_spec(module) is not None


class WandbSink(Sink):
    """Weights & Biases through its own library: ``wandb.init(project=..., **init)`` when built, ``run.log``
    per logged step (at the run's step), ``run.finish()`` at close. Offline: ``WANDB_MODE=offline``
    (or ``mode="offline"``), then ``wandb sync`` the directory it wrote. An event lands in the run's
    summary (``restart_step``, ``restart_checkpoint``).

    >>> log = sp.metrics.TrainLog(steps, rank=rank, sinks=[sp.metrics.WandbSink(project="gpt", config=vars(args))])
    """

    def __init__(self, project: Optional[str] = None, **init):
        wandb = _require("wandb", "WandbSink", "wandb")
        self.run = wandb.init(project=project, **init)

    def write(self, step: int, record: dict) -> None:
        self.run.log(_numbers(record), step=step, commit=True)  # one record per step: committed now (a killed run keeps it)

    def event(self, name: str, step: int, info: dict) -> None:
        self.run.summary[f"{name}_step"] = step
        for k, v in info.items():
            self.run.summary[f"{name}_{k}"] = _jsonable(v)

    def close(self) -> None:
        self.run.finish()


class MLflowSink(Sink):
    """MLflow through its own library: a run started when built (``tracking_uri``: e.g. ``file:/tmp/mlruns``
    or a server; default: ``MLFLOW_TRACKING_URI``), ``log_metrics(..., step=)`` per logged step, ``end_run``
    at close; ``params`` are logged once. An event is a tag (``restart_step``, ...).

    >>> sink = sp.metrics.MLflowSink(experiment="gpt", tracking_uri="file:./mlruns", params=vars(args))
    """

    def __init__(self, experiment: Optional[str] = None, *, tracking_uri: Optional[str] = None,
                 run_name: Optional[str] = None, params: Optional[dict] = None, tags: Optional[dict] = None):
        mlflow = _require("mlflow", "MLflowSink", "mlflow")
        from mlflow.tracking import MlflowClient
        self.client = MlflowClient(tracking_uri=tracking_uri)
        name = experiment or "shardplan"
        found = self.client.get_experiment_by_name(name)
        exp_id = found.experiment_id if found is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags or {}).info.run_id
        self._mlflow = mlflow
        if params:
            for k, v in params.items():
                self.client.log_param(self.run_id, k, v)

    def write(self, step: int, record: dict) -> None:
        from mlflow.entities import Metric
        ms = int(1000 * record.get("time", time.time()))
        metrics = [Metric(k, float(v), ms, step) for k, v in _numbers(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def event(self, name: str, step: int, info: dict) -> None:
        self.client.set_tag(self.run_id, f"{name}_step", str(step))
        for k, v in info.items():
            self.client.set_tag(self.run_id, f"{name}_{k}", str(v))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _jsonable(v):
    if hasattr(v, "item") and hasattr(v, "numel"):  # a one-element tensor
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN or infinity; "nan" / "inf" keep the line parseable
    return v
