"""Start-up checks every face runs before its first collective: the world, the module against the plan,
the ranks' plans and parameter values, and the device. Local checks on every rank, then one bounded
exchange of the findings (through the rendezvous store): a problem on any rank raises on every rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import RuntimeShardingError, ShardingError
from ..planner import Plan
from . import collectives as C
from . import stores
from ..planner.validate import validate
from ..planner.serialize import summary

Slots = dict[str, list[tuple[nn.Module, str]]]
"""plan name -> every (owner module, attribute) the parameter is registered at (tied: several)."""

def world_and_rank() -> tuple[int, int]:
    """(world size, rank) of the default process group; raises naming the fix where there is none."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeShardingError(
            "shardplan.shard() needs an initialised torch.distributed process group: run under torchrun and call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first (world size 1 works too)")
    return dist.get_world_size(), dist.get_rank()


def check_module(module: nn.Module, plan: Plan) -> tuple[Slots, list[str]]:
    """({plan name: [(owner module, attribute)]}, problems)."""
    slots: dict[str, list] = {}
    problems = []
    by_id: dict[int, str] = {}
    tied: dict[int, tuple] = {}  # id(tensor) -> (its plan value, every module name it is registered at)
    mods = dict(module.named_modules(remove_duplicate=False))  # a module registered twice: both of its names
    for name, p in module.named_parameters(remove_duplicate=False):
        canonical = by_id.setdefault(id(p), name)
        owner, _, attr = name.rpartition(".")
        try:
            pp = plan.param(canonical)
        except Exception:  # noqa: BLE001
            problems.append(f"  {name} {tuple(p.shape)}: not in the plan")
            continue
        if tuple(p.shape) != pp.global_shape:
            problems.append(f"  {name}: module has shape {tuple(p.shape)}, plan has {pp.global_shape}")
        if str(p.dtype).replace("torch.", "") != pp.dtype:
            problems.append(f"  {name}: module has dtype {p.dtype}, plan has {pp.dtype}")
        slots.setdefault(pp.name, []).append((mods[owner], attr))
        tied.setdefault(id(p), (pp, []))[1].append(name)
    # [Note: tying is part of the plan: a plan built on a model whose output.weight *is* tok_embeddings.weight
    # binds one sharded tensor at both places. Sharding an untied twin of that model with it would tie its
    # weights silently and train another model (a different loss from the first step), so the module's
    # groups of names sharing one tensor must be the plan's groups (a name and its aliases), both ways]
    reported = set()
    for pp, names in tied.values():
        want = {pp.name, *pp.aliases}
        # the module's other names for this tensor that the plan knows as something else, and the plan's names
        # for it that the module gives another tensor; a name the plan does not know at all (a plan built from
        # a pytree of the parameters, without the aliases) binds like the first one, which is what it is
        clash = {n for n in names if n not in want and n in plan} | (want - set(names))
        if clash and pp.name not in reported:
            reported.add(pp.name)
            held = [sorted(ns) for q, ns in tied.values() if q.name == pp.name]
            problems.append(f"  {', '.join(sorted(want))}: tied in the plan (one tensor), but the module holds "
                            f"{' and '.join('{' + ', '.join(h) + '}' for h in held)} as separate tensors"
                            if len(held) > 1 else
                            f"  {', '.join(sorted(names))}: one tensor in the module (tied weights), but the plan "
                            + (f"ties only {', '.join(sorted(want))}" if len(want) > 1 else
                               "holds them as separate parameters"))
    problems += [f"  {p.name}: in the plan, not in the module" for p in plan.params if p.name not in slots]
    return slots, problems


def fingerprints(module: nn.Module, plan: Plan, slots: Slots) -> Optional[list[list[float]]]:
    """Two float64 sums per planned parameter (all elements; every 7th), or None on the meta device."""
    ts = [getattr(*slots[p.name][0]) for p in plan.params]
    if any(t is None or t.device.type == "meta" for t in ts):
        return None
    with torch.no_grad():
        sums = [torch.stack([t.sum(dtype=torch.float64), t.reshape(-1)[::7].sum(dtype=torch.float64)])
                for t in ts]
    return torch.stack(sums).cpu().tolist() if sums else []


