"""The example GPT, shipped in the package as :mod:`shardplan.models.gpt` (so that snippets run outside a
checkout); this file keeps ``examples/gpt.py:tiny`` and ``from examples.gpt import build`` working."""

from shardplan.models.gpt import *  # noqa: F401,F403
from shardplan.models.gpt import __all__  # noqa: F401

if __name__ == "__main__":
    import torch

    from shardplan.models.gpt import CONFIGS, build, num_params
    with torch.device("meta"):
        for name in CONFIGS:
            print(f"{name:>8}: {num_params(build(name)) / 1e6:,.1f}M parameters")
