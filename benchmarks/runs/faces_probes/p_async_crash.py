"""Probe: an async_save killed mid-write at world 4 (a rank dies), then resume at world 2 from latest: the
previous checkpoint, equal to the state at its save. Also a sync save_tree raising mid-write on one rank."""
import os, sys, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import torch, torch.distributed as dist
import shardplan as sp
from distributed import run
from models import batches
import test_checkpoint_async as T

def kill(rank, world, root):
    model, opt = T._make(rank, world)
    T._steps(model, opt, rank, world, batches(1))
    sp.checkpoint.async_save(sp.checkpoint.step_dir(root, 1), model, opt, step=1).result()
    full = sp.checkpoint.full_state_dict(model)
    T._steps(model, opt, rank, world, batches(1, seed=5))
    T._slow_writes(0.2, on_rank=2, action=lambda: os._exit(3))
    fut = sp.checkpoint.async_save(sp.checkpoint.step_dir(root, 2), model, opt, step=2)
    try:
        fut.result(timeout=60); return "published", full
    except sp.errors.CheckpointError as exc:
        return str(exc)[:200], full

def load(rank, world, root):
    model, opt = T._make(rank, world, seed=3, strategy="optim")
    step = sp.checkpoint.load(sp.checkpoint.latest(root), model, opt)
    return step, sp.checkpoint.full_state_dict(model)

def tree_raise(rank, world, path):
    model, opt = T._make(rank, world)  # only for a plan
    from models import Toy, toy_rules
    m = Toy(); plan = sp.plan(m, toy_rules(), sp.Mesh(dp=world), min_unit_bytes=0)
    local = sp.shard_tree(dict(m.named_parameters()), plan)
    sp.checkpoint.save_tree(path, plan, {"params": local}, step=1)
    import torch.distributed.checkpoint as dcp
    real = dcp.FileSystemWriter.write_data
    def bad(self, plan_, planner):
        if dist.get_rank() == 1: raise OSError("disk full (simulated)")
        return real(self, plan_, planner)
    dcp.FileSystemWriter.write_data = bad
    local2 = {k: v + 1 for k, v in local.items()}
    try:
        sp.checkpoint.save_tree(path, plan, {"params": local2}, step=2); err = None
    except BaseException as exc:
        err = f"{type(exc).__name__}: {str(exc)[:200]}"
    dcp.FileSystemWriter.write_data = real
    tree, step = sp.checkpoint.load_tree(path, plan, {"params": {k: torch.zeros_like(v) for k, v in local.items()}})
    return err, step, all(torch.equal(tree["params"][k], local[k]) for k in local)

if __name__ == "__main__":
    root = tempfile.mkdtemp() + "/ck"
    out = run(kill, 4, root, expect_errors=True, timeout=200)
    print("kill:", [o[1][0] if o[0] == "ok" else "rank died" for o in out])
    saved = next(o[1][1] for o in out if o[0] == "ok" and o[1][1])
    print("latest:", sp.checkpoint.latest(root))
    res = run(load, 2, root, timeout=200)
    step, full = res[0]
    print("loaded step", step, "max diff vs state at step-1 save:", max((full[k] - saved[k]).abs().max().item() for k in saved))
    p2 = tempfile.mkdtemp() + "/tree"
    for r in run(tree_raise, 2, p2, timeout=200, expect_errors=True): print("save_tree raising mid-write:", r)
