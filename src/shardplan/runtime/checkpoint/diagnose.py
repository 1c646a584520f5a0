"""What a checkpoint that does not fit holds instead, and how to load or convert it: the messages of
:class:`~shardplan.errors.CheckpointError` for sharded (DCP) and full checkpoints.

Pure functions of names, shapes and directory listings: nothing here reads tensors or talks to other ranks.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional

MARKER = ".shardplan-complete"  # written last into a checkpoint by dcp_io.publish_atomic: the save finished
FULL_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")
WRAPPER_PREFIXES = {"_orig_mod.": "torch.compile", "module.": "DistributedDataParallel / DataParallel",
                    "_fsdp_wrapped_module.": "FSDP1", "_checkpoint_wrapped_module.": "activation checkpointing"}
LOAD_FULL = "sp.checkpoint.load_full_state_dict(model, torch.load(path) if rank == 0 else {})"


def _names(xs: Iterable[str], limit: int = 8) -> str:
    xs = list(xs)
    shown = ", ".join(xs[:limit])
    return shown + (f", ... and {len(xs) - limit} more" if len(xs) > limit else "")


def _complete_below(root: str) -> list[str]:
    return sorted(os.path.basename(d) for d in glob.glob(os.path.join(glob.escape(root), "*"))
                  if os.path.exists(os.path.join(d, MARKER)))


def not_a_directory(path: str) -> str:
    """The message for a checkpoint path that is not a directory."""
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            how = "sp.checkpoint.load_full_state_dict(model, safetensors.torch.load_file(path) if rank == 0 else {})"
        else:
            how = LOAD_FULL
        return (f"{path} is a file, not a sharded (DCP) checkpoint directory: a full state dict (one tensor per "
                f"parameter, torch.save or safetensors)? Load it into the sharded model with {how}; "
                f"sp.checkpoint.save(dir, model, opt) then writes the sharded form")
    tmp = sorted(glob.glob(glob.escape(path.rstrip("/")) + ".tmp-*"))
    msg = f"no checkpoint at {path!r}"
    if tmp:
        msg += (f"; an interrupted save left {os.path.basename(tmp[-1])} (incomplete, not loadable): resume from "
                f"an earlier checkpoint (sp.checkpoint.latest(dir) finds the newest complete one)")
    parent = os.path.dirname(path.rstrip("/")) or "."
    done = _complete_below(parent) if os.path.isdir(parent) else []
    if done:
        msg += f"; complete checkpoints next to it: {_names(done)}"
    return msg


def not_dcp(path: str) -> str:
    """The message for a directory without DCP's ``.metadata``: what it holds instead."""
    inside = sorted(os.listdir(path))
    full = [f for f in inside if f.endswith(FULL_SUFFIXES)]
    done = _complete_below(path)
    if done:
        return (f"{path} is a directory of checkpoints, not one checkpoint: pass one of {_names(done[-8:])} "
                f"(sp.checkpoint.latest({path!r}) is the newest complete one)")
    if ".tmp-" in os.path.basename(path.rstrip("/")):
        return (f"{path} is a save that did not finish (its writer was killed; nothing marks it complete): "
                f"load the checkpoint it would have replaced, or the newest complete one "
                f"(sp.checkpoint.latest(dir))")
    if full:
        return (f"{path} holds full state dict files ({_names(full, 4)}), not a sharded (DCP) checkpoint: load "
                f"them with {LOAD_FULL} (path = one of those files)")
    if MARKER in inside:
        return f"{path} is marked complete but DCP's .metadata is missing: the directory was changed after saving"
    return (f"{path} is not a sharded (DCP) checkpoint: it has no .metadata file"
            + (f" (it holds {_names(inside, 6)})" if inside else " (it is empty)"))


