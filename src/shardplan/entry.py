"""``run_main``: a training script's entry point under torchrun, with one clear error message per run.

>>> if __name__ == "__main__":
...     sp.run_main(main)            # instead of main() or @record-decorated main()

A shardplan error (or ``SystemExit("message")``) raised on every rank is printed once, by rank 0, as the
error's text (which says how to fix it) without a traceback, after everything else the ranks printed; the
process exits with status 1 and torchrun's summary names it. A rank whose error differs from rank 0's, or
whose rank 0 does not report within a few seconds (it failed otherwise, or waits in a collective), prints
its own; a rank whose collective then fails because of it says so in one line. Any other exception is
left to torchrun's conventions: ``@record`` writes it, traceback included, to the error file torchrun
reads (``TORCHELASTIC_ERROR_FILE``), and Python prints the traceback. ``SHARDPLAN_TRACEBACK=1`` prints
shardplan errors' tracebacks too.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Callable

from .errors import CollectiveError, ShardingError
from .runtime import collectives as C
from .runtime import stores

WAIT_FOR_RANK0_S = 3.0   # how long another rank waits for rank 0's report before printing its own
WAIT_FOR_OTHERS_S = 1.0  # how long rank 0 waits to learn which ranks raised the same error
WAIT_FOR_ECHO_S = 2.0  # how long a rank with another exception looks for another rank's reported error
RANK0_EXITS_FIRST_S = 1.0  # how long another rank with rank 0's error waits before exiting (torchrun stops it sooner)


def run_main(main: Callable[..., Any], *args, **kwargs) -> Any:
    """``main(*args, **kwargs)`` under torchrun's error conventions, with shardplan errors reported once.

    >>> sp.run_main(main)
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    def guarded():
        try:
            return main(*args, **kwargs)
        except (ShardingError, CollectiveError) as exc:
            report(f"{type(exc).__name__}: {exc}", exc)
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                raise
            report(str(exc.code), exc)
        except Exception as exc:  # noqa: BLE001 - anything else is torchrun's to record, unless it is an echo
            if not _echo_of_another_rank(exc):
                raise
        raise SystemExit(1)

    return record(guarded)()


def _echo_of_another_rank(exc: BaseException) -> bool:
    """Whether ``exc`` (a collective that failed, most likely) follows another rank's reported error: that
    rank prints the cause, so this one says so in one line instead of a traceback."""
    rank, world = _rank()
    if world == 1:
        return False
    store, prefix = stores.error_store(timeout_s=WAIT_FOR_RANK0_S)
    if store is None:
        return False
    others = [f"{prefix}{r}" for r in range(world) if r != rank]
    deadline = time.monotonic() + WAIT_FOR_ECHO_S
    failed: list[str] = []
    while not failed and time.monotonic() < deadline:  # the failing rank posts before it drops its connections
        failed = stores.store_posted(store, others)
        time.sleep(0.02)
    if not failed:
        return False
    ranks = [int(k[len(prefix):]) for k in failed]
    first = (str(exc).splitlines() or [""])[0]
    first = first if len(first) <= 120 else first[:117] + "..."
    print(f"[rank{rank}]: shardplan: stopped because rank {_ranges(ranks)} failed (its message is printed by "
          f"that rank); here: {type(exc).__name__}: {first}", file=sys.stderr, flush=True)
    if os.environ.get("SHARDPLAN_TRACEBACK") == "1":
        traceback.print_exception(exc)
    _error_file(f"stopped because rank {_ranges(ranks)} failed: {type(exc).__name__}: {exc}", _where(exc),
                int(time.time()) + 1, shown=f"stopped because rank {_ranges(ranks)} failed")
    C.shutdown()
    return True


def _where(exc: BaseException) -> str:
    """``file:line in function`` of the frame that raised ``exc``."""
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return ""
    f = tb[-1]
    name = f.filename
    if not name.startswith("<") and not os.path.relpath(name).startswith(".."):
        name = os.path.relpath(name)
    return f"{name}:{f.lineno} in {f.name}"


def _rank() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def report(text: str, exc: BaseException) -> None:
    """Print ``text`` once for the run (see the module's docstring) and write torchrun's error file."""
    rank, world = _rank()
    sys.stdout.flush()
    store, prefix = stores.error_store(timeout_s=WAIT_FOR_RANK0_S) if world > 1 else (None, "")
    where = _where(exc)
    tb = "".join(traceback.format_exception(exc)) if os.environ.get("SHARDPLAN_TRACEBACK") == "1" else ""
    if store is not None:
        try:
            store.set(f"{prefix}{rank}", text)
        except Exception:  # noqa: BLE001 - the store is gone (its host exited): report alone
            store = None
    if rank == 0:
        same = [0]
        if store is not None:
            others = [f"{prefix}{r}" for r in range(1, world)]
            stores.store_wait(store, others, WAIT_FOR_OTHERS_S)
            same += [r for r, k in zip(range(1, world), others) if store.check([k]) and store.get(k).decode() == text]
        ranks = "every rank" if len(same) == world and world > 1 else f"rank {_ranges(same)}" if len(same) > 1 \
            else "rank 0"
        _print(text, f"on {ranks}", where, tb)
        stamp = int(time.time())
        _error_file(text, where, stamp)
        C.shutdown()
        if store is not None:
            try:
                store.set(f"{prefix}printed", str(stamp))
            except Exception:  # noqa: BLE001
                pass
        return
    printed = store is not None and stores.store_wait(store, [f"{prefix}printed"], WAIT_FOR_RANK0_S)
    if printed and store.get(f"{prefix}0").decode() == text:
        # rank 0 reported it: this rank's error file points there, with rank 0's time so that torchrun's
        # summary names rank 0 as the root cause; then rank 0 gets the moment it needs to exit first
        _error_file(text, where, int(store.get(f"{prefix}printed").decode()), same_as_rank0=True)
        C.shutdown()
        time.sleep(RANK0_EXITS_FIRST_S)
        return
    _print(text, f"on rank {rank}", where, tb, prefix=f"[rank{rank}]: ")
    _error_file(text, where, int(time.time()))
    C.shutdown()


def _ranges(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks) if len(ranks) < 6 else f"{ranks[0]}-{ranks[-1]}"


def _print(text: str, ranks: str, where: str, tb: str, prefix: str = "") -> None:
    lines = [f"shardplan: error {ranks}" + (f" (raised at {where})" if where else "") + ":", *text.splitlines()]
    if tb:
        lines += ["", *tb.rstrip().splitlines()]
    elif where:
        lines.append("(SHARDPLAN_TRACEBACK=1 prints the traceback)")
    print("\n".join(prefix + line for line in lines), file=sys.stderr, flush=True)


def _error_file(text: str, where: str, stamp: int, same_as_rank0: bool = False, shown: str = "") -> None:
    """torchrun's error file (the format ``@record`` writes): the whole message, and a short root cause for
    torchrun's summary (the message itself was printed once already)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    first = text.splitlines()[0] if text else ""
    first = first if len(first) <= 200 else first[:197] + "..."
    if not shown:
        shown = "the same error as rank 0" if same_as_rank0 else \
            f"{first}\n(the whole message is printed above by this rank; raised at {where})"
    data = {"message": {"message": text, "extraInfo": {"py_callstack": shown, "timestamp": str(stamp)}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass
