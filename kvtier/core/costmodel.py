"""Prefill cost of a model: FLOPs to (re)compute a token range, for the fetch-vs-recompute planner.

Conventions (one FLOP = one multiply or one add; a multiply-add is 2 FLOPs):

* Linear part: ``2·P`` FLOPs per token, P = *active* matmul parameters touched per token — the
  layers' projections and MLPs (MoE: shared + top-k routed experts). The input embedding is a
  lookup, not a matmul, and prefill applies the LM head only to the last token, so neither is in P.
* Attention part, per layer and per (query, key) pair: ``2·H·(d_qk + d_v)`` — QKᵀ costs
  ``2·H·d_qk`` and the weighted sum AV costs ``2·H·d_v`` (H = query heads). For MHA/GQA
  ``d_qk = d_v = head_dim``, so this is ``4·d_attn`` with ``d_attn = H·head_dim``. For MLA in
  prefill (non-absorbed) ``d_qk = qk_nope + qk_rope`` and ``d_v = v_head_dim``.
* Causal prefill: the token at 0-based position j attends to ``j + 1`` keys (``min(j + 1, w)`` for
  a sliding window w). A block of b tokens at position p therefore costs, per full-attention layer,
  ``pair · Σ_{j=p}^{p+b-1} (j+1) = pair · b·(p + (b+1)/2)``. With ``pair = 4·d_attn`` this is
  ``4·d_attn·b·(p + b/2)`` up to the diagonal term — twice the ``2·L·d_attn·b·(p + b/2)`` often
  quoted: that factor 2 counts QKᵀ only (Kaplan et al. 2020, Table 1 "Attention: mask"), whose
  ``2·n_layer·n_ctx·d_attn`` per token with a *full* window n_ctx equals QKᵀ+AV over a causal
  average context of n_ctx/2. We count both products exactly.
* Recurrent (Mamba / linear-attention) layers have no context term: their projections are in P;
  the per-token state update (a few FLOPs per state element, ~0.1% of 2·P) is left out.
* MLA fetch overhead: a fetched latent (kv_lora_rank wide) must be up-projected to K and V before
  prefill attention can use it, ``2·r·H·(qk_nope + v)`` FLOPs per fetched token per MLA layer; a
  recomputed token pays this inside P. ``fetch_flops_per_token`` carries it.

The cumulative attention work of tokens ``[0, x)`` has a closed form (see `attention_flops_upto`),
so the cost of any contiguous range is a difference of two evaluations: the planner's O(n) cut
search relies on that.

Tensor parallelism: `from_spec(spec, tp=...)` divides FLOPs by ``tp`` (one rank's share; the planner
pairs it with one GPU's FLOP rate) and takes one rank's KV bytes from the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from kvtier.core.presets import ModelSpec

FloatArray = npt.NDArray[np.float64]
X = TypeVar("X", float, FloatArray)


@dataclass(frozen=True, slots=True)
class AttnGroup:
    """`layers` attention layers sharing one shape.

    `pair_flops`: FLOPs per layer per (query, key) pair, ``2·H·(d_qk + d_v)``.
    `window`: sliding window in tokens (a query sees at most `window` keys, itself included);
    0 = full causal attention.
    """

    layers: int
    pair_flops: float
    window: int = 0

    def __post_init__(self) -> None:
        if self.layers < 0 or self.pair_flops < 0 or self.window < 0:
            raise ValueError(f"AttnGroup fields must be >= 0: {self}")


def causal_pairs_upto(x: X, window: int = 0) -> X:
    """Number of (query, key) pairs of causal attention over tokens ``[0, x)``.

    ``Σ_{j<x} min(j+1, w)`` = ``x(x+1)/2`` for full attention; with a window w it is
    ``m(m+1)/2 + (x-m)·w`` where ``m = min(x, w)``.
    """
    if window <= 0:
        return x * (x + 1) / 2
    m = np.minimum(x, window)
    return m * (m + 1) / 2 + (x - m) * window  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class CostModel:
    """What the planner needs to price recomputation; immutable, cheap to share across threads.

    `linear_flops_per_token`: context-independent FLOPs per token (``2·P`` + recurrent state
    updates), per rank. `attn`: attention layer groups (per-rank FLOPs). `layers`: decoder layers,
    the stages of layer-pipelined loading. `kv_bytes_per_token`: one rank's cached bytes per token
    (used by reports; the planner takes bytes from the blocks). `fetch_flops_per_token`: compute
    a *fetched* token still costs (MLA latent up-projection), per rank.
    """

    name: str
    linear_flops_per_token: float
    attn: tuple[AttnGroup, ...]
    layers: int
    kv_bytes_per_token: float = 0.0
    fetch_flops_per_token: float = 0.0

    def __post_init__(self) -> None:
        vals = (self.linear_flops_per_token, self.kv_bytes_per_token, self.fetch_flops_per_token)
        if self.layers < 1 or any(not np.isfinite(v) or v < 0 for v in vals):
            raise ValueError(f"invalid CostModel {self.name!r}: {self}")

    def attention_flops_upto(self, x: X) -> X:
        """Attention FLOPs to prefill tokens ``[0, x)`` (x may be a float64 array)."""
        total: Any = 0.0 * x
        for g in self.attn:
            total = total + g.layers * g.pair_flops * causal_pairs_upto(x, g.window)
        return total  # type: ignore[no-any-return]

    def prefill_flops(self, start: int, count: int) -> float:
        """FLOPs to compute tokens ``[start, start+count)`` given KV for ``[0, start)``."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0 (got {start}, {count})")
        end = float(start + count)
        attn = self.attention_flops_upto(end) - self.attention_flops_upto(float(start))
        return self.linear_flops_per_token * count + attn

    def token_flops(self, position: int) -> float:
        """FLOPs of the single token at 0-based `position` (reference form, used by tests)."""
        attn = sum(
            g.layers * g.pair_flops * (min(position + 1, g.window) if g.window else position + 1)
            for g in self.attn
        )
        return self.linear_flops_per_token + attn

    @classmethod
    def dense(
        cls,
        name: str,
        active_params: float,
        layers: int,
        attn_dim: int,
        sliding_window: int = 0,
        kv_bytes_per_token: float = 0.0,
    ) -> CostModel:
        """A model whose `layers` layers all use MHA/GQA with ``attn_dim = H·head_dim`` query width.

        Matches the daemon protocol's ``ModelCost`` message; ``sliding_window`` 0 = full attention.
        `active_params`: matmul parameters per token, without the input embedding (and ideally
        without the LM head, which prefill applies to one token only).
        """
        group = AttnGroup(layers, 4.0 * attn_dim, sliding_window)
        return cls(name, 2.0 * active_params, (group,), layers, kv_bytes_per_token)

    @classmethod
    def from_spec(cls, spec: ModelSpec, tp: int = 1, **layout_kwargs: Any) -> CostModel:
        """Cost model of one of `tp` tensor-parallel ranks of a `kvtier.core.presets.ModelSpec`.

        ``2·P`` uses ``spec.active_params`` minus the LM head (``vocab·hidden``): prefill runs the
        head on the last token only, the same for every cut. Heads split evenly across ranks, so
        all FLOPs are divided by `tp`. `layout_kwargs` (dtype, block_tokens) go to
        ``spec.layout(...)`` for one rank's KV bytes per token. Raises `UsageError` when `tp` cannot
        split the model (as ``spec.layout`` does).
        """
        from kvtier.core.layout import AttentionKind

        layout = spec.layout(tp_size=tp, **layout_kwargs)
        heads = spec.num_attention_heads
        pair = 2.0 * heads * (spec.head_dim + spec.v_head_dim) / tp
        counts: dict[int, int] = {}
        fetch = 0.0
        for layer in spec.layers:
            if layer.kind is AttentionKind.RECURRENT:
                continue
            counts[layer.window] = counts.get(layer.window, 0) + 1
            if layer.kind is AttentionKind.MLA:
                nope = spec.head_dim - layer.rope_dim
                fetch += 2.0 * layer.kv_lora_rank * heads * (nope + spec.v_head_dim) / tp
        groups = tuple(AttnGroup(n, pair, w) for w, n in sorted(counts.items()))
        linear = 2.0 * (spec.active_params - spec.vocab_size * spec.hidden_size) / tp
        return cls(
            spec.name, linear, groups, spec.num_layers, float(layout.bytes_per_token()), fetch
        )
