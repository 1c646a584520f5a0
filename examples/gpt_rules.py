"""Rules for the example GPT, shipped as :mod:`shardplan.models.gpt_rules` (``--rules shardplan.models.gpt_rules``
works anywhere); this file keeps ``--rules examples/gpt_rules.py`` working in a checkout."""

from shardplan.models.gpt_rules import *  # noqa: F401,F403
from shardplan.models.gpt_rules import __all__  # noqa: F401
