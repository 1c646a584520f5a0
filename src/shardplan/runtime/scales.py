"""The scales of a buffer's low-precision gathers and their checks, as mixins of
:class:`~shardplan.runtime.buffers.BufferState` (whose ``__init__`` sets the attributes they use).

``Float8Scales``: FP8 compute's tensorwise gather (``bp.tensorwise``): each float8 weight's absmax over the
shard group (the ``all_reduce scales`` op), its scale as torchao computes it, this rank's shard cast to float8
codes with it, and the gather's hand-off of the scales. ``NonFiniteChecks``: a NaN or inf found in a float8
weight's absmax or in a quantized gather's block scales, raised at once on the host, after a deferred check on
a GPU, or after the replay of a captured step, naming the parameter (docs/low_precision.md)."""

from __future__ import annotations

import math

import torch

from ..errors import RuntimeShardingError
from ..lowp import BLOCK
from .capture import session as CAP
from .quantize import bad_blocks, first_bad_block, first_bad_block_index, first_non_finite, first_non_finite_index


def _first_index(pending) -> int:
    """The index a deferred non-finite check found (``quantize.first_non_finite``'s pair), once it is on the host."""
    index, event = pending
    if event is not None:
        event.synchronize()
    return int(index.item())


class Float8Scales:
    """FP8 compute's per-weight scales on one buffer. Uses ``members``, ``held_idx``, ``padded``, ``shard``, ``S``,
    ``device``, ``scales`` (fp32, one per member; the full parameters' scales are views of it), ``scaled``,
    ``defer_check``, ``pending_tw`` and ``bp``."""

    def amax(self) -> torch.Tensor:
        """The absmax of this rank's piece of every parameter (fp32; 0 where it holds none): a tensorwise gather's
        first step, all-reduced (max) over the shard group before :meth:`set_scales`."""
        with torch.no_grad():
            held = self.held_idx
            if not held:
                return torch.zeros(len(self.members), dtype=torch.float32, device=self.device)
            # the inf-norm is the absmax (as torchao's precompute takes it): one foreach kernel
            norms = torch.stack(torch._foreach_norm([self.shard[self.members[i].shard] for i in held], ord=math.inf))
            # NaN as inf: the max all-reduce may drop a NaN (gloo keeps the other rank's value), never an inf
            norms = torch.where(torch.isnan(norms), torch.full_like(norms, math.inf), norms)
            if len(held) == len(self.members):
                return norms.float()
            out = torch.zeros(len(self.members), dtype=torch.float32, device=self.device)
            for k, i in enumerate(held):
                out[i] = norms[k]
        return out

    def set_scales(self, amax: torch.Tensor) -> None:
        """Every parameter's float8 scale from its absmax over the whole weight, as torchao computes it
        (``amax_to_scale``: 448 / max(amax, 1e-12) in float64, then fp32), into ``scales`` in place (the full
        parameters' scales are views of it). A non-finite absmax raises on every rank alike, naming the
        parameter: at once on the host, at the buffer's next gather on a GPU ([Note: the non-finite check
        without a host sync]; the all-reduced absmax is the same on every rank, so every rank raises there)."""
        with torch.no_grad():
            if self.defer_check and CAP.capturing():  # [Note: the non-finite check in a captured step]
                CAP.note_check(self, "tw", first_non_finite_index(amax))
            elif self.defer_check:
                self.check_pending()
                self.pending_tw = first_non_finite(amax)
            elif not bool(torch.isfinite(amax).all()):
                bad = [m.name for m, a in zip(self.members, amax.tolist()) if not math.isfinite(a)]
                raise RuntimeShardingError(self._tw_non_finite(bad))
            scale = 448.0 / torch.clamp(amax.to(torch.float64), min=1e-12)
            self.scales.copy_(scale.to(torch.float32))

    def _quantize_tw(self, out: torch.Tensor) -> None:
        """This rank's shard as float8 codes (uint8) into ``out[:S]``, each piece with its parameter's scale
        (torchao's cast: fp32 times the scale, saturated to +-448); padding is zero."""
        with torch.no_grad():
            if self.padded:  # padding (and gaps) send zero codes
                out[:self.S].zero_()
            codes = out[:self.S].view(torch.float8_e4m3fn)
            for i, m in enumerate(self.members):
                if m.held:
                    x = self.shard[m.shard].float() * self.scales[i]
                    codes[m.shard].copy_(x.clamp_(-448.0, 448.0))

    def take_scales(self, op) -> None:
        """The gather of a float8 buffer consumes the scales its ``all_reduce scales`` op set."""
        if not self.scaled:
            raise RuntimeShardingError(f"shardplan: {op.kind} {op.what} of unit {op.unit!r} at {op.trigger} gathers float8 "
                                       f"buffer #{self.bp.index} without the all_reduce of its scales before it; the "
                                       f"schedule is inconsistent (plan.validate() says where)")
        self.scaled = False


