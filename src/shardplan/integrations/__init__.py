"""Training frameworks people already use, driven by shardplan rules through their own configuration.

Each integration is a module of its own that imports its framework (an optional extra): ``import shardplan``
imports none of them.

* :mod:`shardplan.integrations.lightning` -- ``ShardplanStrategy``, a Lightning ``Trainer(strategy=...)``
  (``pip install shardplan[lightning]``; docs/integrations.md).
"""
