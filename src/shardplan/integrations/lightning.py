"""Lightning: a ``LightningModule`` trained by shardplan rules, chosen in the ``Trainer``'s configuration.

>>> from shardplan.integrations.lightning import ShardplanStrategy
>>> trainer = L.Trainer(strategy=ShardplanStrategy([(r".*", sp.P("dp"))], units=[r"model\\.layers\\.\\d+"]),
...                     accelerator="cpu", devices=2, accumulate_grad_batches=2, gradient_clip_val=1.0)
>>> trainer.fit(module)           # the LightningModule as it is: no configure_model, no wrapping

The strategy plans the module's parameters under their own names (``sp.plan``), prints the plan on rank 0,
shards the module (``sp.shard``), and only then lets Lightning call ``configure_optimizers``, so the optimizer
steps the local shards. Gradient accumulation skips the reductions of the accumulating micro-steps
(``sp.no_sync``); ``gradient_clip_val`` clips by the global norm; ``trainer.save_checkpoint`` and
``ModelCheckpoint`` write a shardplan checkpoint directory (``sp.checkpoint.save``: resharding, atomic) that
``fit(ckpt_path=...)`` resumes. Needs Lightning (``pip install shardplan[lightning]``); docs/integrations.md.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generator, Optional, Sequence

import torch
import torch.nn as nn

from ..errors import CheckpointError, ShardingError
from ..mesh import Mesh
from ..planner import Plan, plan as make_plan
from ..runtime import collectives as C
from ..runtime.api import no_sync, shard
from ..runtime.checkpoint import dcp_io

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
    from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
except ImportError as exc:  # the optional extra
    raise ShardingError("shardplan.integrations.lightning needs Lightning, which is not installed: "
                        "pip install 'shardplan[lightning]' (or pip install 'lightning>=2.4')") from exc

__all__ = ["ShardplanStrategy"]

_EXTRA = "lightning"  # the key of Lightning's own checkpoint entries (loops, callbacks, ...) in the checkpoint


class _Root(nn.Module):
    """What shardplan plans and shards: the LightningModule's parameters, buffers and children under their own
    names, with a forward that calls the LightningModule.

    [Note: why not the LightningModule itself] Lightning runs ``training_step`` by calling the strategy's
    model (its "forward redirection": the LightningModule's ``forward`` patched for one call to run the step),
    and a ``training_step`` may call ``self(x)`` again inside. Sharded directly, the module's root hooks would
    fire twice in one step (the step, then the inner forward), or never (when the step calls ``self.model(x)``
    on a child). This module holds the LightningModule's own ``_parameters``, ``_buffers`` and ``_modules``
    dicts (the same dict objects, not copies), so the plan's names are the user's names and a shard installed
    here is the LightningModule's parameter too; its root hooks fire once per step, around the whole step."""

    def __init__(self, module: nn.Module):
        super().__init__()
        d = self.__dict__
        for attr in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            d[attr] = module.__dict__[attr]
        d["_lightning_module"] = module  # not a child: its children are this module's

    def forward(self, *args, **kwargs):
        return self._lightning_module(*args, **kwargs)


class ShardplanStrategy(ParallelStrategy):
    """A Lightning strategy that shards the ``LightningModule`` by shardplan rules.

    >>> trainer = L.Trainer(strategy=ShardplanStrategy([(r".*", sp.P("dp"))]), accelerator="cpu", devices=2)

    ``rules``, ``mesh`` (default: ``sp.Mesh(dp=world size)``), ``units`` and ``**plan_options``
    (``strategy="optim_grads"``, ``compute_dtype="bfloat16"``, ``min_unit_bytes=0``, ...) are
    :func:`shardplan.plan`'s, applied to the module's parameter names. ``print_plan`` prints the plan on rank 0
    at setup. Data-parallel meshes only (ZeRO-1/2/3, HSDP): with ``compute_axes`` every rank of a compute group
    needs the same batch, which Lightning's sampler does not give; use :func:`shardplan.shard` in your own loop.
    Processes come from ``torchrun`` (or any launcher that sets ``LOCAL_RANK``) or, without one, from
    Lightning's own re-launch of the script (as ``strategy="ddp"`` does).
    """

    strategy_name = "shardplan"

    def __init__(self, rules, mesh: Optional[Mesh] = None, *, units: Optional[Sequence] = None,
                 print_plan: bool = True, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = timedelta(seconds=1800), **plan_options: Any) -> None:
        super().__init__()
        if plan_options.get("compute_axes"):
            raise ShardingError(
                f"ShardplanStrategy(compute_axes={plan_options['compute_axes']!r}): the Lightning strategy trains "
                f"data-parallel plans only (every rank of a tensor-, context- or expert-parallel group needs the same "
                f"batch, which Lightning's distributed sampler does not give). Fix: leave compute_axes out, or call "
                f"shardplan.shard in your own training loop")
        if "world_size" in plan_options:
            raise ShardingError("ShardplanStrategy(world_size=...): the world is the Trainer's (num_nodes x devices); "
                                "leave world_size out")
        self.rules = rules
        self.mesh = mesh
        self.units = units
        self.plan_options = plan_options
        self.print_plan = print_plan
        self.plan: Optional[Plan] = None
        self._root: Optional[_Root] = None
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1

    # -- processes ------------------------------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """[Note: Lightning asks this of strategies it does not know] ``True`` makes it give each rank its own
        slice of the data (a ``DistributedSampler``); without it every rank would train on the same batches."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        self._process_group_backend = (self._process_group_backend
                                       or _get_default_process_group_backend_for_device(self.root_device))
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)

    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            C.barrier(C.world())

    def broadcast(self, obj, src: int = 0):
        if not _distributed_is_initialized():
            return obj
        if src != 0:
            raise ShardingError(f"ShardplanStrategy.broadcast(src={src}): only rank 0 broadcasts")
        return C.broadcast_object(obj, C.world().pg)

    # -- the model ------------------------------------------------------------------------------------------

    @property
    def sharded_module(self) -> Optional[nn.Module]:
        """The module :func:`shardplan.shard` sharded (pass it to ``sp.clip_grad_norm_``, ``sp.record_ops``,
        ``sp.checkpoint``); its parameters are the LightningModule's."""
        return self._root

    def make_plan(self, module: nn.Module) -> Plan:
        """The plan of ``module`` (the LightningModule, under its own parameter names) on this run's world."""
        world = self.num_nodes * self.num_processes
        mesh = self.mesh if self.mesh is not None else Mesh(dp=world)
        if mesh.size != world:
            raise ShardingError(f"ShardplanStrategy(mesh={mesh}): {mesh.size} ranks, but the Trainer runs {world} "
                                f"processes (num_nodes={self.num_nodes} x devices={self.num_processes}). Fix: a mesh of "
                                f"{world} ranks, or leave mesh out for Mesh(dp={world})")
        return make_plan(_Root(module), self.rules, mesh, units=self.units, **self.plan_options)

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        lm = self.lightning_module
        if self._root is None or self._root._lightning_module is not lm:
            self.precision_plugin.convert_module(lm)
            lm.to(self.root_device)
            self.plan = self.make_plan(lm)
            if self.print_plan and self.global_rank == 0:
                print(self.plan)
            root = _Root(lm)
            shard(root, self.plan)
            self._root = root
        self.model = self._root
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)  # configure_optimizers now sees the local shards
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        if self._root is None and self.lightning_module is not None:
            self.lightning_module.to(self.root_device)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's accumulating micro-steps (``accumulate_grad_batches``): no reduction until the last."""
        if self._root is None:
            yield None
            return
        with no_sync(self._root):
            yield None

    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"):
        # Lightning's metric reduction (self.log(..., sync_dist=True)), as its DDP strategy does it
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op) if isinstance(tensor, torch.Tensor) else tensor

    def teardown(self) -> None:
        # [Note: no .cpu()] Lightning's default moves the LightningModule to the CPU here, which would detach the
        # parameters from the shards the runtime gathers from; the sharded module stays where it trained
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # -- checkpoints ----------------------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the module is sharded and the optimizer built when the checkpoint loads into them

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restored it

    def _optimizer(self):
        if len(self.optimizers) > 1:
            raise CheckpointError(f"ShardplanStrategy checkpoints hold one optimizer; configure_optimizers returned "
                                  f"{len(self.optimizers)}. Fix: one optimizer over parameter groups")
        return self.optimizers[0] if self.optimizers else None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing: :meth:`save_checkpoint` saves the model from its shards (``sp.checkpoint.save``)."""
        return {}

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return {}  # saved with the model by save_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """A shardplan checkpoint directory at ``filepath`` (loads at any world size, rules or units), holding
        Lightning's entries (loops, callbacks, lr schedulers, hyper-parameters) beside the model and optimizer."""
        if storage_options is not None:
            raise CheckpointError("ShardplanStrategy.save_checkpoint(storage_options=...): shardplan writes its "
                                  "own checkpoint directory; leave storage_options out")
        if self._root is None:
            raise CheckpointError("ShardplanStrategy.save_checkpoint before setup: nothing is sharded yet")
        path = str(self.broadcast(str(filepath)))
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        dcp_io.save(path, self._root, self._optimizer(), step=int(checkpoint.get("global_step", 0)),
                    extra={_EXTRA: rest})

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a checkpoint :meth:`save_checkpoint` wrote into the sharded module (and the optimizer, when
        fitting); returns Lightning's entries."""
        if self._root is None:
            raise CheckpointError("ShardplanStrategy.load_checkpoint before setup: nothing is sharded yet")
        path = str(self.broadcast(str(checkpoint_path)))
        if dcp_io.checkpoint_info(path) is None:
            raise CheckpointError(f"{path} is not a finished shardplan checkpoint directory (no completion marker): "
                                  f"ShardplanStrategy loads what it saved (trainer.save_checkpoint, ModelCheckpoint). "
                                  f"For a Lightning .ckpt file of a full model, load its state_dict into the "
                                  f"LightningModule before trainer.fit")
        extra: dict = {_EXTRA: None}
        dcp_io.load(path, self._root, self._optimizer(), extra=extra)
        return dict(extra[_EXTRA])

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the shards

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # load_checkpoint loaded the optimizer
