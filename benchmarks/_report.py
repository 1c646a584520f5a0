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
