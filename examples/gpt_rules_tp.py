"""FSDP x tensor-parallel rules for the example GPT, shipped as :mod:`shardplan.models.gpt_rules_tp`
(``--rules shardplan.models.gpt_rules_tp``); this file keeps ``--rules examples/gpt_rules_tp.py`` working."""

from shardplan.models.gpt_rules_tp import *  # noqa: F401,F403
from shardplan.models.gpt_rules_tp import __all__  # noqa: F401
