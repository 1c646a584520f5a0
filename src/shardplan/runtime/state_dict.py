"""``model.state_dict()`` of a sharded module as FSDP2 gives it: DTensors, so that torch's checkpoint code
(``torch.distributed.checkpoint``, ``get_model_state_dict``, ``set_model_state_dict``) reshards correctly.

A parameter's value is a DTensor over a ``DeviceMesh`` of the plan's mesh (one dimension per axis, named
like it): ``Shard(d)`` on an axis that shards dim ``d``, ``Replicate()`` elsewhere, its local tensor a
view of this rank's shard (zero copy: DCP loads straight into the shards). That is possible only where
DTensor's placement semantics (``torch.chunk`` per sharded dim, mesh dims left to right) give every rank
exactly the box the plan gives it (``plan.local_slices``): always with ``layout="chunked"`` (what
``shardplan.fully_shard`` plans), rarely with the contiguous layout ``"auto"`` picks for dim-0 specs.
Otherwise ``model.state_dict()`` raises :class:`CheckpointError` naming the parameter and the way out.

``model.load_state_dict`` takes DTensors (any mesh or placement: redistributed or gathered), full plain
tensors (what ``set_model_state_dict`` hands it) and this rank's plain local shards, for any layout.
Both conversions are :mod:`.dcp_values`'s (the one converter shardplan's own checkpoints use too); this
module installs them as the module's and optimizer's state-dict hooks. An optimizer's states follow the same
rule where DTensors describe the layout; elsewhere ``optimizer.state_dict()`` gives this rank's local shards,
marked so that they load back only onto the same shards and DCP refuses them (:mod:`.local_optim_state`).
"""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import Optional

import torch
import torch.nn as nn

from ..errors import CheckpointError
from . import collectives as C
from .dcp_values import describe, dtensor_piece, dtensor_value, local_box
from .dtensor_params import plain
from .local_optim_state import WAYS_OUT as _WAYS_OUT, adopt_loaded, mark, unmark
from .tensor_parallel import full_device_mesh


