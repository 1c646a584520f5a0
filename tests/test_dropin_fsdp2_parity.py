"""The same FSDP2 user code run with torch's ``fully_shard`` and with shardplan's: the numbers must agree (fp32,
rtol=atol=1e-6) or shardplan must refuse with its own error naming the call. Each spawned group runs many checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import register_fsdp_forward_method  # bound before shardplan's drop-in is imported
from torch.nn.utils import get_total_norm as early_total_norm  # bound before shardplan routes torch's norm

import shardplan as sp
from distributed import run

TOL = dict(rtol=1e-6, atol=1e-6)


class Blk(nn.Module):
    def __init__(self, d=8, h=12):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d=8, n=3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Blk(d) for _ in range(n))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _impl(kind):
    if kind == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        return fully_shard, MixedPrecisionPolicy
    return sp.fully_shard, sp.MixedPrecisionPolicy


def _wrap(kind, model, **kw):
    fully_shard, _ = _impl(kind)
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


def _data(rank, world, n=4, b=4):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x, y = torch.randn(b * world, 4, generator=g), torch.randn(b * world, 3, generator=g)
        out.append((x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]))
    return out


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _params(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().float().clone() for k, v in sd.items()}


def _both(fn, rank, world):
    out = {}
    for kind in ("torch", "sp"):
        try:
            out[kind] = fn(kind, rank, world)
        except Exception as exc:  # noqa: BLE001 - compared by the parent
            out[kind] = f"RAISES {type(exc).__name__}: {exc}"
        dist.barrier()
    return out


def _close(a, b) -> bool:
    if isinstance(a, dict):
        return set(a) == set(b) and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


def _check_same(results, names):
    for rank, res in enumerate(results):
        for name in names:
            got, want = res[name]["sp"], res[name]["torch"]
            assert not isinstance(want, str), (name, want)
            assert _close(got, want), (name, rank, got if isinstance(got, str) else "differs")


# -- checks ----------------------------------------------------------------------------------------------

def c_clip_grad_norm(kind, rank, world):
    """torch.nn.utils.clip_grad_norm_ on model.parameters(): the global norm (2 and inf), as over DTensors."""
    m = _wrap(kind, Net())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    out = []
    for i, (x, y) in enumerate(_data(rank, world)):
        F.mse_loss(m(x), y).backward()
        norm_type = float("inf") if i % 2 else 2.0
        out.append(_full(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, norm_type=norm_type)))
        grads = [p.grad for p in m.parameters() if p.grad is not None]  # torchtitan's spelling
        out.append(_full(torch.nn.utils.get_total_norm(grads, 2.0)))
        out.append(_full(early_total_norm(grads, 2.0)))  # a name bound before the first shard(): global too
        opt.step()
        opt.zero_grad()
    return dict(norms=out, p=_params(m))


def c_optimizer_state_dicts(kind, rank, world):
    """get_optimizer_state_dict(full) holds the full moments; set_* into a fresh model continues the same run;
    optimizer.state_dict() gives DTensor moments."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    d = _data(rank, world)
    m = _wrap(kind, Net())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x, y in d[:2]:
        F.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    types = sorted({type(v).__name__ for st in opt.state_dict()["state"].values() for v in st.values()})
    msd, osd = get_model_state_dict(m, options=full), get_optimizer_state_dict(m, opt, options=full)
    moments = {k: {s: _full(v) for s, v in st.items()} for k, st in osd["state"].items()} if rank == 0 else {}
    m2 = _wrap(kind, Net(seed=5))
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    bcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(m2, msd, options=bcast)
    set_optimizer_state_dict(m2, opt2, osd, options=bcast)
    losses = []
    for x, y in d[2:]:
        loss = F.mse_loss(m2(x), y)
        loss.backward()
        opt2.step()
        opt2.zero_grad()
        losses.append(loss.item())
    return dict(types=",".join(types), moments=moments, losses=losses, p=_params(m2))


