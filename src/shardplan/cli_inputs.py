"""What the ``shardplan`` commands read: a TARGET (``FILE.py:NAME``, ``module:NAME``, ``hf:CONFIG``) built on the
meta device, a rules file (its rules, ``UNITS``, ``MESH``, ``OPTIONS``), sizes and ``BxT`` token shapes; each
mistake a :class:`CliError` that names the fix. Torch is imported only to build a model.

>>> load_rules_file("shardplan.models.gpt_rules:HSDP_RULES").rules
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from .dtypes import dtype_name, import_torch, to_torch
from .errors import ShardingError, did_you_mean
from .mesh import Mesh


class CliError(Exception):
    pass


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000 ** 2, "mb": 1000 ** 2, "mib": 1024 ** 2,
          "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1024 ** 3}


def parse_size(text: str) -> int:
    """``4096``, ``16MiB``, ``1.5GB`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 4096, 16MiB or 1GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _load_file(path: str, name: str):
    if not os.path.exists(path):
        raise CliError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses and pickling look the module up by name
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        spec.loader.exec_module(mod)
    except Exception as exc:
        raise CliError(f"loading {path} failed: {type(exc).__name__}: {exc}") from None
    finally:
        sys.path.pop(0)
    return mod


def _split_target(target: str) -> tuple[str, str]:
    """``(file or module, function)`` of a TARGET, checked without importing anything (a missing file is
    said at once, not after torch loaded)."""
    where, sep, fn = target.rpartition(":")
    if not sep or not where or not fn:
        raise CliError(f"TARGET {target!r} must be 'path/to/file.py:function', 'package.module:function' or "
                       f"'hf:CONFIG' (e.g. shardplan.models.gpt:tiny, hf:llama3_8b)")
    if where.endswith(".py") and not os.path.exists(where):
        raise CliError(f"no such file: {where}")
    return where, fn


def _import_module(where: str):
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(where)
    except ImportError as exc:
        raise CliError(f"cannot import {where!r}: {exc}") from None


def load_target(target: str):
    """``path/to/file.py:fn`` or ``package.module:fn`` -> the callable (module paths resolve from the
    working directory too, as ``python -m`` would)."""
    where, fn = _split_target(target)
    mod = _load_file(where, "_shardplan_target") if where.endswith(".py") else _import_module(where)
    if not hasattr(mod, fn):
        found = sorted(k for k, v in vars(mod).items()
                       if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == mod.__name__)
        raise CliError(f"{where} has no function {fn!r}{did_you_mean(fn, found)}; it defines {found[:20]}"
                       f"{' ...' if len(found) > 20 else ''}")
    return getattr(mod, fn)


_BUNDLED_HF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "hf")


def bundled_hf_configs() -> list[str]:
    """The names ``hf:NAME`` takes for the Hugging Face configs shipped in ``shardplan/models/hf``."""
    return sorted(f[:-5] for f in os.listdir(_BUNDLED_HF) if f.endswith(".json")) if os.path.isdir(_BUNDLED_HF) else []


def hf_config_path(spec: str) -> str:
    """The ``config.json`` an ``hf:`` target names: a file, a model folder holding one (a local Hugging Face
    checkpoint), or the name of a config shipped with shardplan (``hf:llama3_8b``); read and checked as JSON
    here, before torch and transformers load."""
    path = spec
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise CliError(f"hf:{spec}: the folder holds no config.json (a Hugging Face model folder has one)")
    elif not os.path.exists(path):
        names = bundled_hf_configs()
        if spec in names:
            path = os.path.join(_BUNDLED_HF, spec + ".json")
        else:
            raise CliError(f"hf:{spec}: no such file or folder{did_you_mean(spec, names)}; give a config.json, a "
                           f"Hugging Face model folder holding one, or a config shipped with shardplan: "
                           f"{', '.join('hf:' + n for n in names)}")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"hf:{spec}: cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise CliError(f"hf:{spec}: {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                       f"a Hugging Face config.json is one JSON object") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise CliError(f"hf:{spec}: {path} has no \"model_type\"; it must be a Hugging Face config.json")
    return path


# the keywords of shardplan.plan a rules file's OPTIONS may set (rules, units and the mesh have names of their own)
PLAN_OPTIONS = ("strategy", "compute_dtype", "reduce_dtype", "prefetch", "reshard_after_forward", "optimizer_states",
                "min_unit_bytes", "order", "layout", "compute_axes", "styles", "offload", "offload_fraction", "device_memory",
                "gather_dtype", "fp8", "fp8_gather")


@dataclass
class RulesFile:
    """What a rules file declares: ``rules`` (or the variable ``FILE.py:NAME`` names) and, optionally,
    ``UNITS``, ``MESH``, ``OPTIONS`` (keywords of ``shardplan.plan``), ``compute_axes`` and ``styles`` --
    everything ``shardplan rules`` and ``plan.to_source()`` write."""
    path: str
    rules: Any
    units: Optional[list] = None
    mesh: Any = None
    options: dict = field(default_factory=dict)


def _split_spec(spec: str) -> tuple[str, str]:
    if spec.count(":") == 1 and not re.match(r"^[A-Za-z]:\\", spec):
        path, _, name = spec.partition(":")
        return path, name
    return spec, ""


def _is_module_name(path: str) -> bool:
    return not path.endswith(".py") and not os.path.exists(path) and re.fullmatch(r"[A-Za-z_][\w.]*", path) is not None


def load_rules_file(spec: str) -> RulesFile:
    """``RULES.py`` (its ``rules``) or ``RULES.py:NAME`` (its ``NAME``), with the file's units, mesh and options;
    an importable module works as well as a file (``shardplan.models.gpt_rules:HSDP_RULES``)."""
    path, name = _split_spec(spec)
    mod = _import_module(path) if _is_module_name(path) else _load_file(path, "_shardplan_rules")
    name = name or "rules"
    if not hasattr(mod, name):
        found = [k for k, v in vars(mod).items() if isinstance(v, list) and not k.startswith("_")]
        raise CliError(f"{path} defines no {name!r} (a shardplan.Rules or a list of (regex, spec) pairs); "
                       f"it has {found}; pick one with --rules {path}:NAME")
    mesh = getattr(mod, "MESH", None)
    if mesh is not None and not isinstance(mesh, Mesh):
        raise CliError(f"{path}: MESH must be a shardplan.Mesh, e.g. MESH = sp.Mesh(dp=8); got {type(mesh).__name__}")
    options = getattr(mod, "OPTIONS", None) or {}
    if not isinstance(options, dict):
        raise CliError(f"{path}: OPTIONS must be a dict of shardplan.plan keywords; got {type(options).__name__}")
    unknown = sorted(set(options) - set(PLAN_OPTIONS))
    if unknown:
        raise CliError(f"{path}: OPTIONS has {unknown}, which are no options of shardplan.plan here; "
                       f"use {list(PLAN_OPTIONS)} (rules, UNITS and MESH are variables of their own)")
    options = dict(options)
    for k in ("compute_axes", "styles"):
        if getattr(mod, k, None) is not None:
            options[k] = getattr(mod, k)
    return RulesFile(path, getattr(mod, name), getattr(mod, "UNITS", None), mesh, options)


def build_model(target: str, param_dtype=None):
    """The module a TARGET names, on the meta device."""
    if target.startswith("hf:"):
        config = hf_config_path(target[3:])  # checked before torch and transformers load
        torch = import_torch()
        from .hf import model_from_config  # (keeps the CLI torch-free until a model is built: hf.py imports torch)
        model = model_from_config(config)
    else:
        _split_target(target)  # a missing file is said before torch loads
        torch = import_torch()
        builder = load_target(target)
        try:
            with torch.device("meta"):
                model = builder()
        except ShardingError:
            raise
        except Exception as exc:
            raise CliError(f"{target}() failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(model, torch.nn.Module):
            raise CliError(f"{target} returned {type(model).__name__}, not an nn.Module")
    if param_dtype:
        model.to(to_torch(dtype_name(param_dtype)))
    return model


def trace_tokens(text: str):
    """``"BxT"`` -> a (B, T) int64 token tensor on the meta device (no memory, no compute)."""
    try:
        b, t = (int(x) for x in text.lower().split("x"))
        assert b > 0 and t > 0
    except (ValueError, AssertionError):
        raise CliError(f"--trace-tokens {text!r}: expected BxT with positive integers, e.g. 1x4096") from None
    torch = import_torch()
    return torch.zeros(b, t, dtype=torch.long, device="meta")