class StateDictHooks:
    """The module hooks that give and take DTensor state dicts for one sharded module."""

    def __init__(self, exe, meshes: Optional[dict] = None):
        self.exe = exe
        self.plan = exe.plan
        self.layout = describe(self.plan)
        self.bad = next((n for n, (pl, _) in self.layout.items() if pl is None), None)
        self._meshes = meshes or {}
        self._mesh = None
        _LIVE.add(self)
        if self.bad is None and any(exe.groups.axis(a).pg is None for a in self.plan.mesh.axis_names) \
                and self.plan.mesh.size > 1:
            self._mesh = self._device_mesh(self._meshes)  # an axis of one rank has no group: build it now, on every rank
        if self.bad is None:
            mesh_shape = [s for _, s in self.plan.mesh.axes]
            coord = [self.plan.mesh.axis_index(exe.rank, (a,)) for a in self.plan.mesh.axis_names]
            self.local_shape = {n: dtensor_piece(self.plan.param(n).global_shape, mesh_shape, coord, pl)[0]
                                for n, (pl, _) in self.layout.items()}

    @property
    def mesh(self):
        """The DeviceMesh the state dict's DTensors live on (``None`` where a parameter cannot be one).

        [Note: built at first use, from process groups the runtime already has (``DeviceMesh.from_group``
        needs no collective, so one rank alone may call ``state_dict()``), and released at interpreter exit
        (:func:`_release_meshes`): a gloo DeviceMesh still alive while Python finalises aborts the process
        ("terminate called without an active exception"), one run in three.]"""
        if self._mesh is None and self.bad is None:
            self._mesh = self._device_mesh(self._meshes)
        return self._mesh

    def _device_mesh(self, meshes: dict):
        from torch.distributed.device_mesh import DeviceMesh
        for m in meshes.values():  # tensor parallelism built one already: its slices share the root
            root = m._get_root_mesh() if hasattr(m, "_get_root_mesh") else None
            if root is not None and root.mesh_dim_names == C.mesh_dim_names(self.plan.mesh.axis_names):
                return root
        mesh = self.plan.mesh
        groups = [self.exe.groups.axis(a).pg for a in mesh.axis_names]
        if mesh.size == 1 or any(g is None for g in groups):
            return full_device_mesh(self.plan, self.exe.device)  # a group of one has no process group: build one
        shape = [s for _, s in mesh.axes]
        return DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], self.exe.device.type,
                                     mesh=torch.arange(mesh.size).view(shape),
                                     mesh_dim_names=C.mesh_dim_names(mesh.axis_names))

    def _refuse(self, name: str) -> CheckpointError:
        why = self.layout[name][1]
        return CheckpointError(f"model.state_dict(): parameter {name!r} cannot be given as a DTensor: {why}. "
                               f"To checkpoint this model, {_WAYS_OUT}")

    def _hosted(self, name: str) -> None:
        """offload="params" keeps the shard of ``name`` in host memory (the local parameter has no storage
        between gathers): refuse, naming the checkpoint functions that read and write the host copy."""
        off = getattr(self.exe, "offload", None)
        if off is not None:  # host steps still running (they overlap the next forward) finish first
            off.settle()
        if off is not None and name in off.values:
            raise CheckpointError(f"model.state_dict() / load_state_dict(): parameter {name!r} lives in host memory "
                                  f"(offload='params'); use shardplan.checkpoint.save / load (or "
                                  f"shardplan.checkpoint.full_state_dict / load_full_state_dict), which read and write it there")

    # -- state_dict --------------------------------------------------------------------------------------
    def value(self, name: str, lp: torch.Tensor) -> torch.Tensor:
        """This rank's shard ``lp`` of ``name`` as a DTensor view (zero copy: ``dcp_values.dtensor_value``)."""
        from torch.distributed.tensor import DTensor
        if isinstance(lp, DTensor):  # a DTensor parameter already (dtensor_params.py), or a DTensor optimizer state
            return lp.detach()
        if self.mesh is None:
            raise self._refuse(name if self.layout[name][0] is None else self.bad)
        self._hosted(name)
        p = self.plan.param(name)
        return dtensor_value(lp, self.mesh, self.layout[p.name][0], p.global_shape, self.local_shape[p.name])

    # -- load_state_dict ---------------------------------------------------------------------------------
    def local_value(self, name: str, key: str, v, lp: torch.Tensor):
        """What ``load_state_dict`` copies into ``lp`` for a saved value ``v``: this rank's box of it
        (``dcp_values.local_box``)."""
        return local_box(self.plan, self.exe.rank, name, key, v, lp, self.mesh, self.layout[self.plan.param(name).name][0])

    # -- installation ------------------------------------------------------------------------------------
    def install(self, module: nn.Module) -> list:
        """Hooks on every module that owns parameters (each converts its own, under whatever prefix the
        call gives it: ``model.state_dict()`` and ``model.layers[0].state_dict()`` alike)."""
        locals_ = self.exe.local_params()
        name_of = {id(lp): n for n, lp in locals_.items()}
        handles = []
        for m in module.modules():
            own = {attr: name_of[id(prm)] for attr, prm in m._parameters.items()
                   if prm is not None and id(prm) in name_of}
            if own:
                handles.append(m.register_state_dict_post_hook(self._save_hook(own, locals_)))
                handles.append(m.register_load_state_dict_pre_hook(self._load_hook(own, locals_)))
        return handles

    def _save_hook(self, own: dict, locals_: dict):
        def hook(_module, sd, prefix, _meta):
            for attr, name in own.items():
                if prefix + attr in sd:
                    sd[prefix + attr] = self.value(name, locals_[name])
        return hook

    def _load_hook(self, own: dict, locals_: dict):
        def hook(module, sd, prefix, meta, _strict, _missing, _unexpected, _errors):
            from torch.distributed.tensor import DTensor
            hit = [attr for attr in own if prefix + attr in sd]
            if not hit:
                return
            if (meta or {}).get("assign_to_params_buffers"):
                raise CheckpointError("load_state_dict(assign=True) would replace the local shards the runtime "
                                      "gathers from; load without assign=True")
            if any(module._parameters.get(a) is not locals_[own[a]] for a in hit):
                # [Note: a unit is still gathered (a forward without backward, or ZeRO-1/2's kept last unit):
                # torch copies into whatever the module holds, so hand the modules their shards back first,
                # as the next forward would (local work only)]
                self.exe._abandon()
            for attr in hit:
                self._hosted(own[attr])
            for attr in hit:
                name = own[attr]
                lp = locals_[name]
                v = self.local_value(name, prefix + attr, sd[prefix + attr], plain(lp))
                if lp is not plain(lp) and isinstance(v, torch.Tensor):  # DTensor parameters take DTensors
                    v = DTensor(v.detach().reshape(self.local_shape[name]), lp._spec, requires_grad=False)
                sd[prefix + attr] = v
            # [Note: torch copies into the shards right after this hook; marking first is fine, the flag is
            # read at the next forward]
            self.exe.mark_shards_changed()
        return hook