def c_optimizer_load_before_step(kind, rank, world):
    """optimizer.state_dict() (DTensor moments) loaded straight into a never-stepped optimizer, then training."""
    d = _data(rank, world)
    m = _wrap(kind, Net())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x, y in d[:2]:
        _step(m, opt, x, y)
    m2 = _wrap(kind, Net(seed=6))
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    m2.load_state_dict(m.state_dict())
    opt2.load_state_dict(opt.state_dict())
    return dict(out=[_step(m2, opt2, x, y) for x, y in d[2:]], p=_params(m2))


def _step(m, opt, x, y):
    loss = F.mse_loss(m(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def c_fsdp_module_methods(kind, rank, world):
    """FSDPModule's scheduling hints are accepted (same numbers); accumulation with set_requires_gradient_sync
    on the root, set before the plan compiled (a lone root call) and after."""
    fully_shard, _ = _impl(kind)
    m = Net()
    for b in m.blocks:
        fully_shard(b)
    fully_shard(m)
    bl = list(m.blocks)
    for a, b in zip(bl, bl[1:]):
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])
    m.set_force_sum_reduction_for_comms(False)
    m.set_unshard_in_backward(True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    out = []
    for i, (x, y) in enumerate(_data(rank, world, n=6)):
        last = i % 3 == 2
        m.set_requires_gradient_sync(last)
        m.set_is_last_backward(last)
        m.set_reshard_after_backward(last)
        loss = F.mse_loss(m(x), y) / 3
        loss.backward()
        out.append(loss.item())
        if last:
            opt.step()
            opt.zero_grad()
    lone = Net(seed=2)
    fully_shard(lone)
    lone.set_requires_gradient_sync(False)  # before the plan compiles
    opt = torch.optim.SGD(lone.parameters(), lr=0.1)
    x, y = _data(rank, world)[0]
    F.mse_loss(lone(x), y).backward()
    lone.set_requires_gradient_sync(True)
    F.mse_loss(lone(x), y).backward()
    opt.step()
    return dict(losses=out, p=_params(m), lone=_params(lone))


class Gen(Net):
    def generate(self, x, steps=2):
        for _ in range(steps):
            x = x + self.forward(x)[:, :1]
        return x


def c_forward_method(kind, rank, world):
    """register_fsdp_forward_method (torch's, bound before shardplan was imported): a generate-like method
    gathers like forward; with gradients too under order='dynamic' (units run twice per step)."""
    fully_shard, _ = _impl(kind)
    d = _data(rank, world)
    m = Gen()
    for b in m.blocks:
        fully_shard(b)
    fully_shard(m)
    register_fsdp_forward_method(m, "generate")
    # torch's own function, unmodified, on an FSDPModule (shardplan's modules subclass torch's public class)
    torch_own = register_fsdp_forward_method.__code__.co_filename.endswith("_fully_shard.py")
    is_fsdp_module = isinstance(m, FSDPModule) and isinstance(m.blocks[0], FSDPModule)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    out = [_step(m, opt, *d[0])]
    with torch.no_grad():  # one forward per call (each unit once): the static plan's order
        out.append(m.generate(d[1][0], steps=1).sum().item())
    out.append(_step(m, opt, *d[2]))
    g = Gen(seed=1)
    for b in g.blocks:
        fully_shard(b)
    fully_shard(g, **({} if kind == "torch" else dict(order="dynamic")))
    register_fsdp_forward_method(g, "generate")
    opt = torch.optim.AdamW(g.parameters(), lr=1e-2)
    for x, _ in d[:2]:
        loss = g.generate(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
        two = F.mse_loss(g(d[2][0]), d[2][1]) + F.mse_loss(g(d[3][0]), d[3][1])  # two forwards, one backward
        two.backward()
        opt.step()
        opt.zero_grad()
        out.append(two.item())
    return dict(out=out, p=_params(m), g=_params(g), torch_own=torch_own, is_fsdp_module=is_fsdp_module)


@dataclass
class Batch:
    x: torch.Tensor


class Pair(NamedTuple):
    x: torch.Tensor
    bias: torch.Tensor


class Inputs(Net):
    def forward(self, batch, scale=None):
        x = batch["x"] if isinstance(batch, dict) else batch.x
        h = self.inp(x)
        if isinstance(batch, Pair):
            h = h + batch.bias
        if scale is not None:
            h = h * scale
        for b in self.blocks:
            h = b(h.float())  # each block casts its own inputs, as FSDP2 does
        return self.out(h)


def c_mixed_precision_inputs(kind, rank, world):
    """bf16 compute, fp32 reduction; inputs in dicts, dataclasses, namedtuples and kwargs are cast; bf16 and
    fp32 results agree with FSDP2 (to 1e-6 here: the same casts and the same fp32 reduction)."""
    fully_shard, MP = _impl(kind)
    mp = MP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    m = Inputs()
    for b in m.blocks:
        fully_shard(b, mp_policy=mp)
    fully_shard(m, mp_policy=mp)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    out = []
    for i, (x, y) in enumerate(_data(rank, world)):
        batch = [{"x": x}, Batch(x), Pair(x, torch.ones(8))][i % 3]
        o = m(batch, scale=torch.full((8,), 0.5))
        out.append(str(o.dtype))
        loss = F.mse_loss(o.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return dict(out=out, p=_params(m))


def c_eval_before_backward(kind, rank, world):
    """A no-grad forward between loss = model(x) and loss.backward() (an evaluation, as FSDP2 allows); then a
    forward without backward, and training on."""
    m = _wrap(kind, Net())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    d = _data(rank, world)
    out = []
    for x, y in d[:2]:
        loss = F.mse_loss(m(x), y)
        with torch.no_grad():
            out.append(m(d[3][0]).sum().item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    m(d[2][0])  # no backward
    out.append(_step(m, opt, *d[2]))
    return dict(out=out, p=_params(m))


def c_nested_and_grouped(kind, rank, world):
    """fully_shard nested three deep (a layer, its block, the model: torchtitan's experts pattern) and on a list
    of modules (FSDP2's group); param groups built from a block's parameters() before the first forward."""
    fully_shard, _ = _impl(kind)
    m = Net()
    for b in m.blocks:
        fully_shard(b.fc1)
        fully_shard(b)
    fully_shard(m)
    opt = torch.optim.AdamW([{"params": list(m.blocks[0].parameters()), "lr": 1e-1},
                             {"params": [p for b in m.blocks[1:] for p in b.parameters()]
                              + list(m.inp.parameters()) + list(m.out.parameters())}], lr=1e-2)
    out = [_step(m, opt, x, y) for x, y in _data(rank, world)]
    g = Net(seed=1)
    fully_shard([g.blocks[0], g.blocks[1]])
    fully_shard(g.blocks[2])
    fully_shard(g)
    opt = torch.optim.AdamW(g.parameters(), lr=1e-2)
    out += [_step(g, opt, x, y) for x, y in _data(rank, world)]
    return dict(out=out, p=_params(m), g=_params(g))


def c_meta_init(kind, rank, world):
    """fully_shard on the meta device, then the weights broadcast from rank 0 (FSDP2 needs .to_empty() first;
    shardplan takes it too, tests/test_fully_shard_start.py, or materialises the meta model itself at its first
    use, each module by its reset_parameters(), as here)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    full = Net(seed=4).state_dict()
    with torch.device("meta"):
        m = Net()
    _wrap(kind, m)
    if kind == "torch":
        m.to_empty(device="cpu")
    set_model_state_dict(m, full if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return dict(out=[_step(m, opt, x, y) for x, y in _data(rank, world)], p=_params(m))


CHECKS = [c_clip_grad_norm, c_optimizer_state_dicts, c_fsdp_module_methods, c_forward_method, c_mixed_precision_inputs,
          c_eval_before_backward, c_nested_and_grouped, c_meta_init, c_optimizer_load_before_step]


class Outside(Net):
    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h) + 0.1 * self.blocks[1].fc2.bias.sum()  # a block's parameter read in the root's forward


def _outside(rank, world):
    """A block's parameter read in the root's forward: FSDP2 refuses (DTensor mixed with Tensor), and so does
    shardplan, whose parameters are DTensors between a unit's forwards as FSDP2's are; with
    reshard_after_forward=False on that block it trains as one process on the whole batch."""
    out = {}
    m = _wrap("sp", Outside())
    x, y = _data(rank, world)[0]
    try:
        F.mse_loss(m(x), y).backward()
        out["refused"] = "no error"
    except RuntimeError as exc:
        out["refused"] = str(exc)
    m = Outside()
    for i, b in enumerate(m.blocks):
        sp.fully_shard(b, reshard_after_forward=i != 1)
    sp.fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = torch.tensor([_step(m, opt, x, y) for x, y in _data(rank, world)])
    dist.all_reduce(losses)
    ref = Outside()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = list(zip(*[_data(r, world) for r in range(world)]))
    want = [_step(ref, ropt, torch.cat([b[0] for b in step]), torch.cat([b[1] for b in step])) for step in batches]
    out["same"] = torch.allclose(losses / world, torch.tensor(want), rtol=1e-5)
    out["params"] = all(torch.allclose(_params(m)[k], v, rtol=1e-5, atol=1e-6) for k, v in ref.state_dict().items())
    return out


def _errors_worker(rank, world):
    """What shardplan refuses, each with its own error naming the call."""
    msgs = {}

    def catch(key, fn):
        try:
            fn()
            msgs[key] = "no error"
        except sp.ShardingError as exc:
            msgs[key] = str(exc)

    m = _wrap("sp", Net())
    d = _data(rank, world)
    catch("unshard", lambda: m.unshard(async_op=True))
    catch("reshard", m.reshard)
    catch("custom_all_gather", lambda: m.set_custom_all_gather(None))
    catch("requires_all_reduce", lambda: m.set_requires_all_reduce(False))
    catch("divide", lambda: m.set_gradient_divide_factor(1.0))
    catch("divide_world", lambda: m.blocks[0].set_reduce_scatter_divide_factor(float(world)))
    catch("raf_after", lambda: m.set_reshard_after_forward(False))
    m.blocks[0].set_requires_gradient_sync(False)  # one child only: FSDP2 would skip that child's reduction
    catch("sync_child", lambda: m(d[0][0]))
    m.blocks[0].set_requires_gradient_sync(True)
    m.set_requires_gradient_sync(False, recurse=False)
    catch("sync_norecurse", lambda: m(d[0][0]))
    for b in m.blocks:  # every module by hand, FSDP2 style: the flags agree again
        b.set_requires_gradient_sync(True, recurse=False)
    m.set_requires_gradient_sync(True, recurse=False)
    catch("sync_all", lambda: F.mse_loss(m(d[0][0]), d[0][1]).backward())
    m.blocks[1].set_requires_gradient_sync(False)  # after a forward whose check passed: checked again
    catch("sync_child_later", lambda: m(d[0][0]))
    m.blocks[1].set_requires_gradient_sync(True)
    # the gradients are DTensors, as FSDP2's: torch's norm of any order is DTensor's, over the whole gradients
    grads = [p.grad for p in m.parameters()]
    low = torch.nn.utils.get_total_norm(grads, -float("inf")).full_tensor()
    msgs["norm_order"] = bool(low == min(g.full_tensor().abs().min() for g in grads))

    def two_forwards():
        (m(d[1][0]).sum() + m(d[2][0]).sum()).backward()
    try:
        two_forwards()
        msgs["two_forwards"] = "no error"
    except sp.ShardingError as exc:
        msgs["two_forwards"] = str(exc)
    gen = Gen()
    for b in gen.blocks:
        sp.fully_shard(b)
    sp.fully_shard(gen)
    register_fsdp_forward_method(gen, "generate")
    with torch.no_grad():
        catch("generate_twice", lambda: gen.generate(d[0][0], steps=2))
    ok = Net()
    catch("ignored", lambda: sp.fully_shard(ok, ignored_params=set(ok.out.parameters())))
    early = Net()
    for b in early.blocks:
        sp.fully_shard(b)
        b.set_reshard_after_forward(False)  # before the plan compiles: honoured
    sp.fully_shard(early)
    msgs["raf_before"] = [u.reshard_after_forward for u in sp.plan_of(early).units[1:]]
    used = Net()
    sp.fully_shard(used.blocks[0])
    used.blocks[0](torch.randn(2, 8))  # used alone: it became its own root
    catch("compiled_inside", lambda: sp.fully_shard(used))
    with torch.device("meta"):
        meta = Net()
    _wrap("sp", meta)
    meta.parameters()  # the first use materialises it (reset_parameters): to_empty comes too late now

    def to_empty():
        meta.to_empty(device="cpu")
    try:
        to_empty()
        msgs["to_empty"] = "no error"
    except sp.ShardingError as exc:
        msgs["to_empty"] = str(exc)
    half = Net()
    for b in half.blocks:
        sp.fully_shard(b, mp_policy=sp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    sp.fully_shard(half)  # FSDP2's default policy here: the root computes in fp32, the blocks in bf16
    catch("policies", lambda: half(d[0][0]))
    placed = Net()
    sp.fully_shard(placed.blocks[0], shard_placement_fn=lambda p: None)
    sp.fully_shard(placed)
    catch("placement", placed.parameters)  # the plan compiles at the first use
    import copy
    catch("deepcopy", lambda: copy.deepcopy(m))
    fresh = _wrap("sp", Net())
    twin = copy.deepcopy(fresh)  # before the first use: an ordinary copy, which compiles its own plan
    msgs["twin"] = torch.equal(twin(d[0][0]), fresh(d[0][0])) and sp.plan_of(twin) is not sp.plan_of(fresh)
    other = nn.Linear(2, 2)
    mixed = torch.optim.AdamW(list(early.parameters()) + list(other.parameters()), lr=1e-2)
    F.mse_loss(early(d[0][0]), d[0][1]).backward()
    mixed.step()
    catch("mixed_state_dict", mixed.state_dict)
    msgs.update(_outside(rank, world))
    return msgs


@pytest.mark.timeout(120)
def test_refusals_name_the_call():
    for msgs in run(_errors_worker, 2, timeout=100):
        for key in ("unshard", "reshard", "custom_all_gather", "requires_all_reduce"):
            assert "is not supported by shardplan" in msgs[key] and key.split("_")[0] in msgs[key], (key, msgs[key])
        assert "set_gradient_divide_factor(1.0)" in msgs["divide"] and msgs["divide_world"] == "no error", msgs
        assert "fully_shard(module, reshard_after_forward=False)" in msgs["raf_after"], msgs["raf_after"]
        for key in ("sync_child", "sync_norecurse", "sync_child_later"):
            assert "set_requires_gradient_sync" in msgs[key] and "on the root" in msgs[key], msgs[key]
        assert msgs["sync_all"] == "no error", msgs["sync_all"]
        assert msgs["norm_order"] is True
        for key in ("two_forwards", "generate_twice"):
            assert "fully_shard(model, order='dynamic')" in msgs[key], msgs[key]
        assert "ignored_params=<2 parameters>" in msgs["ignored"] and "tensor(" not in msgs["ignored"], msgs["ignored"]
        assert msgs["raf_before"] == [False, False, False], msgs["raf_before"]
        # one optimizer over a fully_shard model and other parameters: its states are DTensors and plain tensors
        # like its parameters, so torch's own state dict is right for DCP, as under FSDP2
        assert msgs["mixed_state_dict"] == "no error", msgs["mixed_state_dict"]
        assert "'blocks.0' already runs its own plan" in msgs["compiled_inside"], msgs["compiled_inside"]
        assert "to_empty" in msgs["to_empty"] and "before the model's first use" in msgs["to_empty"], msgs["to_empty"]
        assert "copy.deepcopy of a fully_shard module" in msgs["deepcopy"] and msgs["twin"] is True, msgs
        assert "got mixed torch.Tensor and DTensor" in msgs["refused"], msgs["refused"]
        assert msgs["same"] and msgs["params"], msgs
        assert "one mixed-precision policy per plan" in msgs["policies"] and "'<root>'" in msgs["policies"], msgs
        assert "shard_placement_fn of the calls on ['blocks.0']" in msgs["placement"], msgs["placement"]


def _worker(rank, world, names):
    return {f.__name__: _both(f, rank, world) for f in CHECKS if f.__name__ in names}


@pytest.mark.timeout(120)
def test_numbers_match_fsdp2_two_ranks():
    names = [c.__name__ for c in CHECKS]
    _check_same(run(_worker, 2, names, timeout=100), names)


# -- four ranks: HSDP (replicate x shard), uneven and empty shards, DCP across world sizes and implementations ----

def c_hsdp(kind, rank, world):
    """HSDP over (2, world // 2): clip_grad_norm_ counts replicated elements once; full optimizer states."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    m = _wrap(kind, Net(), mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    out = []
    for x, y in _data(rank, world):
        loss = F.mse_loss(m(x), y)
        loss.backward()
        out.append(_full(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    osd = get_optimizer_state_dict(m, opt, options=StateDictOptions(full_state_dict=True))
    return dict(out=out, p=_params(m), osd={k: {s: _full(v) for s, v in st.items()} for k, st in osd["state"].items()})


def _inf_norm_reference(rank, world):
    """torch's clip_grad_norm_ cannot take the inf-norm of an empty shard (out.weight, 3 rows over 4 ranks) of
    DTensor gradients, FSDP2's or shardplan's (its rank raises before the collective); shardplan.clip_grad_norm_
    can: both norms are checked against one process on the whole batch."""
    d = _data(rank, world)
    m = _wrap("sp", Net())
    F.mse_loss(m(d[0][0]), d[0][1]).backward()
    got = sp.clip_grad_norm_(m, 1e9, norm_type=float("inf"))
    two = torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9).full_tensor()
    ref = Net()
    x = torch.cat([_data(r, world)[0][0] for r in range(world)])
    y = torch.cat([_data(r, world)[0][1] for r in range(world)])
    F.mse_loss(ref(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=float("inf"))
    want2 = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    return torch.allclose(got, want, rtol=1e-5) and torch.allclose(two, want2, rtol=1e-5)


def _four_worker(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    out = {"c_hsdp": _both(c_hsdp, rank, world), "inf_norm": _inf_norm_reference(rank, world)}
    for kind in ("torch", "sp"):
        m = _wrap(kind, Net())
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for x, y in _data(rank, world)[:2]:
            _step(m, opt, x, y)
        msd, osd = get_state_dict(m, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/{kind}")
    return out


def _load(kind, rank, world, path, src):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    m = _wrap(kind, Net(seed=3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=f"{path}/{src}")
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return dict(losses=[_step(m, opt, x, y) for x, y in _data(rank, world)[2:]], p=_params(m))


def _two_worker(rank, world, path):
    return {f"from_{src}": _both(lambda kind, r, w: _load(kind, r, w, path, src), rank, world) for src in ("torch", "sp")}


@pytest.mark.slow  # parity with FSDP2: test_numbers_match_fsdp2_two_ranks
@pytest.mark.timeout(300)
def test_hsdp_and_checkpoints_across_world_sizes_match_fsdp2(tmp_path):
    four = run(_four_worker, 4, str(tmp_path), timeout=200)
    _check_same(four, ["c_hsdp"])
    assert all(r["inf_norm"] for r in four)
    two = run(_two_worker, 2, str(tmp_path), timeout=200)
    _check_same(two, ["from_torch", "from_sp"])  # each implementation loads either's checkpoint alike
    for r in two:  # and a checkpoint of either implementation resumes the same run
        assert _close(r["from_sp"]["sp"], r["from_torch"]["torch"])
