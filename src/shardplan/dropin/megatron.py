"""Megatron-FSDP's face: ``fully_shard_model`` (its arguments, honoured or refused naming them) and
``fully_shard_optimizer`` (its step and zero_grad arguments, DCP-ready optimizer states, the NaN check)."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import ShardingError
from ..planner import plan as make_plan
from ..planner.schedule import STRATEGIES
from ..runtime import collectives as C
from ..runtime import state_dict as SD
from ..runtime.api import engine_of, shard
from .common import _dim0_rules, _mesh_from, _unsupported


_NOT_OURS = dict(  # Megatron-FSDP arguments shardplan has no counterpart for, with the defaults it accepts
    hybrid_fsdp_expt_group=None, expt_device_mesh=None, calculate_per_token_loss=False, keep_fp8_transpose_cache=False,
    nccl_ub=False, fsdp_double_buffer=False, fsdp_db_use_persist_buf_on_alloc_fail=False,
    disable_symmetric_registration=False, enable_fine_grained_param_gather=False, disable_bucketing=False,
    overlap_grad_reduce=True, sync_model_each_microbatch=True,
)


def fully_shard_model(module: nn.Module, device_mesh: Optional[Any] = None, dp_shard_dim: Optional[str] = None,
                      dp_outer_dim: Optional[str] = None, tp_dim: Optional[str] = None,
                      hybrid_fsdp_group: Optional[Any] = None, fsdp_unit_modules: Optional[Sequence] = None,
                      zero_dp_strategy: Union[int, str] = 3, outer_dp_sharding_strategy: Union[int, str] = 0,
                      device: Optional[torch.device] = None,
                      init_model_with_meta_device: bool = False, grad_reduce_in_fp32: bool = False,
                      preserve_fp32_weights: bool = True, overlap_param_gather: bool = True,
                      preproc_state_dict_for_dcp_ckpt: bool = True, check_for_nan_in_grad: bool = True,
                      average_in_collective: bool = False, mixed_precision_policy: Optional[Any] = None,
                      **rest) -> nn.Module:
    """Megatron-FSDP's ``fully_shard_model`` (same argument names and meanings), built on one plan.

    >>> model = fully_shard_model(model, fsdp_unit_modules=[Block], zero_dp_strategy="optim_grads_params")

    ``zero_dp_strategy`` 0-3 or its names; ``device_mesh`` with ``dp_shard_dim`` (and ``dp_outer_dim`` for
    HSDP: replicated over it); ``fsdp_unit_modules`` classes or import paths. The model computes in its
    own dtype; with ``preserve_fp32_weights`` (or a policy's ``main_params_dtype=float32``) low-precision
    parameters are kept as fp32 masters and gathered in the model's dtype; ``grad_reduce_in_fp32`` (or
    ``grad_comm_dtype``) sets the reduction dtype. Returns the module, sharded in place; an argument
    shardplan cannot honour raises, naming it. Accepted either way, as they change nothing here:
    ``preproc_state_dict_for_dcp_ckpt`` (``model.state_dict()`` gives ``torch.chunk``-placed DTensors, which
    DCP takes without preprocessing), ``average_in_collective`` (gradients are averaged in the reduction,
    ``ReduceOp.AVG``, the same mean Megatron-FSDP's pre-division gives up to rounding) and
    ``init_model_with_meta_device`` (a model on the meta device is materialised unit by unit regardless).
    """
    where = "fully_shard_model"
    unknown = [k for k in rest if k not in _NOT_OURS]
    if unknown:
        raise ShardingError(f"{where}: unknown argument(s) {unknown}")
    _unsupported(where, **{k: (v, lambda v, d=_NOT_OURS[k]: v == d) for k, v in rest.items()},
                 outer_dp_sharding_strategy=(outer_dp_sharding_strategy, lambda v: v in (0, "no_shard")))
    level = STRATEGIES.index(zero_dp_strategy) if zero_dp_strategy in STRATEGIES else zero_dp_strategy
    if level not in (0, 1, 2, 3):
        raise ShardingError(f"{where}: zero_dp_strategy={zero_dp_strategy!r}; use 0-3 or one of {STRATEGIES}")
    shard_dim = dp_shard_dim or "fsdp"
    mesh = _mesh_from(device_mesh, shard_dim)
    if tp_dim is not None and tp_dim in mesh.axis_names and mesh.shape[tp_dim] > 1:
        raise ShardingError(f"{where}: tp_dim={tp_dim!r} has size {mesh.shape[tp_dim]}; tensor parallelism is not "
                            f"available through this entry point")
    if shard_dim not in mesh.axis_names:
        raise ShardingError(f"{where}: dp_shard_dim={shard_dim!r} is not a dimension of the mesh {mesh!r}")
    if dp_outer_dim is not None and dp_outer_dim not in mesh.axis_names:
        raise ShardingError(f"{where}: dp_outer_dim={dp_outer_dim!r} is not a dimension of the mesh {mesh!r}")
    if hybrid_fsdp_group is not None and dp_outer_dim is not None:
        want = mesh.axis_size((dp_outer_dim, shard_dim))
        if dist.get_world_size(hybrid_fsdp_group) != want:
            raise ShardingError(f"{where}: hybrid_fsdp_group has {dist.get_world_size(hybrid_fsdp_group)} ranks, "
                                f"dp_outer x dp_shard is {want}")
    if init_model_with_meta_device and level == 0:
        raise ShardingError(f"{where}: init_model_with_meta_device is not supported with the no_shard strategy "
                            f"(as in Megatron-FSDP)")
    compute, reduce = _megatron_dtypes(module, where, preserve_fp32_weights, grad_reduce_in_fp32, mixed_precision_policy)
    if device is not None and not init_model_with_meta_device:
        module.to(device)
    p = make_plan(module, _dim0_rules(shard_dim), mesh, strategy=level, units=list(fsdp_unit_modules or ()),
                  compute_dtype=compute, reduce_dtype=reduce, prefetch=1 if overlap_param_gather else 0,
                  min_unit_bytes=0, layout="chunked")  # DTensor state dicts, as Megatron-FSDP gives
    sharded = shard(module, p)
    engine_of(sharded).check_for_nan_in_grad = check_for_nan_in_grad
    return sharded


def _megatron_dtypes(module: nn.Module, where: str, preserve_fp32: bool, reduce_fp32: bool, policy):
    """(compute dtype, reduce dtype) from Megatron-FSDP's precision arguments; converts low-precision
    parameters to fp32 masters when they are to be preserved."""
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    model_dtype = dtypes.pop() if len(dtypes) == 1 else None
    main = torch.float32 if preserve_fp32 else None
    reduce = torch.float32 if reduce_fp32 else None
    if policy is not None:
        main = getattr(policy, "main_params_dtype", main)
        comm = getattr(policy, "grad_comm_dtype", None)
        reduce = comm if comm is not None else reduce
        grads = getattr(policy, "main_grads_dtype", None)
        if grads is not None and grads != (main or model_dtype):
            raise ShardingError(f"{where}: main_grads_dtype={grads} must equal the main parameters' dtype "
                                f"({main or model_dtype}): the local gradients are in the optimizer's dtype")
        accum = getattr(policy, "grad_accum_dtype", None)
        if accum is not None and accum not in (model_dtype, reduce):
            raise ShardingError(f"{where}: grad_accum_dtype={accum} is not supported: gradients accumulate in the "
                                f"compute dtype ({model_dtype}) and reduce in {reduce or model_dtype}; pass "
                                f"grad_accum_dtype=None")
    compute = None
    if main is not None and model_dtype is not None and model_dtype != main:
        if model_dtype.itemsize >= main.itemsize:
            raise ShardingError(f"{where}: main_params_dtype={main} is narrower than the model's {model_dtype}")
        compute = model_dtype
        module.to(main)  # fp32 masters: the shards the optimizer steps; gathered in the model's dtype
    return compute, reduce


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, preproc_state_dict_for_dcp_ckpt: bool = True) -> torch.optim.Optimizer:
    """Megatron-FSDP's ``fully_shard_optimizer``: checks the optimizer steps a sharded model's local shards
    and, if the model asked for ``check_for_nan_in_grad``, makes ``step`` refuse non-finite gradients.

    >>> optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters()))
    >>> dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)

    Every argument is honoured as Megatron-FSDP means it, or refused:

    * ``preproc_state_dict_for_dcp_ckpt=True``: ``optimizer.state_dict()`` is ready for DCP: its moments are
      DTensors over the model's mesh (as ``model.state_dict()`` gives the parameters), and
      ``optimizer.load_state_dict`` takes them back; ``False``: torch's own, this rank's local shards.
    * ``step(sync_grad_before_optimizer_step=...)``: either value. Megatron-FSDP waits for the gradient
      reduction only when the model does not sync by itself (``sync_model_each_microbatch=False``, refused by
      :func:`fully_shard_model`); shardplan's backward has always reduced the gradients before ``step``.
    * ``step(install_optimized_model_weights=True)``: the default; the next forward gathers the stepped
      shards. ``False`` (keep the model's weights stale until a later install) raises: the optimizer steps
      the shards the model gathers from, in place, so there is nothing to defer.
    * ``zero_grad(zero_grad_buffer=True)``: the default, ``zero_grad`` as usual; ``False`` (keep Megatron's
      separate gradient buffer) raises: the local shards' ``.grad`` are the only gradient buffer.
    """
    if not isinstance(preproc_state_dict_for_dcp_ckpt, bool):
        raise ShardingError(f"fully_shard_optimizer: preproc_state_dict_for_dcp_ckpt={preproc_state_dict_for_dcp_ckpt!r}"
                            f" must be True or False")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        raise ShardingError("fully_shard_optimizer: the optimizer has no parameters")
    engines = {id(e): e for e in (getattr(p, "_shardplan_engine", lambda: None)() for p in params) if e is not None}
    if len(engines) != 1 or any(getattr(p, "_shardplan_engine", None) is None for p in params):
        raise ShardingError("fully_shard_optimizer: build the optimizer on model.parameters() after "
                            "fully_shard_model(model, ...) (its parameters are then the local shards)")
    eng = next(iter(engines.values()))
    base_step, base_zero_grad = type(optimizer).step, type(optimizer).zero_grad

    def step(self, *args, sync_grad_before_optimizer_step: bool = True, install_optimized_model_weights: bool = True,
             **kwargs):
        # [Note: sync_grad_before_optimizer_step is accepted either way: gradients were reduced by backward]
        if install_optimized_model_weights is not True:
            raise ShardingError("optimizer.step: install_optimized_model_weights=False is not supported by shardplan: "
                                "the optimizer steps the shards the model gathers from, in place, so the next "
                                "forward always uses the new weights; call step() without it")
        if getattr(eng, "check_for_nan_in_grad", False):
            _check_finite(eng, params)
        return base_step(self, *args, **kwargs)

    def zero_grad(self, *args, zero_grad_buffer: bool = True, **kwargs):
        if zero_grad_buffer is not True:
            raise ShardingError("optimizer.zero_grad: zero_grad_buffer=False is not supported by shardplan: the local "
                                "shards' .grad are the only gradient buffer; call zero_grad() without it")
        return base_zero_grad(self, *args, **kwargs)

    optimizer.step = step.__get__(optimizer)
    optimizer.zero_grad = zero_grad.__get__(optimizer)
    optimizer.__dict__["_shardplan_dtensor_state"] = preproc_state_dict_for_dcp_ckpt
    if preproc_state_dict_for_dcp_ckpt:
        SD.install_optimizer(optimizer, eng)
    else:  # Megatron-FSDP's opt-out: torch's own state dict (this rank's local shards), no DTensor hooks later
        optimizer._shardplan_dcp_hooks = True
    return optimizer


def _check_finite(eng, params) -> None:
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel()]
    bad = torch.zeros((), device=eng.device)
    if grads:
        bad = (~torch.stack([g.isfinite().all() for g in grads])).any().float()
    C.all_reduce(bad, eng.groups.world, async_op=False, op=dist.ReduceOp.MAX)
    if bad.item():
        names = {id(lp): n for n, lp in eng.local_params().items()}
        local = [names.get(id(p), "?") for p in params if p.grad is not None and not p.grad.isfinite().all()]
        raise FloatingPointError(f"fully_shard_optimizer: non-finite gradients (check_for_nan_in_grad=True); "
                                 f"on this rank: {local[:5] or 'none (another rank)'}")