_LIVE: "weakref.WeakSet[StateDictHooks]" = weakref.WeakSet()


@atexit.register
def _release_meshes() -> None:
    """Drop the DeviceMeshes the state-dict hooks built, before the interpreter finalises (see ``mesh``)."""
    for hooks in list(_LIVE):
        hooks._mesh = None
    gc.collect()


def install(module: nn.Module, exe, meshes: Optional[dict] = None) -> list:
    """Make ``module.state_dict()`` / ``load_state_dict`` speak DTensor for ``exe``'s plan; returns the handles."""
    if getattr(exe, "state_dict_hooks", None) is None:  # (shard() makes it before installing DTensor parameters)
        exe.state_dict_hooks = StateDictHooks(exe, meshes)  # the optimizer's hooks (install_optimizer) reuse its mesh
    return exe.state_dict_hooks.install(module)


def install_torch_optimizer(optimizer: torch.optim.Optimizer, exe) -> list:
    """For a plain torch optimizer over a sharded model's local shards (installed at its first ``step()``, which
    torch's ``get_state_dict`` itself runs on a fresh optimizer): :func:`install_optimizer`'s hooks.

    [Note: without them, torch's helpers hand DCP plain tensors that differ per rank; DCP takes a plain
    tensor for a replicated value and keeps one rank's copy, so a load at the same world size gives every
    rank rank 0's moments, silently (and ``full_state_dict=True`` returns local shards as if full). So the
    states are DTensors where the plan's layout allows it, as FSDP2's are, and elsewhere this rank's shards
    marked as such: torch's optimizer contract holds (``load_state_dict(state_dict())``, ``deepcopy``, a
    per-rank ``torch.save``), and the marker refuses DCP and a load where this rank holds other elements.]
    """
    if getattr(optimizer, "_shardplan_dcp_hooks", False) or getattr(exe, "dtensor_params", False):
        return []  # (DTensor parameters: the optimizer's states are DTensors already, as FSDP2's)
    return install_optimizer(optimizer, exe)