@dataclass
class Differences:
    """How a model's (and optimizer's) DCP entries differ from a checkpoint's metadata."""

    missing: list[str] = field(default_factory=list)       # model side, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)    # in the checkpoint's model, not in this model
    shapes: list[tuple[str, tuple, tuple]] = field(default_factory=list)   # (key, checkpoint's, model's)
    skip: list[str] = field(default_factory=list)          # keys to leave out when loading what fits
    saved: list[str] = field(default_factory=list)         # every key of the checkpoint
    aliases: dict[str, str] = field(default_factory=dict)  # tied names of this model: {alias: parameter}

    @property
    def problems(self) -> int:
        return len(self.missing) + len(self.unexpected) + len(self.shapes)

    def listing(self, limit: int = 40) -> str:
        """One line per difference (as warnings list them)."""
        lines = [f"  {k}: not in the checkpoint" for k in self.missing]
        lines += [f"  {k}: checkpoint has shape {have}, model has {want}" for k, have, want in self.shapes]
        lines += [f"  {k}: in the checkpoint, not in the model" for k in self.unexpected]
        return "\n".join(lines[:limit]) + (f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else "")

    def message(self, path: str, info: Optional[dict], with_optimizer: bool) -> str:
        """The whole error: what differs, grouped, and how to load or convert."""
        head = f"checkpoint {path} does not fit the model ({self.problems} differences, nothing loaded)"
        if info:
            head += (f"; it was saved at step {info.get('step')} on {info.get('mesh')} "
                     f"({info.get('strategy')}, {info.get('form', 'module')} form)")
        form = self._form(path)
        if form:
            return f"{head}.\n{form}"
        lines, fixes = [head + ":"], []
        params_missing = [k[6:] for k in self.missing if k.startswith("model.")]
        opt_missing = [k for k in self.missing if k.startswith("optimizer.")]
        others = [k for k in self.missing if not k.startswith(("model.", "optimizer."))]
        renamed = _prefix_change(params_missing, [k[6:] for k in self.unexpected])
        if renamed:
            lines.append(f"  parameter names differ by a prefix: {renamed}")
            fixes.append("save and load the same module (unwrap it before sp.shard on both sides), or load the "
                         "checkpoint into a model of the saved names, export sp.checkpoint.full_state_dict(model), rename "
                         f"its keys and load them with {LOAD_FULL}")
        else:
            if params_missing:
                lines.append(f"  parameters of the model not in the checkpoint ({len(params_missing)}): "
                             f"{_names(params_missing)}")
            if self.unexpected:
                tied = [k[6:] for k in self.unexpected if k[6:] in self.aliases]
                lines.append(f"  parameters in the checkpoint not in the model ({len(self.unexpected)}): "
                             f"{_names(k[6:] for k in self.unexpected)}")
                if tied:
                    lines.append(f"    tied in this model, separate in the checkpoint: "
                                 f"{_names(f'{a} (= {self.aliases[a]})' for a in tied)}")
            untied = [k[6:] for k in self.unexpected if k[6:] in self.aliases]
            if untied and not params_missing and len(untied) == len(self.unexpected):
                fixes.append("the saved model did not tie these parameters: strict=False loads the rest (the tied "
                             "names then follow the parameters they are tied to), or untie them in this model")
            elif params_missing or self.unexpected:
                fixes.append("the model's parameter set changed since the save: strict=False loads the entries "
                             "that fit and leaves the others as they are (new parameters keep their initial values)")
        if self.shapes:
            lines.append(f"  global shapes that differ ({len(self.shapes)}):")
            lines += [f"    {k.removeprefix('model.')}: checkpoint {have}, model {want}" for k, have, want in self.shapes[:8]]
            if len(self.shapes) > 8:
                lines.append(f"    ... and {len(self.shapes) - 8} more")
            fixes.append("a checkpoint reshards to any world size, strategy or rules, but keeps each parameter's "
                         "global shape: build the model with the saved sizes, or convert through full tensors "
                         "(load into a model of the old sizes, sp.checkpoint.full_state_dict(model), resize, then "
                         f"{LOAD_FULL.replace('model', 'new_model', 1)})")
        opt_only = [k for k in opt_missing if not any(k.startswith(f"optimizer.state.{p}.") for p in params_missing)]
        if opt_only:
            saved_opt = [k for k in self.saved if k.startswith("optimizer.state.")]
            if not saved_opt:
                lines.append("  the checkpoint holds no optimizer state (it was saved without an optimizer)")
            else:
                have = sorted({k.rsplit(".", 1)[1] for k in saved_opt})
                want = sorted({k.rsplit(".", 1)[1] for k in opt_only})
                lines.append(f"  optimizer state: the checkpoint has {', '.join(have)}; this optimizer needs "
                             f"{', '.join(want)}" + (" (another optimizer type)" if not set(want) & set(have) else ""))
            if with_optimizer:
                fixes.append("load the model only (sp.checkpoint.load(path, model), no optimizer) and start the "
                             "optimizer fresh")
        if others:
            lines.append(f"  other entries not in the checkpoint: {_names(others)}")
            fixes.append("it was not written by sp.checkpoint.save; see the form of checkpoint each loader reads "
                         "in docs/checkpoint.md")
        lines += [f"  how to fix: {f}" for f in fixes] or [self.listing()]
        return "\n".join(lines)

    def _form(self, path: str) -> str:
        """A checkpoint of another form altogether (functional tree, a bare model state dict, torch's
        get_state_dict layout): what it is and which loader reads it; ``""`` if it is this form."""
        saved = self.saved
        ours = [k for k in saved if k.startswith("model.")]
        if ours:
            return ""
        if any(k.startswith("tree.") for k in saved):
            return ("It is a functional checkpoint (sp.checkpoint.save_tree: a pytree of local shards, as "
                    "examples/train_functional.py writes), not a module's: load it with "
                    f"sp.checkpoint.load_tree({path!r}, plan, template); to start a module from it: tree, step = "
                    "sp.checkpoint.load_tree(...); full = sp.unshard_tree(tree['params'], plan); "
                    "sp.checkpoint.load_full_state_dict(model, full)")
        wanted = {k[6:] for k in self.missing if k.startswith("model.")}
        bare = wanted & set(saved)
        if bare:
            return ("It holds a model state dict saved directly (torch.distributed.checkpoint.save("
                    "model.state_dict()), as FSDP2 or torchtitan do), without sp.checkpoint.save's 'model.' "
                    "prefix: load it with sd = sp.checkpoint.state_dict(model); torch.distributed.checkpoint.load("
                    "sd['model'], checkpoint_id=path); sp.checkpoint.load_state_dict(model, sd)")
        return (f"It holds none of this model's entries (it has {_names(saved, 6)}): it was not written by "
                f"sp.checkpoint.save for this model")


