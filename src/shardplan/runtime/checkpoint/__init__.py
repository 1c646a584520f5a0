"""Distributed checkpoints that reshard: DCP state dicts described by the plan's per-rank boxes.

>>> sd = shardplan.checkpoint.state_dict(model, opt)            # {"model": {fqn: ...}, "optimizer": {...}}
>>> torch.distributed.checkpoint.save(sd, checkpoint_id=path)
>>> shardplan.checkpoint.save(path, model, opt, step=100)   # atomic: written aside, then published
>>> fut = shardplan.checkpoint.async_save(path, model, opt, step=100)  # the same, written in the background
>>> step = shardplan.checkpoint.load(path, model, opt)      # any world size, strategy, rules or units
>>> shardplan.checkpoint.save(path, model, opt, step=100, lr_scheduler=sched, dataloader=loader, rng=True,
...                           extra={"train_state": state})   # the whole run (load takes the same keywords)

One job per module:

* :mod:`.values` -- the model's and optimizer's state dicts for DCP (``state_dict``, ``load_state_dict``),
  each value converted by :mod:`shardplan.runtime.dcp_values` (``sharded_value``, which the functional
  face's trees use too);
* :mod:`.dcp_io` -- checkpoint directories: DCP save/load, atomic publish, the metadata check
  (``save``, ``load``, ``save_tree``, ``load_tree``);
* :mod:`.async_io` -- ``async_save``: host copies, DCP's background write, publish once every rank wrote
  (``async_save``, ``wait``, ``CheckpointFuture``);
* :mod:`.full` -- full (unsharded) export and import (``full_state_dict``, ``load_full_state_dict``);
* :mod:`.run_state` -- the rest of a run beside the model: lr scheduler, data loader position, generators per
  rank, the user's ``extra`` state (``RunState``; what ``save``/``async_save`` store and ``load`` restores);
* :mod:`.steps` -- a run's checkpoints: one directory per step, the newest complete one, the last K kept
  (``step_dir``, ``latest``, ``prune``);
* :mod:`.diagnose` -- what a checkpoint that does not fit holds instead, and how to load or convert it.

``model.state_dict()`` as DTensors (torch's module contract, FSDP2-style) is another job:
:mod:`shardplan.runtime.state_dict`.
"""

from .async_io import CheckpointFuture, async_save, wait
from .dcp_io import checkpoint_info, load, load_tree, save, save_tree
from .full import full_state_dict, load_full_state_dict
from .steps import latest, prune, step_dir
from .values import load_state_dict, sharded_value, state_dict

__all__ = ["save", "async_save", "wait", "CheckpointFuture", "load", "save_tree", "load_tree", "state_dict", "load_state_dict", "sharded_value",
           "full_state_dict", "load_full_state_dict", "checkpoint_info", "step_dir", "latest", "prune"]
