"""FP8 compute through torchao: the modules a plan names (``sp.plan(..., fp8="torchao")``, ``plan.fp8_modules``)
swapped for torchao's ``Float8Linear`` (docs/low_precision.md#fp8-compute).

``sp.shard`` converts them itself; call :func:`convert` for a model that is not sharded (a reference to compare
with, or ``sp.functional_call``). torchao is an optional extra (``pip install shardplan[fp8]``), imported here
only when a plan asks for FP8.

>>> plan = sp.plan(model, rules, sp.Mesh(dp=8), compute_dtype="bf16", fp8="torchao")
>>> model = sp.shard(model, plan)            # its Linears are Float8Linear now, their weights gathered in float8
>>> ref = sp.fp8.convert(build(), plan)      # the same conversion, unsharded
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .errors import FP8UnavailableError, RuntimeShardingError

MIN_TORCHAO = (0, 10)
INSTALL = "pip install 'shardplan[fp8]' (or pip install torchao)"
_probed: dict[str, Optional[str]] = {}  # device type (and index) -> why float8 matmuls fail there (None: they run)


def torchao_float8():
    """``torchao.float8``, or :class:`FP8UnavailableError` naming the install."""
    try:
        import torchao
        import torchao.float8 as f8
    except ImportError as exc:
        raise FP8UnavailableError(f"the plan runs Linears in float8 (fp8='torchao'), which needs torchao: {INSTALL}; "
                                  f"or plan with fp8=None ({exc})") from None
    version = tuple(int(x) for x in torchao.__version__.split("+")[0].split(".")[:2] if x.isdigit())
    if version < MIN_TORCHAO:
        raise FP8UnavailableError(f"torchao {torchao.__version__} is too old for shardplan's FP8 compute (needs >= "
                                  f"{'.'.join(map(str, MIN_TORCHAO))}): {INSTALL}")
    return f8


def _why_not(device: torch.device) -> Optional[str]:
    """Why this device cannot run float8 matmuls (``torch._scaled_mm``), or None."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no float8 "
                    f"matmuls; FP8 compute needs 8.9 or newer (Ada L4/L40, Hopper H100/H200, Blackwell)")
    elif device.type == "meta":
        return None
    # [Note: probe, do not guess] torch on CPU runs float8 _scaled_mm from 2.x on (checked with 2.13); other
    # builds and devices may not: one 16x16 matmul says so before any training starts
    try:
        a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except Exception as exc:  # RuntimeError, NotImplementedError, AttributeError (no float8 dtype)
        return f"torch {torch.__version__} has no float8 matmul on {device.type} ({type(exc).__name__}: {exc})"
    return None


def check_device(device) -> None:
    """:class:`FP8UnavailableError` when ``device`` cannot run float8 matmuls, naming the fix."""
    device = torch.device(device)
    key = str(device)
    if key not in _probed:
        _probed[key] = _why_not(device)
    if _probed[key]:
        raise FP8UnavailableError(f"FP8 compute (fp8='torchao') cannot run here: {_probed[key]}. Plan with fp8=None "
                                  f"(bf16 compute), or train on a GPU with float8 matmuls")


def config():
    """The torchao config shardplan converts with: tensorwise dynamic scales (torchao's default recipe).

    [Note: not torchao's float8 all-gather] ``enable_fsdp_float8_all_gather`` makes the weight a tensor subclass
    with FSDP2's ``fsdp_pre_all_gather`` hooks; shardplan gathers flat buffers itself (float8 codes, its own
    absmax all-reduce: runtime/scales.py, tensorwise buffers) and binds the gathered weights as torchao float8
    tensors (:func:`weight_maker`), so the flag stays off."""
    return torchao_float8().Float8LinearConfig(enable_fsdp_float8_all_gather=False)


