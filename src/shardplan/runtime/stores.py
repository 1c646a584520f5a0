"""Ranks talking through the rendezvous store, not through a collective: the start-up exchange (a rank that
fails a check, or never arrives, ends every rank within the runtime's timeout instead of the process group's)
and the one error report per run (``sp.run_main``: which rank failed first, told to the others)."""

from __future__ import annotations

import itertools
import json
import os
import time
from datetime import timedelta

import torch.distributed as dist

from ..errors import RuntimeShardingError

_ROUND = itertools.count()


def _store():
    return dist.distributed_c10d._get_default_store()


def exchange(report: dict, timeout_s: float) -> list[dict]:
    """Every rank's ``report`` (JSON-able), through the rendezvous store, bounded by ``timeout_s``.

    Raises :class:`RuntimeShardingError` naming the ranks that did not report in time.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return [report]
    store = _store()
    prefix = f"shardplan/startup/{next(_ROUND)}/"
    keys = [f"{prefix}{r}" for r in range(world)]
    store.set(keys[rank], json.dumps(report))
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - a timeout, whatever the store type calls it
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise RuntimeShardingError(
            f"shardplan.shard(): rank(s) {missing} did not reach shard() within {timeout_s:g} s ({exc}); they "
            f"failed or hang before it. Every rank must call shard() with the same plan") from None
    return [json.loads(store.get(k)) for k in keys]


# -- one error report per run (sp.run_main) ----------------------------------------------------------------

def error_store(timeout_s: float):
    """``(store, key prefix)`` through which ranks tell each other about an error, or ``(None, "")``.

    Under torchrun (its agent hosts the rendezvous store) a client of that store, usable before and after
    ``init_process_group`` alike; otherwise the default process group's store. Nothing here is a collective:
    a rank that never reports is waited for at most ``timeout_s``.
    """
    run = f"shardplan/error/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/" \
          f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and addr and port:
        try:
            return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s)), run
        except Exception:  # noqa: BLE001 - the agent is gone: report without it
            pass
    if dist.is_available() and dist.is_initialized():
        return _store(), run
    return None, ""


def store_wait(store, keys: list[str], timeout_s: float, poll_s: float = 0.02) -> bool:
    """Whether every key was set within ``timeout_s`` (polled: a store's own timed wait logs a warning
    when it expires, and an expiry is an expected answer here)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if store.check(keys):
                return True
        except Exception:  # noqa: BLE001 - the store's host is gone
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def store_posted(store, keys: list[str]) -> list[str]:
    """The keys of ``keys`` that are set now."""
    try:
        return [k for k in keys if store.check([k])]
    except Exception:  # noqa: BLE001
        return []

