"""The one way benchmarks start (a process group: torchrun's, or one process of its own) and finish (print
their JSON, write it if asked, leave the process group)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist


def start_world() -> tuple[bool, torch.device]:
    """Join torchrun's process group (NCCL on GPUs, gloo on CPU), or make a world of one when run plainly;
    returns (on CUDA, this rank's device)."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    return cuda, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def emit(out: dict, path: str | None, *, print_it: bool = True) -> None:
    if print_it:
        print(json.dumps(out, indent=1))
        if path:
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


def top_kernels(call, calls: int = 2, top: int = 30) -> dict:
    """The device kernels of ``calls`` calls of ``call()`` under torch's profiler: the ``top`` by device time
    (ms per call, launches per call) and the totals, so that an eager and a captured step compare kernel by
    kernel (kernels replayed from a CUDA graph are recorded too)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    rows = [(e.key, getattr(e, "self_device_time_total", 0) / 1e3 / calls, e.count / calls)
            for e in prof.key_averages()]
    rows = sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])
    return {"total_ms": sum(r[1] for r in rows), "launches": sum(r[2] for r in rows),
            "top": [{"kernel": k[:120], "ms": round(ms, 3), "n": n} for k, ms, n in rows[:top]]}


def meta_params(model):
    """Replace the module's parameters by meta tensors of their shapes (tied ones stay tied), as a JAX-style
    script that builds the module on the meta device and its parameter tree with ``shard_tree(init_fn=)``
    holds them: ``functional_call`` binds the tree's gathered parameters and never reads the module's."""
    new = {}
    for m in model.modules():
        for k, p in list(m._parameters.items()):
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                m._parameters[k] = new[id(p)]