def install_optimizer(optimizer: torch.optim.Optimizer, exe) -> list:
    """Make ``optimizer.state_dict()`` give its sharded states as DTensors where the plan's layout is DTensor
    placements, as ``model.state_dict()`` gives the parameters (so ``dcp.save({"model": model.state_dict(),
    "optim": optimizer.state_dict()})`` reshards), and as this rank's local shards elsewhere, with a marker
    (:mod:`.local_optim_state`: it loads back on the same shards only, and DCP refuses it); and make
    ``optimizer.load_state_dict`` take either back (and full tensors).

    >>> install_optimizer(opt, engine_of(model)); dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)

    A never-stepped optimizer gets its state first where the states are DTensors (a zero-lr step, counters put
    back), so that a state dict built to load into has tensors for DCP to fill; what it was loaded with before
    these hooks existed is checked and made local now (``adopt_loaded``).
    """
    optimizer._shardplan_dcp_hooks = True  # the automatic hooks for torch's helpers (above) are not needed
    adopt_loaded(optimizer, exe)
    init_state, save, load = _optimizer_hooks(optimizer, exe)
    # [Note: local states are torch's own dict, a never-stepped optimizer's included: its state stays empty. The
    # zero-lr step that gives DCP tensors to fill is not fresh for every optimizer (L2 weight decay turns the
    # zero gradients into moments, SGD's dampening and NAdam's mu_product differ after it), and here it would
    # change the optimizer's own training]
    pre = [optimizer.register_state_dict_pre_hook(init_state)] if exe.state_dict_hooks.bad is None else []
    return pre + [optimizer.register_state_dict_post_hook(save), optimizer.register_load_state_dict_pre_hook(load)]


def _optimizer_hooks(optimizer: torch.optim.Optimizer, exe):
    """(state_dict pre-hook, state_dict post-hook, load_state_dict pre-hook) converting sharded states."""
    from .checkpoint.values import init_optimizer_state  # (import cost: the checkpoint package loads torch's DCP, ~2 s, not at shard())
    hooks = exe.state_dict_hooks
    plan = exe.plan
    locals_ = exe.local_params()
    name_of = {id(lp): n for n, lp in locals_.items()}

    def params_by_index(sd: dict) -> dict:
        """{index in the state dict: local shard}, from torch's numbering of ``param_groups``."""
        return {i: p for saved, group in zip(sd["param_groups"], optimizer.param_groups)
                for i, p in zip(saved["params"], group["params"])}

    def convert(sd: dict, fn) -> dict:
        by_index = params_by_index(sd)
        state = {}
        for i, st in sd["state"].items():
            p = by_index.get(i)
            name = name_of.get(id(p))
            if name is None:
                raise CheckpointError("optimizer.state_dict(): the optimizer holds a parameter that is not one of "
                                      "the sharded model's; build it on model.parameters() after sharding")
            shapes = (tuple(p.shape), plan.param(name).global_shape)
            state[i] = {k: fn(name, f"state.{i}.{k}", v, p) if _sharded_state(v, shapes) else v for k, v in st.items()}
        return {**sd, "state": state}

    def to_dtensors(_opt, sd):
        return convert(sd, lambda name, key, v, p: hooks.value(name, v))

    def to_local(_opt, sd):  # a layout no DTensor describes: torch's own state dict, marked (local_optim_state.py)
        return mark(sd, optimizer, exe)

    def from_saved(_opt, sd):
        def local(name, key, v, p):
            out = hooks.local_value(name, key, v, p)
            # [Note: local_value answers "this rank holds nothing" with the (empty) shard; a state must not alias it]
            return torch.zeros_like(p) if out.numel() == 0 else out
        return convert(unmark(sd, optimizer, exe), local)

    def init_state(opt):
        if opt.state:
            return
        # [Note: the class's own step, not a drop-in wrapper's (whose finite check is a collective): creating
        # the state must not need the other ranks]
        wrapper = opt.__dict__.pop("step", None)
        try:
            init_optimizer_state(opt)
        finally:
            if wrapper is not None:
                opt.step = wrapper

    return init_state, (to_dtensors if hooks.bad is None else to_local), from_saved


def _sharded_state(v, shapes: tuple) -> bool:
    """A state tensor sharded like its parameter (moments, not AdamW's scalar step): a DTensor, or a plain
    tensor of the local shard's or the parameter's global shape."""
    from torch.distributed.tensor import DTensor
    return isinstance(v, torch.Tensor) and v.dim() > 0 and (isinstance(v, DTensor) or tuple(v.shape) in shapes)
