"""Partition rules for :mod:`shardplan.models.gpt`: shard every parameter on dim 0 over the data-parallel axis.
Used by the README, the CLI (``--rules shardplan.models.gpt_rules``) and examples/train_gpt.py."""

from shardplan import P

__all__ = ["rules", "HSDP_RULES", "UNITS", "rules_over"]

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


def rules_over(mesh) -> list:
    """Every parameter on dim 0 over the mesh's data axes together (e.g. ``P(("dp", "cp"))``: ZeRO over dp x cp
    under context parallelism); replica axes named ``replica`` stay out."""
    axes = tuple(a for a in mesh.axis_names if a not in ("replica", "tp"))
    return [(r".*", P(axes[0] if len(axes) == 1 else axes))]
