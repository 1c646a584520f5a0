"""Rules for :mod:`shardplan.models.gpt` under FSDP x tensor parallelism: mesh axes ``dp`` (data: splits the batch,
stores shards) and ``tp`` (compute: keeps the matmuls sharded). Used by the CLI and examples/train_gpt.py:

    shardplan plan shardplan.models.gpt:llama_70b --mesh dp=16,tp=8 --rules shardplan.models.gpt_rules_tp
    torchrun --nproc-per-node 4 examples/train_gpt.py --mesh dp=2,tp=2 --rules examples/gpt_rules_tp.py

PyTorch's ``nn.Linear.weight`` is (out, in): column-parallel shards dim 0, row-parallel dim 1 (the
transpose of a flax kernel's layout, so JAX rules copied verbatim would transpose every TP linear).
``P(("tp", "dp"))`` keeps each tp rank's rows contiguous and stores them sharded over dp on the same
dimension (zero-copy gathers); ``P("dp", "tp")`` stores a row-parallel weight sharded over dp on dim 0.
"""

from shardplan import P

__all__ = ["compute_axes", "tp_rules", "rules", "cp_rules", "UNITS"]

compute_axes = ("tp",)


def tp_rules(data="dp", tp="tp"):
    """The rules for any name of the data axis, or several together (``("dp", "cp")``: ZeRO over dp x cp
    under context parallelism; ``None``: a mesh with the tp axis only)."""
    axes = (data,) if isinstance(data, str) else tuple(data or ())
    stored = axes[0] if len(axes) == 1 else axes if axes else None
    col = P((tp, *axes)) if axes else P(tp)          # column-parallel: output features over tp
    row = P(stored, tp)                              # row-parallel: input features over tp
    rest = P(stored) if axes else P()
    return [
        (r"layers\.\d+\.attention\.w[qkv]\.weight", col),
        (r"layers\.\d+\.attention\.wo\.weight", row),
        (r"layers\.\d+\.feed_forward\.w[13]\.weight", col),
        (r"layers\.\d+\.feed_forward\.w2\.weight", row),
        (r"(tok_embeddings|output)\.weight", col),   # vocabulary-parallel embedding; the tied or separate
                                                     # LM head is column-parallel with gathered logits
        (r".*", rest),                               # norms and positions: replicated compute, FSDP storage
    ]


rules = tp_rules()
cp_rules = tp_rules(data=("dp", "cp"))  # --rules shardplan.models.gpt_rules_tp:cp_rules --mesh dp=2,cp=2,tp=2
UNITS = [r"layers\.\d+"]
