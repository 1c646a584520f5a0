"""The one way benchmarks finish: print their JSON, write it if asked, leave the process group."""

from __future__ import annotations

import json

import torch.distributed as dist


def emit(out: dict, path: str | None, *, print_it: bool = True) -> None:
    if print_it:
        print(json.dumps(out, indent=1))
        if path:
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()
