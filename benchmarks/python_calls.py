"""Python function calls in one training step: a deterministic measure of the runtime's host overhead
(timings of host-bound models move with the machine; call counts do not).

    python benchmarks/python_calls.py [--tree PATH] [--layers 200] [--out calls.json]

Builds a GPT of ``--layers`` blocks of width 64 from the tree at ``--tree`` (its ``src`` and
``examples``: compare two checkouts), shards it at world 1 (gloo, one unit per block), runs two warm-up
steps and counts the calls of the third with cProfile.
"""

import argparse
import cProfile
import json
import os
import pstats
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--port", default="29611")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(args.tree, "src"))
    sys.path.insert(0, os.path.join(args.tree, "examples"))
    import torch
    import torch.distributed as dist
    import gpt
    import shardplan as sp
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = gpt.build("tiny", layers=args.layers)
    plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=1), units=[r"layers\.\d+"], min_unit_bytes=0)
    sp.shard(model, plan)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))

    def step():
        model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    calls = pstats.Stats(prof).total_calls
    out = {"tree": os.path.abspath(args.tree), "layers": args.layers, "units": len(plan.units), "calls": calls,
           "calls_per_unit": calls / len(plan.units), "torch": torch.__version__}
    print(json.dumps(out))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