def differences(flat: dict, meta: dict, aliases: Optional[dict] = None) -> Differences:
    """Compare a model's flat DCP entries (``{"model.<fqn>": value, "optimizer.state.<fqn>.<k>": value}``)
    with a checkpoint's metadata (``{flat key: metadata}``)."""
    d = Differences(saved=list(meta), aliases=dict(aliases or {}))
    for key, value in flat.items():
        if not hasattr(value, "size") or not callable(value.size):
            continue  # hyper-parameters: DCP stores them as objects, flattened by its own rules
        if key not in meta:
            d.missing.append(key)
            d.skip.append(key)
            continue
        want = tuple(value.size())  # a ShardedTensor's size() is the global shape
        have = getattr(meta[key], "size", None)
        if have is not None and want != tuple(have):
            d.shapes.append((key, tuple(have), want))
            d.skip.append(key)
    d.unexpected = [k for k in meta if k not in flat and k.startswith("model.")]
    return d


def _prefix_change(missing: list[str], unexpected: list[str], theirs: str = "the checkpoint's") -> str:
    """``"the checkpoint's names start with 'module.' (DistributedDataParallel ...)"`` when every name on one
    side has one prefix and, without it, covers every name missing on the other side; ``""`` otherwise."""
    if not missing or not unexpected:
        return ""
    for longer, shorter, who in ((unexpected, missing, theirs), (missing, unexpected, "the model's")):
        for x in longer:
            if not x.endswith("." + shorter[0]):
                continue
            prefix = x[:len(x) - len(shorter[0])]
            if all(y.startswith(prefix) for y in longer) and \
                    set(shorter) <= {y[len(prefix):] for y in longer}:
                source = next((f" ({v})" for k, v in WRAPPER_PREFIXES.items() if prefix.endswith(k)), "")
                return f"{who} names start with {prefix!r}{source}"
    return ""


