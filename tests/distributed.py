"""Run a function in N real processes with a gloo group; every run is bounded by a timeout.

Workers are forked (the parent already imported torch, so start-up costs milliseconds instead of
seconds); one spawned group runs many checks and returns their results to the parent to assert on.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_mod
import time
import socket
import traceback
from datetime import timedelta


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, queue, args, init=True):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        result = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # plain bytes: tensors must not travel as shared memory of a dying process
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run(fn, world: int, *args, timeout: float = 240.0, expect_errors: bool = False, init: bool = True):
    """``[fn(rank, world, *args) for each rank]`` run in ``world`` processes; raises on error or timeout.

    With ``expect_errors``, returns ``[("ok", result) | ("error", message)]`` instead of raising. With
    ``init=False`` the function initialises the process group itself (the environment is set up for it).
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, queue, args, init), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, status, value = queue.get(timeout=0.2)
                results[rank] = (status, value)
                continue
            except queue_mod.Empty:
                pass
            for r, p in enumerate(procs):  # a rank that died without reporting (os._exit, a signal)
                if r not in results and p.exitcode is not None and queue.empty():
                    time.sleep(0.2)
                    if queue.empty():
                        results[r] = ("error", f"process exited with code {p.exitcode} before reporting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed run of {fn.__name__} on {world} ranks did not finish in {timeout}s; "
                                   f"finished ranks: {sorted(results)}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    import torch

    ordered = [(s, torch.load(io.BytesIO(v), weights_only=False) if s == "ok" else v) for s, v in
               (results[r] for r in range(world))]
    if expect_errors:
        return ordered
    errors = [f"rank {r}: {v}" for r, (s, v) in enumerate(ordered) if s != "ok"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [v for _, v in ordered]


class CliResult:
    """What a forked ``shardplan`` command line returned: ``returncode``, ``stdout``, ``stderr`` (as
    ``subprocess.run(..., capture_output=True, text=True)`` would)."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _cli_worker(_rank, _world, args, cwd):
    import contextlib
    import sys

    from shardplan.cli import main
    if cwd is not None:
        os.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's errors and --help
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        sys.stdout.flush()
    return code, out.getvalue(), err.getvalue()


def cli(*args: str, cwd=None, timeout: float = 240.0) -> CliResult:
    """``shardplan ARGS`` in a process forked from this one (torch and the package already imported: no
    interpreter start-up, no imports again), as ``python -m shardplan ARGS`` would run it. A rehearsal's fake
    process group and the like stay in the fork. For what must be seen from a fresh interpreter (what an
    import loads), start one."""
    code, out, err = run(_cli_worker, 1, tuple(args), None if cwd is None else str(cwd), init=False,
                         timeout=timeout)[0]
    return CliResult(code, out, err)


def _script_worker(_rank, _world, path, args, cwd):
    import contextlib
    import runpy
    import sys

    if cwd is not None:
        os.chdir(cwd)
    sys.argv = [path, *args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def script(path: str, *args: str, cwd=None, timeout: float = 240.0) -> CliResult:
    """``python PATH ARGS`` (a benchmark or example script run as ``__main__``) in a process forked from this one,
    as :func:`cli` runs a command line."""
    code, out, err = run(_script_worker, 1, str(path), tuple(args), None if cwd is None else str(cwd), init=False,
                         timeout=timeout)[0]
    return CliResult(code, out, err)
