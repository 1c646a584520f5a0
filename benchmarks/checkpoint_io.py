"""Checkpoint save, async save and load: shardplan vs FSDP2 + DCP, same model, same run, same disk.

    torchrun --standalone --nproc-per-node 2 benchmarks/checkpoint_io.py --config 124M            # CPU, gloo
    torchrun --standalone --nproc-per-node 1 benchmarks/checkpoint_io.py --config 1B --dtype bf16 \\
        --batch 8 --seq 1024                                                                   # one GPU, NCCL

Both systems train the same GPT (examples/gpt.py, units = transformer blocks, AdamW) and checkpoint
parameters plus optimizer state (fp32 params + 2 fp32 moments: ``checkpoint_bytes``) into the same
directory, with DCP's default file writer on both sides (one file per rank, fsync on, one thread):

* shardplan: ``sp.checkpoint.save`` / ``sp.checkpoint.async_save`` / ``sp.checkpoint.load``;
* FSDP2: ``get_state_dict`` + ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` + ``set_state_dict``; its
  async save uses a gloo group of its own and a ``DefaultStager`` (on a GPU: pinned memory, staging in
  the background, and the training loop waits for the staging before ``opt.step()``, as DCP asks).

Each round times, per system: ``save`` (barrier to barrier), ``load``, and an async save: ``async_return``
(until the call returns: training may go on), one training step run while the write is in flight
(``step_during_async``; ``step`` is one without a save), and ``async_complete`` (from the call until the
future completed, on the slowest rank: written and, for shardplan, published; measured by a done-callback,
so it does not wait for the training step). ``save_cpu`` / ``load_cpu``: CPU seconds of every thread,
summed over ranks (less sensitive than wall time to a shared host's other work and to the disk). Systems alternate, first one then the other (ABBA), so the
page cache favours neither; ``--sequential`` runs one system after the other (for configs where two models
do not fit one host: 1B on a CPU host of 24 GiB). ``--warmup`` rounds (default 1) run first, untimed: the
first writes into a host's page cache and the first async save's host buffer (allocated and page-locked
once, then reused) would otherwise be charged to whichever system goes first. Medians over ``--rounds``; the JSON goes to
``benchmarks/results/checkpoint_io_<cpu|cuda>_<config>_w<world>.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
import gpt  # noqa: E402

import shardplan as sp  # noqa: E402
from _report import emit  # noqa: E402

MODES = ("save", "load", "async")


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def barrier(dev):
    sync(dev)
    dist.barrier()


def slowest(seconds: float, dev) -> float:
    """The largest of every rank's ``seconds`` (a save is as slow as its slowest rank)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def total(seconds: float, dev) -> float:
    """The sum of every rank's ``seconds``."""
    t = torch.tensor([seconds], dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    return t.item()


class System:
    """One trained model and its optimizer, with the checkpoint calls of one system."""

    def __init__(self, name, args, dev, world):
        self.name, self.dev, self.step_no = name, dev, 0
        with torch.device("meta"):
            torch.manual_seed(0)
            model = gpt.build(args.config, max_seq=max(args.seq, gpt.CONFIGS[args.config].max_seq))
        dt = torch.bfloat16 if args.dtype == "bf16" else None
        self.pending = None
        if name == "shardplan":
            plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), units=[r"layers\.\d+"], compute_dtype=dt,
                           reduce_dtype=torch.float32 if dt else None)
            sp.shard(model, plan)  # materialised unit by unit on the device
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            mp = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=torch.float32) if dt else MixedPrecisionPolicy()
            for layer in model.layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            model.to_empty(device=dev)
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0, 0.02)
            cuda = dev.type == "cuda"
            self.group = dist.new_group(backend="gloo")  # DCP async needs a CPU group; training's stays free
            self.cuda = cuda
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        g = torch.Generator().manual_seed(1)
        vocab = gpt.CONFIGS[args.config].vocab
        per = max(1, args.batch // world)
        x = torch.randint(0, vocab, (per, args.seq + 1), generator=g).to(dev)
        self.x, self.y = x[:, :-1], x[:, 1:]
        self.train_step()  # optimizer state exists from here on

    def train_step(self) -> float:
        """One training step; its seconds."""
        sync(self.dev)
        t = time.perf_counter()
        self.model(self.x, self.y).backward()
        if self.pending is not None:  # FSDP2 + DCP: the staging must finish before the optimizer writes
            self.pending.staging_completion.result()
            self.pending = None
        self.opt.step()  # shardplan's async save makes the step wait for its copies on the GPU by itself
        self.opt.zero_grad(set_to_none=True)
        sync(self.dev)
        return time.perf_counter() - t

    def _sd(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def save(self, path):
        if self.name == "shardplan":
            sp.checkpoint.save(path, self.model, self.opt, step=1)
        else:
            dcp.save(self._sd(), checkpoint_id=path)

    def async_save(self, path):
        """Start an async save; returns something with ``result()``."""
        if self.name == "shardplan":
            return sp.checkpoint.async_save(path, self.model, self.opt, step=1)
        kw = {}
        try:  # a stager per save: torch 2.11's DefaultStager failed when reused (KeyError: <class 'type'>)
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            kw["async_stager"] = DefaultStager(StagingOptions(
                use_pinned_memory=self.cuda, use_shared_memory=False, use_async_staging=self.cuda,
                use_non_blocking_copy=self.cuda))
        except ImportError:  # torch < 2.9: DCP's own default staging
            pass
        out = dcp.async_save(self._sd(), checkpoint_id=path, process_group=self.group, **kw)
        if kw:
            fut = out.upload_completion if hasattr(out, "upload_completion") else out
            fut.add_done_callback(lambda _: kw["async_stager"].close())
        if hasattr(out, "upload_completion"):  # AsyncSaveResponse: staging still running in the background
            self.pending = out
            return out.upload_completion
        return out

    def load(self, path):
        if self.name == "shardplan":
            sp.checkpoint.load(path, self.model, self.opt)
        else:
            from torch.distributed.checkpoint.state_dict import set_state_dict
            sd = self._sd()
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def close(self):
        pass


def one_round(system, base, r, modes, dev, rank, times):
    t = times.setdefault(system.name, {k: [] for k in ("save", "load", "save_cpu", "load_cpu", "async_return",
                                                        "async_complete", "step", "step_during_async")})
    path = f"{base}_{system.name}_{r}"
    for mode, call in (("save", system.save), ("load", system.load)):
        if mode == "save" and not ("save" in modes or "load" in modes) or mode == "load" and "load" not in modes:
            continue
        barrier(dev)
        t0, c0 = time.perf_counter(), time.process_time()
        call(path)
        c1 = time.process_time()
        barrier(dev)
        t[mode].append(time.perf_counter() - t0)
        t[f"{mode}_cpu"].append(total(c1 - c0, dev))  # CPU seconds of all threads, summed over ranks
    if "async" in modes:
        t["step"].append(slowest(system.train_step(), dev))
        barrier(dev)
        t0 = time.perf_counter()
        fut = system.async_save(path + "_async")
        returned = time.perf_counter() - t0
        finished = []
        fut.add_done_callback(lambda _: finished.append(time.perf_counter()))  # when the write itself ended
        during = system.train_step()  # training goes on while the files are written
        fut.result()
        while not finished:  # the callback runs in the writer's thread, right after the result is set
            time.sleep(0.001)
        done = finished[0] - t0
        barrier(dev)
        t["async_return"].append(slowest(returned, dev))
        t["step_during_async"].append(slowest(during, dev))
        t["async_complete"].append(slowest(done, dev))
    barrier(dev)
    if rank == 0:
        for p in (path, path + "_async"):
            shutil.rmtree(p, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="124M", choices=sorted(gpt.CONFIGS),
                    help="examples/gpt.py config (1B fits one H200 with both systems alive; on a 24 GiB CPU host "
                         "use 124M, or 1B with --sequential --modes save,load)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (the first write into a host's page "
                                                           "cache, and the first async save's host buffer, cost extra)")
    ap.add_argument("--modes", default=",".join(MODES), help="what to time: save, load, async")
    ap.add_argument("--systems", default="shardplan,fsdp2")
    ap.add_argument("--sequential", action="store_true", help="one system after the other (less memory)")
    ap.add_argument("--batch", type=int, default=None, help="global batch of the training steps (default: world)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dtype", default=None, help="compute dtype, e.g. bf16 (checkpoints stay fp32)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: the temp directory)")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/checkpoint_io_...json)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    args.batch = args.batch or world
    modes = [m for m in args.modes.split(",") if m]
    names = [s for s in args.systems.split(",") if s]
    base = os.path.join(args.dir or tempfile.gettempdir(), "shardplan_ckpt_bench")
    with torch.device("meta"):
        n = sum(p.numel() for p in gpt.build(args.config).parameters())
    nbytes = n * 4 * 3
    times: dict = {}
    if args.sequential:
        for name in names:
            s = System(name, args, dev, world)
            for r in range(args.warmup):
                one_round(s, base, r, modes, dev, rank, {})
            for r in range(args.rounds):
                one_round(s, base, r, modes, dev, rank, times)
            s.close()
            del s
            gc.collect()  # FSDP2's module/state cycles must go before the next system is built
            if cuda:
                torch.cuda.empty_cache()
    else:
        systems = [System(name, args, dev, world) for name in names]
        for r in range(-args.warmup, args.rounds):
            for s in (systems if r % 2 == 0 else systems[::-1]):
                one_round(s, base, r, modes, dev, rank, times if r >= 0 else {})
        for s in systems:
            s.close()
    out = {"config": args.config, "params": n, "world": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "checkpoint_bytes": nbytes, "rounds": args.rounds, "warmup_rounds": args.warmup, "modes": modes,
           "order": "sequential" if args.sequential else "alternating (ABBA)", "batch": args.batch, "seq": args.seq,
           "dtype": args.dtype or "fp32", "systems": {}}
    for name, t in times.items():
        med = {k: statistics.median(v) for k, v in t.items() if v}
        row = {f"{k}_s": v for k, v in med.items()}
        for k in ("save", "load"):
            if k in med:
                row[f"{k}_GBps"] = nbytes / med[k] / 1e9
        row["per_round"] = {k: [round(x, 4) for x in v] for k, v in t.items() if v}
        out["systems"][name] = row
    if len(out["systems"]) == 2 and "shardplan" in out["systems"]:
        other = next(k for k in out["systems"] if k != "shardplan")
        a, b = out["systems"]["shardplan"], out["systems"][other]
        out["ratios"] = {k: a[k] / b[k] for k in ("save_s", "load_s", "async_return_s", "async_complete_s")
                         if k in a and k in b}
    path = args.out or os.path.join(HERE, "results", f"checkpoint_io_{'cuda' if cuda else 'cpu'}_{args.config}_w{world}.json")
    emit(out, path, print_it=rank == 0)


if __name__ == "__main__":
    main()