class NonFiniteChecks:
    """A NaN or inf a low-precision gather found: a float8 weight's absmax (``"tw"``) or a block of a quantized
    gather's scales (``"block"``). Uses ``wire``, ``S``, ``defer_check``, ``pending_tw``, ``pending_check``,
    ``members``, ``qfmt``, ``plan``, ``bp`` and ``_group``."""

    def _check_blocks(self, segments: int) -> None:
        """The gathered wire's block scales all finite: checked at once on the host, else deferred to this
        buffer's next gather (or noted for the captured step to check after its replay)."""
        # [Note: the non-finite check in a captured step] (shardplan.capture) the check cannot read the host inside
        # the graph: the index is left in a device tensor the graph rewrites at every replay, and the captured
        # step copies every such index back after the replay and raises at its next call (one step later, as
        # the eager check raises at the buffer's next gather), naming the parameter as the eager check does.
        # [Note: the non-finite check without a host sync] on the host (CPU tensors) the scales are checked at
        # once. On a GPU, reading a flag back per gather would stall the host behind every gather: the first
        # non-finite block's index is copied back without blocking and checked at this buffer's next gather
        # (its weights are NaN meanwhile: the dequantized block is). Every rank checks the same gathered scales
        # at the same op, so every rank raises together.
        if self.defer_check and CAP.capturing():  # [Note: the non-finite check in a captured step]
            CAP.note_check(self, "block", first_bad_block_index(self.wire, self.S, segments))
        elif self.defer_check:
            self.check_pending()
            self.pending_check = first_bad_block(self.wire, self.S, segments)
        else:
            bad = bad_blocks(self.wire, self.S, segments)
            if bad:
                self.wire = None
                raise RuntimeShardingError(self._non_finite(*bad[0]))

    def _tw_non_finite(self, names: list[str]) -> str:
        return (f"shardplan: parameter {', '.join(names[:3])} holds NaN or inf (buffer #{self.bp.index}, unit "
                f"{self.bp.unit}), found when casting it to float8 for its gather; lower the learning rate or clip "
                f"gradients (sp.clip_grad_norm_), and check the loss for NaN")

    def check_pending(self) -> None:
        """Raise for a non-finite block (or a float8 weight's absmax) an earlier (deferred) check found."""
        tw, self.pending_tw = self.pending_tw, None
        if tw is not None:
            self.raise_non_finite("tw", _first_index(tw))
        pending, self.pending_check = self.pending_check, None
        if pending is not None:
            self.raise_non_finite("block", _first_index(pending))

    def raise_non_finite(self, kind: str, k: int) -> None:
        """Raise for index ``k`` (>= 0) a non-finite check found: a float8 weight (``"tw"``: a member's index) or a
        block of the gathered scales (``"block"``: segment * blocks + block); nothing for -1."""
        if k < 0:
            return
        if kind == "tw":
            raise RuntimeShardingError(self._tw_non_finite([self.members[k].name]))
        nb = -(-self.S // BLOCK)
        raise RuntimeShardingError(self._non_finite(k // nb, (k % nb) * BLOCK))

    def _non_finite(self, segment: int, start: int) -> str:
        """The error for a NaN/inf in ``segment``'s shard at ``start`` (a block of it): names the parameter."""
        group = self._group(self.plan)
        rank = group[segment] if segment < len(group) else segment
        names = [pc.param for pc in self.plan.buffer_pieces(self.bp.index, rank)
                 if pc.numel and pc.shard_offset < start + BLOCK and start < pc.shard_offset + pc.numel]
        return (f"shardplan: parameter {', '.join(names) or '(padding)'} holds NaN or inf on rank {rank} (buffer "
                f"#{self.bp.index}, unit {self.bp.unit}), found when quantizing it for its {self.qfmt} gather; "
                f"lower the learning rate or clip gradients (sp.clip_grad_norm_), and check the loss for NaN")
