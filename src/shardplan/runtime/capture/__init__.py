"""``shardplan.capture``: a whole training step captured once and replayed, as JAX's ``jit``.

>>> step = sp.capture(train_step)          # train_step(batch...) -> loss: forward, backward, clip, opt.step()
>>> for x, y in data:
...     loss = step(x, y)                 # warm-up calls run eagerly; then one capture; then replays

The first ``warmup`` calls for a batch signature run ``fn`` eagerly (they are real training steps: the
optimizer's state is created, kernels are chosen). The next call captures ``fn`` into a CUDA graph (every op
of every sharded model's schedule, on its streams, the loss, the backward, the optimizer) and replays it; every
later call with the same signature copies the batch into the graph's static inputs and replays, running no
Python per unit. Nothing falls back silently: a plan that cannot be captured (``plan.capture_blockers``), a
step that reads the host, or a step that uses other parameters from one warm-up step to the next raises
:class:`~shardplan.errors.CaptureError` naming why and the fix.

What changes between steps must live on the device: torch optimizers with ``capturable=True`` and a tensor
``lr`` (``sp.optim.as_lr_scheduler`` and torch's schedulers update it in place), ``sp.optim`` optimizers keep
their step count on the parameters' device and evaluate schedules there.

Outputs are the graph's own tensors, overwritten by the next replay (clone what you keep; the eager backend
writes its replays' outputs into the same tensors), as
``torch.cuda.make_graphed_callables``' are. Arguments in ``donate_argnums`` become the graph's inputs
themselves (no copy: a functional step that returns them updated in place, ``opt.update(..., donate=True)``,
needs no copy per step); the others are copied into static buffers before each replay, skipped when the
caller passes the buffer itself back. ``backend="eager"`` runs every call eagerly with the same checks and
buffers (CPU, debugging): it is never chosen for you.

The package, one job a module: ``step.py`` (``CapturedStep``: calls by signature, warm-up, capture, replay),
``session.py`` (what one call saw, the runtime's hooks into it, the call's signature), ``graph.py`` (the graph
and its segments), ``checks.py`` (what must hold between replays), ``offloaded.py`` (CPU-offloaded models around
the capture and its replays).
"""

from __future__ import annotations

from .graph import Phase
from .session import as_graph, capturing, host_call, loads_afresh, note_check, note_forward, note_unused
from .step import BACKENDS, ERROR, RECAPTURE, CapturedStep, capture

__all__ = ["BACKENDS", "ERROR", "RECAPTURE", "CapturedStep", "Phase", "as_graph", "capture", "capturing",
           "host_call", "loads_afresh", "note_check", "note_forward", "note_unused"]