def tree_misfit(path: str, missing: list[str], meta: dict, info: Optional[dict]) -> str:
    """The message of ``load_tree`` when the template's leaves are not in the checkpoint."""
    saved = [k for k in meta if k.startswith("tree.")]
    head = f"checkpoint {path} has no entry for {len(missing)} leaves of the template ({_names(missing, 6)})"
    if not saved and any(k.startswith("model.") for k in meta):
        return (f"{head}: it is a module checkpoint (sp.checkpoint.save), not a functional tree: load it into the "
                f"sharded module with sp.checkpoint.load(path, model, opt), or for pure-function training load it "
                f"into a sharded module and take its shards (sp.shard_tree of sp.checkpoint.full_state_dict(model))")
    if info and info.get("form") == "module":
        return f"{head}: it was saved by sp.checkpoint.save (a module); load it with sp.checkpoint.load"
    return (f"{head}; the checkpoint holds {_names(k[5:] for k in saved)}: the template must have the saved tree's "
            f"structure (the same keys, e.g. {{'params': ..., 'opt': ...}})")


def tree_shapes(path: str, shapes: list[tuple[str, tuple, tuple]], info: Optional[dict]) -> str:
    """The message of ``load_tree`` when template leaves have other global shapes than the saved ones."""
    rows = "\n".join(f"  {k[5:]}: the checkpoint has {tuple(have)}, the template {tuple(want)}"
                      for k, have, want in shapes[:40])
    more = f"\n  ... and {len(shapes) - 40} more" if len(shapes) > 40 else ""
    return (f"checkpoint {path}: {len(shapes)} leaves of the template have other (global) shapes than the saved "
            f"ones, so it was saved from another model:\n{rows}{more}\nbuild the template (shard_tree and "
            f"opt.init) from the model the checkpoint was saved from; nothing was loaded")


def full_misfit(full: dict, param_names: list[str], aliases: dict, buffers: Iterable[str],
                shapes: dict[str, tuple], strict: bool) -> str:
    """Rank 0's description of how a full state dict does not fit the plan, and how to fix it (``""``: it fits)."""
    names = set(param_names) | set(aliases) | set(buffers)
    nested = [k for k, v in full.items() if isinstance(v, dict)]
    if nested and not any(k in names for k in full):
        inner = next((k for k in ("model", "state_dict", "module") if k in nested), nested[0])
        return (f"full state dict does not fit: it is a dict of dicts ({_names(nested, 4)}), not one tensor per "
                f"parameter (a training checkpoint holding the model and more?): pass full[{inner!r}]")
    sharded = [k for k, v in full.items() if type(v).__name__ in ("DTensor", "ShardedTensor")]
    if sharded:
        return (f"full state dict does not fit: {_names(sharded, 4)} are sharded values (DTensor / ShardedTensor), "
                f"not full tensors: this is a sharded state dict; load it with sp.checkpoint.load_state_dict(model, sd) "
                f"after torch.distributed.checkpoint.load, or save it with sp.checkpoint.save and use "
                f"sp.checkpoint.load")
    missing = [p for p in param_names if p not in full and not any(a in full for a, q in aliases.items() if q == p)]
    unexpected = [k for k in full if k not in names]
    bad = [f"{p}: {tuple(full[p].shape)} vs {shapes[p]}" for p in param_names
           if p in full and hasattr(full[p], "shape") and tuple(full[p].shape) != shapes[p]]
    if not ((missing or unexpected) and strict or bad):
        return ""
    lines = ["full state dict does not fit the model (nothing loaded):"]
    renamed = _prefix_change(missing, unexpected, "the dict's")
    if renamed:
        lines.append(f"  names differ by a prefix: {renamed}; rename the keys, e.g. "
                     f"{{k.removeprefix(prefix): v for k, v in full.items()}}")
    else:
        if missing:
            lines.append(f"  parameters of the model not in it ({len(missing)}): {_names(missing)}")
        if unexpected:
            lines.append(f"  entries not in the model ({len(unexpected)}): {_names(unexpected)}")
        if missing or unexpected:
            lines.append("  the parameter set changed: strict=False loads the entries that fit (the others keep "
                         "their values)")
    if bad:
        lines.append(f"  shapes that differ (yours vs the model's): {_names(bad)}; resize the tensors first")
    return "\n".join(lines)
