"""The Lightning strategy (shardplan.integrations.lightning): a LightningModule trained by shardplan rules in 2
gloo processes, against Lightning's own FSDP strategy (FSDP1 on the CPU) and DDP, step by step.

Lightning is an optional extra (pip install shardplan[lightning]): without it these tests skip."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from distributed import run

needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                     reason="Lightning is not installed (pip install shardplan[lightning])")

STEPS = 4  # optimizer steps


def _llama():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, 97, (n, 16), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


def _module_class():
    import lightning.pytorch as pl

    class LM(pl.LightningModule):
        """A user's LightningModule, unchanged between strategies."""

        def __init__(self):
            super().__init__()
            self.model = _llama()
            self.losses = []
            self.syncs = []   # shardplan's gradient-sync flag at each backward (no_sync while accumulating)

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.detach().item())
            return loss

        def on_before_backward(self, loss):
            from shardplan.integrations.lightning import ShardplanStrategy
            if isinstance(self.trainer.strategy, ShardplanStrategy):
                from shardplan.runtime.builder import engine_of
                self.syncs.append(engine_of(self.trainer.strategy.sharded_module).sync)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    return LM


def _fit(strategy, *, accumulate=1, clip=None, ckpt=None, resume=None, steps=STEPS, module_class=None, samples=64):
    import lightning.pytorch as pl
    torch.manual_seed(0)
    module = (module_class or _module_class())()
    loader = torch.utils.data.DataLoader(_Tokens(samples), batch_size=2, shuffle=False)
    callbacks = [] if ckpt is None else [pl.callbacks.ModelCheckpoint(dirpath=ckpt, save_top_k=-1, every_n_epochs=2)]
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, logger=False,
                         enable_checkpointing=ckpt is not None, callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=accumulate, gradient_clip_val=clip, use_distributed_sampler=True)
    trainer.fit(module, loader, ckpt_path=resume)
    return trainer, module


def _full(trainer, module):
    """Every parameter, whole, by name (rank 0; ``{}`` elsewhere under shardplan)."""
    from shardplan.integrations.lightning import ShardplanStrategy
    if isinstance(trainer.strategy, ShardplanStrategy):
        import shardplan as sp
        return sp.checkpoint.full_state_dict(trainer.strategy.sharded_module)
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.state_dict().items()}


def _fsdp2_module(module_class):
    """Lightning's own FSDP path on the CPU: ``ModelParallelStrategy`` (FSDP2, ``fully_shard``), which needs the
    user's LightningModule to shard itself in ``configure_model``. [Note: Lightning's ``FSDPStrategy`` (FSDP1)
    cannot be the reference here: Lightning refuses it without a GPU, and torch's FSDP1 itself raises "FSDP
    needs a non-CPU accelerator device" on a CPU-only host]"""
    from torch.distributed.fsdp import fully_shard

    class FSDP2(module_class):
        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)  # the module training_step calls (the root of FSDP2 hooks)

    return FSDP2


def _fsdp2_strategy():
    from lightning.pytorch.strategies import ModelParallelStrategy
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


def _shardplan(**kw):
    import shardplan as sp
    from shardplan.integrations.lightning import ShardplanStrategy
    return ShardplanStrategy([(r".*", sp.P("dp"))], units=[r"model\.model\.layers\.\d+"], min_unit_bytes=0,
                             print_plan=False, **kw)


def _close(a: dict, b: dict, what: str, tol: float = 1e-5) -> None:
    assert sorted(a) == sorted(b), what
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= tol, f"{what}: parameters differ by {worst}"


