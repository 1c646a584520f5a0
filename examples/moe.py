"""The example mixture-of-experts GPT, shipped in the package as :mod:`shardplan.models.moe`; this file keeps
``examples/moe.py`` and ``from examples.moe import build`` working."""

from shardplan.models.moe import *  # noqa: F401,F403
from shardplan.models.moe import __all__  # noqa: F401
