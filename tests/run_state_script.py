"""A small training run whose every step depends on the whole run's state, for tests/test_checkpoint_run.py.

    torchrun --nproc-per-node 2 tests/run_state_script.py --steps 12 --ckpt DIR --every 4 --metrics m.jsonl
    ... --die-at 10       # os._exit on every rank after step 10 (after the checkpoint of step 8)
    ... --resume          # from the newest complete checkpoint in DIR

What each step depends on: the data loader's position (a shuffled ``DistributedSampler`` over epochs, read
by torchdata's ``StatefulDataLoader`` where installed, else a small stateful loader of this file), the
random generators (dropout and a random token mask drawn from torch's global generator), the lr scheduler
(a decaying ``LambdaLR``) and user state (the epoch, a loss average that feeds into the loss). A resume that
missed any of them would give other losses.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, TensorDataset

import shardplan as sp

VOCAB, SEQ, SAMPLES, BATCH = 31, 8, 40, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(16, 32)
        self.out = nn.Linear(32, VOCAB)

    def forward(self, x, y):
        h = self.drop(F.gelu(self.fc(self.emb(x))))
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


class Loader:
    """A stateful loader for hosts without torchdata: batches of a sampler's indices, resumable mid-epoch."""

    def __init__(self, dataset, sampler, batch_size):
        self.dataset, self.sampler, self.batch_size, self.yielded = dataset, sampler, batch_size, 0
        self._skip = 0

    def __iter__(self):
        order = list(self.sampler)
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        skip, self._skip, self.yielded = self._skip, 0, self._skip
        for idx in batches[skip:]:
            self.yielded += 1
            yield tuple(torch.stack(t) for t in zip(*(self.dataset[i] for i in idx)))

    def state_dict(self):
        return {"yielded": self.yielded}

    def load_state_dict(self, state):
        self._skip = self.yielded = state["yielded"]


class TrainState:
    """User state with state_dict()/load_state_dict(), as torchtitan's train_state."""

    def __init__(self):
        self.epoch, self.tokens = 0, 0

    def state_dict(self):
        return {"epoch": self.epoch, "tokens": self.tokens}

    def load_state_dict(self, state):
        self.epoch, self.tokens = state["epoch"], state["tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--die-at", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--leave-out", default="", help="comma-separated parts not to restore: rng,lr_scheduler,...")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = Net()
    plan = sp.plan(model, [(r".*", sp.P("dp"))], sp.Mesh(dp=world), min_unit_bytes=0)
    model = sp.shard(model, plan)
    torch.manual_seed(1234 + rank)  # per-rank streams: dropout differs between ranks, as it would on GPUs
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g),
                         torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g))
    sampler = DistributedSampler(data, num_replicas=plan.data_size, rank=plan.data_index(rank), shuffle=True, seed=3)
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
        # [Note: a DataLoader draws its workers' base seed when an iterator starts, from its generator, by
        # default torch's global one; a resumed run starts an iterator the uninterrupted run had started
        # before the checkpoint, which would shift the restored global stream by one draw]
        loader = StatefulDataLoader(data, batch_size=BATCH, sampler=sampler, generator=torch.Generator())
    except ImportError:
        loader = Loader(data, sampler, BATCH)
    state, ema = TrainState(), torch.zeros(())
    extra = {"train_state": state, "loss_ema": ema, "note": "start"}

    step, path = 0, sp.checkpoint.latest(args.ckpt) if args.resume else None
    leave = set(filter(None, args.leave_out.split(",")))
    if path:
        step = sp.checkpoint.load(path, model, opt, lr_scheduler=None if "lr_scheduler" in leave else sched,
                                  dataloader=None if "dataloader" in leave else loader, rng="rng" not in leave,
                                  extra={k: v for k, v in extra.items() if k not in leave} | {"note": None})
    log = sp.metrics.TrainLog(args.steps, rank=rank, start_step=step, metrics_path=args.metrics, progress="none")
    if path:
        log.restart(step, path)
    while step < args.steps:
        sampler.set_epoch(state.epoch)
        for x, y in loader:
            mask = torch.rand(x.shape) < 0.1  # this rank's generator: a random token mask
            x = torch.where(mask, torch.zeros_like(x), x)
            loss = model(x, y) + 0.1 * ema
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            state.tokens += x.numel() * world
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            ema.mul_(0.5).add_(0.5 * mean / world)
            log.log(step, loss=mean.item() / world, lr=sched.get_last_lr()[0])
            if args.ckpt and step % args.every == 0:
                save = sp.checkpoint.async_save if args.async_save else sp.checkpoint.save
                save(sp.checkpoint.step_dir(args.ckpt, step), model, opt, step=step, lr_scheduler=sched,
                     dataloader=loader, rng=True, extra={**extra, "note": f"step {step}"})
            if step == args.die_at:
                sp.checkpoint.wait()
                os._exit(17)  # every rank, abruptly: no clean-up, no destroy_process_group
            if step == args.steps:
                break
        else:
            state.epoch += 1
    log.close()
    sp.checkpoint.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
