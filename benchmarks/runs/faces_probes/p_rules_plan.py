import warnings, torch, torch.nn as nn
import shardplan as sp
from shardplan import P
import sys; sys.path.insert(0, "tests")
from models import Toy
def show(tag, f):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try: r = f()
        except Exception as exc: r = f"EXC {type(exc).__name__}: {str(exc)[:300]}"
    print(tag, "->", r, "| warnings:", [str(x.message)[:200] for x in w if "ShardedTensor" not in str(x.message)])
m = Toy()
show("first-match", lambda: sp.plan(m, [(r"blocks\.0\..*", P()), (r"blocks\..*", P("dp")), (r".*", P("dp"))], sp.Mesh(dp=2)).param("blocks.0.fc1.weight").spec)
show("first-match-2", lambda: sp.plan(m, [(r"blocks\..*", P("dp")), (r"blocks\.0\..*", P()), (r".*", P("dp"))], sp.Mesh(dp=2)).param("blocks.0.fc1.weight").spec)
show("einops 'dp _'", lambda: sp.plan(m, [(r".*ln.*", "_"), (r".*", "dp _")], sp.Mesh(dp=2)).param("blocks.0.fc1.weight").spec)
show("einops '_ dp'", lambda: sp.plan(m, [(r".*ln.*", ""), (r"frozen", "dp"), (r".*", "_ dp")], sp.Mesh(dp=2)).param("blocks.0.fc1.weight").spec)
show("einops '(replica shard)'", lambda: sp.plan(m, [(r".*ln.*", "_"), (r"frozen", "_"), (r".*", "(replica shard) _")], sp.Mesh(replica=2, shard=2)).param("emb.weight").spec)
show("einops bad axis", lambda: sp.plan(m, [(r".*", "dq _")], sp.Mesh(dp=2)))
show("einops garbage", lambda: sp.plan(m, [(r".*", "dp ( _")], sp.Mesh(dp=2)))
show("einops too long", lambda: sp.plan(m, [(r"frozen", "dp _ _"), (r".*", "dp")], sp.Mesh(dp=2)))
show("unused rule", lambda: sp.plan(m, [(r"nothing\.here", P()), (r".*", P("dp"))], sp.Mesh(dp=2)) and "planned")
show("unmatched param", lambda: sp.plan(m, [(r"blocks.*", P("dp"))], sp.Mesh(dp=2)))
show("rule on tied alias only", lambda: (lambda p: (p.param("emb.weight").spec, p.param("head.weight").spec))(sp.plan(m, [(r"head\.weight", P(None, "dp")), (r".*", P("dp"))], sp.Mesh(dp=2))))
show("rule on tied name first", lambda: (lambda p: (p.param("emb.weight").spec))(sp.plan(m, [(r"emb\.weight", P(None, "dp")), (r".*", P("dp"))], sp.Mesh(dp=2))))
show("tied names conflicting", lambda: (lambda p: (p.param("emb.weight").spec))(sp.plan(m, [(r"emb\.weight", P(None, "dp")), (r"head\.weight", P("dp")), (r".*", P("dp"))], sp.Mesh(dp=2))))
show("invalid regex", lambda: sp.plan(m, [(r"blocks\.(", P()), (r".*", P("dp"))], sp.Mesh(dp=2)))
show("axis twice", lambda: sp.plan(m, [(r"frozen", P()), (r".*", P("dp", "dp"))], sp.Mesh(dp=2)))
show("spec axis not in mesh", lambda: sp.plan(m, [(r".*", P("tp"))], sp.Mesh(dp=2)))
show("dim7 over 4", lambda: sp.plan({"w": torch.zeros(7, 3)}, [(r".*", P("dp"))], sp.Mesh(dp=4)).local_shape("w", 3))
show("dim7 over 4 chunked", lambda: [sp.plan({"w": torch.zeros(7, 3)}, [(r".*", P("dp"))], sp.Mesh(dp=4), layout="chunked").local_shape("w", r) for r in range(4)])
show("1 elem over 4", lambda: [sp.plan({"w": torch.zeros(1)}, [(r".*", P("dp"))], sp.Mesh(dp=4)).local_shape("w", r) for r in range(4)])
show("0 elem over 4", lambda: [sp.plan({"w": torch.zeros(0, 3)}, [(r".*", P("dp"))], sp.Mesh(dp=4)).local_shape("w", r) for r in range(4)])
show("callable spec raising", lambda: sp.plan({"w": torch.zeros(2)}, [(r".*", lambda p, l: 1 / 0)], sp.Mesh(dp=4)))
show("callable spec returning junk", lambda: sp.plan({"w": torch.zeros(2)}, [(r".*", lambda p, l: 42)], sp.Mesh(dp=4)))
show("rule spec None", lambda: sp.plan({"w": torch.zeros(2)}, [(r".*", None)], sp.Mesh(dp=4)).param("w").spec)
show("rule spec string 'dp'", lambda: sp.plan({"w": torch.zeros(2, 2)}, [(r".*", "dp")], sp.Mesh(dp=2)).param("w").spec)
show("axis_rules", lambda: sp.plan({"w": torch.zeros(4, 2)}, sp.Rules([(r".*", P("embed"))], axis_rules=[("embed", "dp")]), sp.Mesh(dp=2)).param("w").spec)
show("axis_rules unmapped logical", lambda: sp.plan({"w": torch.zeros(4, 2)}, sp.Rules([(r".*", P("mlp"))], axis_rules=[("embed", "dp")]), sp.Mesh(dp=2)).param("w").spec)
show("partial match is not enough", lambda: sp.plan({"blocks": {"w": torch.zeros(4)}, "w": torch.zeros(4)}, [(r"w", P()), (r".*", P("dp"))], sp.Mesh(dp=2)).param("blocks.w").spec)
