"""Small example models shipped with shardplan, so that the documentation's snippets run outside a checkout.

* :mod:`shardplan.models.gpt`: a GPT/Llama-style decoder with named sizes (``build("tiny")``, ``llama_70b()``)
* :mod:`shardplan.models.moe`: the same decoder with routed experts (expert parallelism)
* :mod:`shardplan.models.gpt_rules`, :mod:`shardplan.models.gpt_rules_tp`: rules files for the decoder (FSDP,
  HSDP; FSDP x tensor parallelism), which ``shardplan plan --rules shardplan.models.gpt_rules`` reads
* ``hf/*.json``: Hugging Face configs (no weights) that ``shardplan plan hf:NAME`` names: ``hf:llama3_70b``,
  ``hf:llama3_8b``, ``hf:mixtral_8x7b``, ``hf:qwen2_7b``

Nothing here is imported by ``import shardplan``; the models import torch.
"""