def _worker(rank, world, ckpt):
    import shardplan as sp
    from shardplan.integrations.lightning import ShardplanStrategy

    def fsdp2(**kw):
        return _fit(_fsdp2_strategy(), module_class=_fsdp2_module(_module_class()), **kw)

    out = {}
    # 1. plain steps: shardplan's ZeRO-3 against Lightning's FSDP2 strategy and its DDP, loss for loss
    trainer, mine = _fit(_shardplan())
    assert isinstance(trainer.strategy, ShardplanStrategy) and trainer.strategy.plan.mesh == sp.Mesh(dp=2)
    _, ref = fsdp2()
    _, ddp = _fit("ddp")
    out["plain"] = (mine.losses, ref.losses, ddp.losses)
    out["plain_full"] = (_full(trainer, mine), _ref_full(ref))
    # 2. accumulate_grad_batches=2 (no_sync on the first micro-step) and gradient_clip_val (the global norm)
    trainer, mine = _fit(_shardplan(), accumulate=2, clip=0.05)
    _, ref = fsdp2(accumulate=2, clip=0.05)
    _, ddp = _fit("ddp", accumulate=2, clip=0.05)
    out["accumulate"] = (mine.losses, ref.losses, mine.syncs)
    # [Note: parameters against DDP here] FSDP2 under Lightning reduces every micro-step (its strategy has no
    # no_sync) and DDP sums the micro-steps first, as shardplan's no_sync does: after 4 AdamW steps at a clipped
    # norm FSDP2 sits 2.7e-5 from DDP, shardplan 6e-8. The losses agree with both within 1e-5
    out["accumulate_full"] = (_full(trainer, mine), _ref_full(ddp))
    # 3. checkpoints: ModelCheckpoint saves every other epoch of a 4-step run (one batch per rank and epoch: the
    # same batch each epoch, whatever Lightning's loop resumes); a fresh Trainer resumes from the first one
    # and ends where the straight run ended
    trainer2, straight = _fit(_shardplan(), steps=4, samples=4, ckpt=ckpt)
    trainer, resumed = _fit(_shardplan(), steps=4, samples=4, resume=os.path.join(ckpt, "epoch=1-step=2.ckpt"))
    out["resume"] = (resumed.losses, straight.losses[2:], trainer.global_step, sorted(os.listdir(ckpt)))
    out["resume_full"] = (_full(trainer, resumed), _full(trainer2, straight))
    return out


def _ref_full(module):
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.state_dict().items()}


@needs_lightning
@pytest.mark.slow
def test_lightning_strategy_trains_like_lightnings_fsdp(tmp_path):
    """A LightningModule unchanged but for Trainer(strategy=ShardplanStrategy(rules)): its losses and final
    parameters equal Lightning's FSDP2 (ModelParallelStrategy, the module sharding itself in configure_model)
    and DDP step for step; accumulation skips the reductions of its first micro-steps; a checkpoint resumes."""
    results = run(_worker, 2, str(tmp_path / "ckpt"), init=False, timeout=600)
    for rank, out in enumerate(results):
        mine, ref, ddp = out["plain"]
        assert len(mine) == STEPS and mine == pytest.approx(ref, abs=1e-5) and mine == pytest.approx(ddp, abs=1e-5)
        mine, ref, syncs = out["accumulate"]
        assert len(mine) == 2 * STEPS and mine == pytest.approx(ref, abs=1e-5)
        assert syncs == [False, True] * STEPS, syncs
        resumed, straight, step, saved = out["resume"]
        assert saved == ["epoch=1-step=2.ckpt", "epoch=3-step=4.ckpt"], saved   # directories: shardplan checkpoints
        assert step == 4 and len(resumed) == 2 and resumed == pytest.approx(straight, abs=1e-5)
    zero = results[0]
    _close(*zero["plain_full"], "plain steps against FSDP2")
    _close(*zero["accumulate_full"], "accumulation and clipping against DDP")
    _close(*zero["resume_full"], "resumed against straight")


def _without_lightning(_rank, _world):
    """In a fork: Lightning hidden and shardplan imported afresh (nothing of either left from this process)."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning", "shardplan")]:
        del sys.modules[name]
    sys.modules["lightning"] = None
    import shardplan
    imported = [m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning") and sys.modules[m]]
    try:
        import shardplan.integrations.lightning  # noqa: F401
    except shardplan.ShardingError as exc:
        return imported, str(exc)
    return imported, None


def test_without_lightning_the_import_says_how_to_install_it():
    """``import shardplan`` never imports Lightning; the integration without it raises ShardingError naming the
    extra (runs whether or not Lightning is installed: the forked child hides it)."""
    imported, refused = run(_without_lightning, 1, init=False, timeout=60)[0]
    assert imported == [] and refused is not None and "pip install 'shardplan[lightning]'" in refused, refused
