"""Exceptions raised by shardplan. Every one names what is wrong and how to fix it.

>>> try:
...     sp.plan(model, [(r".*", sp.P("tp"))], sp.Mesh(dp=8))
... except sp.errors.SpecError as exc:       # a spec names an axis the mesh lacks; sp.ShardingError: any of them
...     print(exc)
"""

from __future__ import annotations


def did_you_mean(word: str, options, *, prefix: str = " ") -> str:
    """``" (did you mean 'dp'?)"``: the closest of ``options`` to a misspelt ``word``, or ``""`` when none is close."""
    import difflib
    word, options = str(word), [str(o) for o in options]
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    # short names (mesh axes: "dp" for "dq") are one letter apart at a ratio of 0.5: same first letter, same length
    close = close or [o for o in options if o.lower() == word.lower() or (
        len(o) == len(word) and o[:1] == word[:1] and sum(a != b for a, b in zip(o, word)) == 1)][:1]
    return f"{prefix}(did you mean {close[0]!r}?)" if close else ""


class ShardingError(ValueError):
    """Base class of every error shardplan raises on bad input (the others: :mod:`shardplan.errors`).

    >>> try:
    ...     plan = sp.plan(model, rules, sp.Mesh(dp=8))
    ... except sp.ShardingError as exc:
    ...     print(exc)                    # what is wrong, where, and the fix
    """


class MeshError(ShardingError):
    """A mesh is malformed or does not fit the process group."""


class SpecError(ShardingError):
    """A partition spec is malformed or does not fit its tensor or mesh."""


class RuleError(ShardingError):
    """A partition rule is malformed (bad regex, bad spec, bad callable)."""


class UnmatchedParametersError(RuleError):
    """Some leaves matched no rule. ``.names`` lists them."""

    def __init__(self, message: str, names: tuple[str, ...]):
        super().__init__(message)
        self.names = names


class PlanError(ShardingError):
    """A plan cannot be built from these options, or a plan does not fit a model."""


class RuntimeShardingError(ShardingError):
    """The runtime found the world, the module or the plan inconsistent."""


class CollectiveError(RuntimeError):
    """A collective of the schedule failed or timed out; the message names the op."""


class CaptureError(ShardingError):
    """A training step cannot be captured and replayed (``shardplan.capture``); the message says why and the fix."""


class CheckpointError(ShardingError):
    """A checkpoint does not fit the model it is loaded into."""


class ForecastError(ShardingError):
    """A forecast cannot be made from these inputs (an unknown preset, a mesh the network cannot hold,
    a compute model that does not cover the plan)."""


class UnusedRuleWarning(UserWarning):
    """A rule matched no leaf: it is probably misspelled or shadowed by an earlier rule."""


class PlanWarning(UserWarning):
    """Something in a plan is legal but probably not what was meant."""


class RehearsalError(ShardingError):
    """One rank of a plan cannot be rehearsed here (a rank outside the mesh, a device too small for it,
    a plan the rehearsal cannot run yet)."""


class FP8UnavailableError(RuntimeShardingError):
    """FP8 compute (``sp.plan(..., fp8="torchao")``) cannot run here: torchao is not installed, or the device
    has no float8 matmul. The message names the fix."""