def _default_device(model: nn.Module) -> torch.device:
    real = [p.device for p in model.parameters() if p.device.type != "meta"]
    if real:
        return real[0]
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def convert(model: nn.Module, plan, device=None) -> nn.Module:
    """Swap the ``nn.Linear`` modules ``plan.fp8_modules`` names for torchao ``Float8Linear`` (in place; the
    weight and bias Parameters are the same objects, so an optimizer built before keeps them) and return
    ``model``. Modules already converted are left; a plan without FP8 changes nothing. Raises
    :class:`FP8UnavailableError` without torchao or float8 matmuls on ``device`` (default: the model's)."""
    mods = getattr(plan, "fp8_modules", ())
    if not mods:
        return model
    torchao_float8()
    from torchao.float8.float8_linear import Float8Linear
    check_device(device if device is not None else _default_device(model))
    cfg = config()
    named = dict(model.named_modules())
    for m in mods:
        mod = named.get(m.path)
        if isinstance(mod, Float8Linear):  # converted by the user: its recipe must be the one shardplan casts with
            _check_own_recipe(m, mod, cfg, plan)
            continue
        if not isinstance(mod, nn.Linear) or (mod.in_features, mod.out_features) != (m.in_features, m.out_features):
            raise RuntimeShardingError(f"the plan runs {m.path!r} in float8 as a Linear {m.in_features} -> "
                                       f"{m.out_features}, but the model has {type(mod).__name__ if mod is not None else 'no module'} "
                                       f"there; build the plan from this model")
        parent, _, attr = m.path.rpartition(".")
        setattr(named[parent] if parent else model, attr, Float8Linear.from_float(mod, config=cfg))
    return model


def _check_own_recipe(m, mod: nn.Module, cfg, plan) -> None:
    """A module the user converted keeps its own config; under a float8 gather shardplan casts its weight (one
    tensorwise e4m3 scale, torchao's default recipe), so another recipe (rowwise, power-of-2 scales, another
    float8 dtype) would silently compute with other numbers than the user's unsharded model: refused."""
    try:
        tensorwise = plan.buffers[plan.param(m.weight).buffer].tensorwise
    except (KeyError, IndexError, AttributeError):
        tensorwise = False
    if not tensorwise:
        return  # compute-dtype gathers: torchao casts after the gather, with the module's own config
    import dataclasses
    own = getattr(mod, "config", None)
    same = own is not None and dataclasses.is_dataclass(own) and \
        dataclasses.replace(own, enable_fsdp_float8_all_gather=False) == cfg
    if not same:
        raise RuntimeShardingError(
            f"{m.path!r} is already a torchao Float8Linear with a config other than the one shardplan's float8 "
            f"gather casts with (tensorwise dynamic scales, torchao's default): {own}. Leave it an nn.Linear for "
            f"shardplan to convert, or plan with fp8_gather=False (torchao then casts after the gather, with the "
            f"module's own config)")


def weight_maker(slots: dict):
    """``make(name, codes, scale, dtype, requires_grad)``: the full parameter of a Float8Linear weight gathered
    as float8 (BufferState.make_params, tensorwise buffers), a torchao ``Float8TrainingTensor`` over the gathered
    codes with the module's own matmul config, wrapped in an ``nn.Parameter`` (as FSDP2's float8 all-gather
    gives it). ``slots``: plan name -> [(module, attribute)] (the converted module that holds it).

    [Note: no cast, no dequantize] Float8Linear's matmul takes a weight that is already a Float8TrainingTensor as
    it is (``tensor_already_casted_to_fp8``), in forward and for grad_input; grad_weight is computed from the
    input and the output gradient, so the gradient that reaches the parameter is a plain tensor of ``dtype``."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    def make(name, codes, scale, dtype, requires_grad):
        module = slots[name][0][0]
        if not hasattr(module, "linear_mm_config"):
            raise RuntimeShardingError(f"the plan gathers {name!r} as float8 for torchao, but its module is a "
                                       f"{type(module).__name__}, not a Float8Linear; shard the model with sp.shard")
        t = Float8TrainingTensor(codes, scale, dtype, module.linear_mm_config, GemmInputRole.WEIGHT)
        return nn.Parameter(t, requires_grad=requires_grad)
    return make


def converted(model: nn.Module) -> list[str]:
    """Paths of the model's torchao Float8Linear modules (none without torchao)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
