"""Partition rules for examples/gpt.py: shard every parameter on dim 0 over the data-parallel axis. Used by the README, the CLI and examples/train_gpt.py."""

from shardplan import P

# Any mesh works: specs name the axis "dp"; for HSDP (Mesh(replica=..., shard=...)) use HSDP_RULES.
rules = [
    (r".*embeddings\.weight", P("dp")),     # row-sharded: each rank owns a slice of the vocabulary
    (r".*", P("dp")),                      # everything else, norms included: dim 0 over dp, so each
]                                          # block is one buffer and one collective per direction

HSDP_RULES = [
    (r".*norm\.weight", P()),
    (r".*", P("shard")),                   # sharded within a replica group, replicated across groups
]

UNITS = [r"layers\.\d+"]
