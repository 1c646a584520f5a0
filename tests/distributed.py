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
