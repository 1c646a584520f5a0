"""Memory traffic of the ops a traced step runs that are not matmuls: the bytes the forecast times at the
device's memory bandwidth.

A training step's time is its matmuls (compute-bound: FLOPs at an achievable rate, counted from the
plan's parameters by :mod:`shardplan.forecast.flops`) plus everything else: norms, activations, rotary
embeddings, residual adds, casts, softmax and cross-entropy, the embedding's gather and its backward.
Those are memory-bound: each reads its inputs and writes its outputs once, so their time is bytes over
bandwidth. :func:`moved_bytes` classifies one aten op as it runs under a dispatch mode (the activation
profile's, :mod:`shardplan.activations`) and returns the bytes it moves:

* matmuls and fused attention (``mm``, ``addmm``, ``bmm``, ``convolution``, the flash / efficient /
  cuDNN attention kernels and their backwards): 0 here, their time is FLOPs;
* views and allocations (``view``, ``t``, ``expand``, ``detach``, ``empty``, ...): 0, they move nothing;
* everything else: the bytes of its tensor inputs plus those of its outputs (a broadcast input counts
  its storage, not its expanded size; an in-place op reads and writes its target), with the few ops
  that touch a fraction of an input counted as they run (``embedding`` reads the rows it gathers,
  ``nll_loss`` one logit per target, ``fill_`` / ``zero_`` only write, ``copy_`` reads its source).

>>> import torch
>>> x = torch.empty(4, 1024, device="meta", dtype=torch.bfloat16)
>>> moved_bytes(torch.ops.aten.mul.Tensor, (x, x), {}, x)          # read two, write one: 3 x 8 KiB
24576
>>> moved_bytes(torch.ops.aten.mm.default, (x, x.t()), {}, x)     # a matmul: timed from its FLOPs
0

[Note: the count is of what the model's aten ops move on the meta device, which runs the same ops as a
GPU except where a device picks a fused kernel (attention is routed to the fused kernels by the
profile; a CUDA-only fused norm or dropout would move less than counted). Caches are not modelled:
each op's tensors are counted as if they came from and went to HBM, which holds for activations of
training sizes (tens of MiB, larger than L2).]
"""

from __future__ import annotations

from typing import Any, Optional

# [Note: op names by their overload packet's name (``aten.mm`` for ``aten.mm.default``), so every
# overload of one op is classified alike]
MATMUL = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "dot", "vdot", "mv", "addmv", "addr", "linear",
    "convolution", "convolution_backward", "_convolution", "cudnn_convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward", "_scaled_mm", "_grouped_mm",
})
FREE = frozenset({
    "_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
    "lift_fresh_copy", "_local_scalar_dense", "detach", "alias", "set_", "resize_", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "record_stream",
})
WRITE_ONLY = frozenset({"fill_", "zero_", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like",
                        "new_zeros", "new_ones", "new_full", "arange", "scalar_tensor", "normal_", "uniform_",
                        "bernoulli_", "random_"})


def _bytes(t) -> int:
    """What reading or writing ``t`` moves: its elements, or its storage when that is smaller (a broadcast
    ``expand`` reads its few real elements, once)."""
    n = t.numel() * t.element_size()
    try:
        return min(n, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return n


def tensors_in(obj: Any, out: Optional[list] = None) -> list:
    """The tensors inside nested tuples, lists, dicts (incl. HF ModelOutput) and dataclasses, appended to ``out``
    (the tracers' and the runtime hooks' one walk; torch is imported at the call, not with this module)."""
    import torch
    return _walk(obj, [] if out is None else out, torch.Tensor)


def _walk(obj: Any, out: list, tensor: type) -> list:
    if isinstance(obj, tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _walk(x, out, tensor)
    elif isinstance(obj, dict):
        for x in obj.values():
            _walk(x, out, tensor)
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            _walk(getattr(obj, k, None), out, tensor)
    return out


def kind(func) -> str:
    """``"matmul"``, ``"free"`` (a view or an allocation) or ``"memory"`` for an aten op overload."""
    name = getattr(getattr(func, "overloadpacket", None), "__name__", str(func))
    if name in MATMUL:
        return "matmul"
    if name in FREE or getattr(func, "is_view", False):
        return "free"
    return "memory"


def moved_bytes(func, args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes an aten op moves through memory if it is memory-bound; 0 for matmuls, views and allocations."""
    k = kind(func)
    if k != "memory":
        return 0
    name = func.overloadpacket.__name__
    outs = tensors_in(out, [])
    written = sum(_bytes(t) for t in outs)
    if name in WRITE_ONLY:
        return written
    ins = tensors_in((args, kwargs), [])
    if name == "copy_" and len(ins) >= 2:          # dst.copy_(src): read src, write dst
        return _bytes(ins[1]) + written
    if name == "embedding" and len(ins) >= 2:      # gathers the rows it writes, reads the indices
        return 2 * written + _bytes(ins[1])
    if name.startswith("nll_loss") and not name.endswith("backward") and len(ins) >= 2:
        # one logit per target, the targets, the (scalar or per-token) loss
        return ins[1].numel() * ins[0].element_size() + _bytes(ins[1]) + written
    return sum(_bytes(t) for t in ins) + written