def differing(plan: Plan, reports: list[dict]) -> Optional[str]:
    """Name the parameters whose values differ between ranks (seen from the start-up fingerprints)."""
    prints = [(r["rank"], r.get("values")) for r in reports if r.get("values") is not None]
    if len(prints) < 2:
        return None
    r0, base = prints[0]
    bad = []
    for i, p in enumerate(plan.params):
        # [Note: exact]: the same values on the same kind of device sum to the same bits; a tolerance
        # only guards against a reduction order that differs between ranks (different thread counts)
        others = [r for r, v in prints[1:] if any(abs(a - b) > 1e-9 * (1 + abs(a)) for a, b in zip(base[i], v[i]))]
        if others:
            bad.append(f"{p.name} (rank {r0} vs ranks {others})")
    if not bad:
        return None
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return (f"the ranks' models differ before sharding: {', '.join(bad[:5])}{more} hold different values. Sharding "
            f"would train a mix of them (replicated parameters would drift apart). Build the model with the same "
            f"seed on every rank (torch.manual_seed before constructing it), load the same weights everywhere, or "
            f"pass shard(..., sync_module_states=True) (or fully_shard(model, sync_module_states=True)) to broadcast "
            f"rank 0's values")


def startup(module: nn.Module, plan: Plan, world: int, rank: int, timeout_s: float, problems: Optional[list] = None,
             check_values: bool = False, face: str = "shardplan.shard()") -> Slots:
    """Local checks on every rank, then one bounded exchange of their findings and plans: a problem on any
    rank raises on every rank, naming it, before the first collective. ``check_values``: the parameters'
    values must agree across ranks too (a cheap fingerprint)."""
    problems = list(problems or [])
    try:
        validate(plan)  # an edited or hand-written plan is checked before anything runs
    except ShardingError as exc:
        problems.append(f"the plan is invalid: {exc}")
    if world != plan.mesh.size:
        problems.append(f"the plan's mesh {plan.mesh!r} has {plan.mesh.size} ranks but the world size is {world}; "
                        f"plan again with a mesh whose axis sizes multiply to {world}")
    slots, mismatch = check_module(module, plan)
    if mismatch:
        more = f"\n  ... and {len(mismatch) - 40} more" if len(mismatch) > 40 else ""
        problems.append("the module does not match the plan:\n" + "\n".join(mismatch[:40]) + more +
                        "\nbuild the plan from this module (shardplan.plan(module, ...))")
    mine = {"rank": rank, "problems": problems, "fingerprint": plan.fingerprint(), "summary": summary(plan)}
    if check_values and not mismatch and world > 1:
        mine["values"] = fingerprints(module, plan, slots)
    # [Note: rehearsal] one process plays one rank of the plan's world (collectives are local stand-ins):
    # there are no other ranks to exchange findings with, so start-up checks this rank only
    reports = [mine] if C.rehearsing() else stores.exchange(mine, timeout_s)
    differ = differing(plan, reports) if check_values else None
    if differ:
        reports[0]["problems"] = reports[0]["problems"] + [differ]
    failed = [r for r in reports if r["problems"]]
    if failed:
        detail = "\n".join(f"rank {r['rank']}: " + "\n".join(r["problems"]) for r in failed)
        raise RuntimeShardingError(f"{face} failed on rank(s) {[r['rank'] for r in failed]}:\n{detail}")
    prints: dict[str, list[int]] = {}
    for r in reports:
        prints.setdefault(r["fingerprint"], []).append(r["rank"])
    if len(prints) > 1:
        first = {fp: next(r["summary"] for r in reports if r["fingerprint"] == fp) for fp in prints}
        a, b = list(first.values())[:2]
        diff = [f"{k}: {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b.get(k)] or ["layouts or schedule details"]
        who = "; ".join(f"ranks {rs} have {fp}" for fp, rs in prints.items())
        raise RuntimeShardingError(f"ranks hold different plans ({who}); they differ in {', '.join(diff)}. Build the "
                                   f"plan the same way on every rank (same model, rules, mesh and options)")
    return slots


def device_for(module: nn.Module, backend: str) -> tuple[torch.device, bool]:
    """(the device this rank computes on, whether the module is on the meta device)."""
    devs = {p.device for p in module.parameters()}
    meta = all(d.type == "meta" for d in devs)
    if meta or backend == "nccl":
        if torch.cuda.is_available() and backend != "gloo":
            return torch.device("cuda", torch.cuda.current_device()), meta
        return torch.device("cpu"), meta
    real = [d for d in devs if d.type != "meta"]
    if len(set(real)) > 1:
        raise RuntimeShardingError(f"parameters are on several devices {sorted(map(str, real))}; move the module to one")
    return real[0], meta


def tp_local(plan: Plan, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """The block of ``full`` that ``rank``'s tensor-parallel group member computes with."""
    p = plan.param(name)
    if p.tp_dim < 0:
        return full
    size = p.shape[p.tp_dim]
    return full.narrow(p.tp_dim, plan.mesh.axis_index(rank, (p.tp_axis,)) * size, size)
