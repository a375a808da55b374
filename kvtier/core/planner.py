"""Fetch-vs-recompute planner: a pure function (cached prefix, cost model, rates) -> prefix cut.

An engine can only skip a *computed prefix*, so a plan is a cut k: fetch blocks ``[0, k)`` of the
longest cached prefix, recompute blocks ``[k, n)`` and then the uncached suffix. For every k the
predicted TTFT-relevant time is

    T(k) = lat(k) + ssd(k) + remote(k) + pipe(h2d(k), comp(k))

    lat(k)    = h2d_latency if a DRAM, SSD or remote block is in [0,k)  +  ssd_latency if an SSD
                block is  +  remote_latency if a remote block is
    ssd(k)    = SSD bytes in [0,k) / ssd read bandwidth      (Acquire promotes SSD → DRAM first)
    remote(k) = remote bytes in [0,k) / remote read bandwidth   (Acquire fetches them into DRAM)
    h2d(k)    = non-HBM bytes in [0,k) / h2d bandwidth        (client copies slots → GPU pool)
    comp(k) = FLOPs(tokens [T_k, end + suffix), context from 0) / prefill FLOP rate
              + fetch_flops_per_token · (tokens fetched) / rate      (MLA up-projection)
    pipe(f, c) = f + c                       without overlap
               = max(f, c) + min(f, c) / L   with layer-pipelined overlap (L layers)

HBM blocks (already in the engine's pool) cost nothing to fetch. The overlap form is the finish
time of a two-stage pipeline with L equal stages in which copying layer i+1 overlaps computing
layer i: the first layer's copy (f/L) is exposed, then the slower stage dominates, then the last
layer's compute (c/L) is exposed. It is applied to the h2d copy only — SSD promotion and the
remote fetch happen inside Acquire, before the engine's forward pass — and it is conservative
in making all of layer i's compute wait for layer i's KV (only attention does). The suffix's
compute is the same for every cut, but it is part of T so that overlap (and the reported total)
are right.

Everything is a prefix sum or a closed form (see `kvtier.core.costmodel`), so all n+1 cuts are
priced with a handful of numpy passes and the exact minimum is taken: O(n), ~0.2 ms for 4,096
blocks. Ties go to the larger k (same time, fewer GPU FLOPs).

Contract: `plan` is pure and thread-safe, reads its inputs and allocates its result; it raises
`ValueError` on invalid rates or blocks. It never does I/O.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvtier.core.costmodel import CostModel
from kvtier.core.types import Tier

_HBM, _DRAM, _SSD, _REMOTE = int(Tier.HBM), int(Tier.DRAM), int(Tier.SSD), int(Tier.REMOTE)


class PlanRates(NamedTuple):
    """Rates the planner prices with (`kvtier.daemon.rates.book.RateBook.snapshot`, or by hand).

    Bandwidths in bytes/s (> 0, inf allowed), latencies in seconds per request (>= 0, finite),
    `prefill_flops_per_s` is the *achieved* rate of one GPU in prefill (> 0). The remote link
    (fetch from the shared store into DRAM) defaults to the `kvtier.daemon.rates.book` seed.
    """

    h2d_bytes_per_s: float
    h2d_latency_s: float
    ssd_bytes_per_s: float
    ssd_latency_s: float
    prefill_flops_per_s: float
    remote_bytes_per_s: float = 1.2e9
    remote_latency_s: float = 500e-6


class BlockInfo(NamedTuple):
    """One cached block: its tier, payload bytes, first token position and token count."""

    tier: Tier
    nbytes: int
    position: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Prefix:
    """The longest cached prefix as columns: `tiers` (Tier values), `nbytes`, `tokens` per block.

    Block i covers tokens ``[start + Σ tokens[:i], ...)``; `start` is the position of block 0 (the
    tokens before it are already in the engine). Build with `uniform` or `from_blocks`.
    """

    tiers: npt.NDArray[np.int8]
    nbytes: npt.NDArray[np.float64]
    tokens: npt.NDArray[np.float64]
    start: int = 0

    def __post_init__(self) -> None:
        n = len(self.tiers)
        if len(self.nbytes) != n or len(self.tokens) != n:
            raise ValueError("tiers, nbytes and tokens must have one entry per block")
        if self.start < 0:
            raise ValueError(f"start must be >= 0, got {self.start}")
        if n and (self.tiers.min() < _HBM or self.tiers.max() > _REMOTE):
            raise ValueError("tiers must be Tier values (HBM, DRAM, SSD or REMOTE)")
        if n and (self.nbytes.min() < 0 or self.tokens.min() < 1):
            raise ValueError("blocks need nbytes >= 0 and tokens >= 1")

    def __len__(self) -> int:
        return len(self.tiers)

    @classmethod
    def uniform(
        cls,
        tiers: Sequence[int] | bytes | npt.NDArray[np.integer[Any]],
        block_tokens: int,
        block_bytes: int,
        start: int = 0,
    ) -> Prefix:
        """Equal blocks (one layout): the daemon's case. `tiers` may be a bytes of Tier codes."""
        if isinstance(tiers, np.ndarray):
            t = tiers.astype(np.int8)
        else:  # bytes() of a list of Tier is ~40x faster than np.asarray on it
            try:
                raw = bytes(tiers)
            except (TypeError, ValueError):
                raise ValueError("tiers must be Tier values (HBM, DRAM, SSD or REMOTE)") from None
            t = np.frombuffer(raw, dtype=np.int8)
        n = len(t)
        return cls(
            t, np.full(n, float(block_bytes)), np.full(n, float(block_tokens)), int(start)
        )

    @classmethod
    def from_blocks(cls, blocks: Sequence[BlockInfo]) -> Prefix:
        """Blocks in order; positions must be contiguous (block i+1 starts where block i ends)."""
        cols = np.array([(b.tier, b.nbytes, b.position, b.tokens) for b in blocks], dtype=float)
        if not len(cols):
            return cls(np.zeros(0, np.int8), np.zeros(0), np.zeros(0))
        pos, tok = cols[:, 2], cols[:, 3]
        if np.any(pos[1:] != pos[:-1] + tok[:-1]):
            raise ValueError("block positions are not contiguous")
        return cls(cols[:, 0].astype(np.int8), cols[:, 1].copy(), tok.copy(), int(pos[0]))


class Reason(enum.StrEnum):
    """Why the cut is where it is (a bounded metric label)."""

    NO_PREFIX = "no_prefix"
    FETCH_ALL = "fetch_all"
    PARTIAL_CUT = "partial_cut"
    SSD_SLOWER_THAN_RECOMPUTE = "ssd_slower_than_recompute"
    REMOTE_SLOWER_THAN_RECOMPUTE = "remote_slower_than_recompute"
    DRAM_SLOWER_THAN_RECOMPUTE = "dram_slower_than_recompute"
    RECOMPUTE_ALL_FIXED_LATENCY = "recompute_all_fixed_latency"


class Plan(NamedTuple):
    """The planner's decision: fetch blocks ``[0, cut)``, recompute ``[cut, n)``.

    `blocks_by_tier[t]`: fetched blocks from Tier t (index by `Tier`: HBM, DRAM, SSD, REMOTE);
    `recompute_blocks` = n - cut. Times in seconds: `fetch_s` = latency + transfer of the fetched
    blocks (no overlap credit); `recompute_avoided_s` = compute those blocks would have cost;
    `total_s` = predicted T(cut) (fetch + remaining prefill incl. suffix, overlap-aware);
    `recompute_all_s` = T(0), `fetch_all_s` = T(n). `promote_in_background`: indices of SSD blocks
    at or beyond the cut — recomputed now, still worth promoting to DRAM for the next hit.
    """

    cut: int
    blocks_by_tier: tuple[int, int, int, int]
    recompute_blocks: int
    fetch_s: float
    recompute_avoided_s: float
    total_s: float
    recompute_all_s: float
    fetch_all_s: float
    reason: Reason
    promote_in_background: tuple[int, ...]

    @property
    def saved_s(self) -> float:
        """Predicted prefill seconds saved against recomputing everything (>= 0)."""
        return self.recompute_all_s - self.total_s


def _check_rates(r: PlanRates) -> None:
    for name in ("h2d_bytes_per_s", "ssd_bytes_per_s", "prefill_flops_per_s",
                 "remote_bytes_per_s"):
        v = getattr(r, name)
        if not v > 0:  # also rejects NaN
            raise ValueError(f"{name} must be > 0, got {v}")
    for name in ("h2d_latency_s", "ssd_latency_s", "remote_latency_s"):
        v = getattr(r, name)
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be finite and >= 0, got {v}")


def _first(mask: npt.NDArray[np.bool_]) -> int:
    """Index of the first True, or len(mask) when none."""
    i = int(mask.argmax()) if len(mask) else 0
    return i if len(mask) and mask[i] else len(mask)


class CutCosts(NamedTuple):
    """Per-cut components (arrays of n+1): latency, ssd, h2d, compute seconds, totals, and the
    remote fetch seconds."""

    latency: npt.NDArray[np.float64]
    ssd: npt.NDArray[np.float64]
    h2d: npt.NDArray[np.float64]
    compute: npt.NDArray[np.float64]
    total: npt.NDArray[np.float64]
    remote: npt.NDArray[np.float64]


def cut_costs(
    prefix: Prefix,
    cost: CostModel,
    rates: PlanRates,
    suffix_tokens: int = 0,
    overlap: bool = False,
) -> CutCosts:
    """T(k) and its parts for every cut k = 0..n (see the module docstring)."""
    tiers, n = prefix.tiers, len(prefix.tiers)
    moved = tiers != _HBM
    ssd = tiers == _SSD
    remote = tiers == _REMOTE
    t_h2d = _cumsum0(prefix.nbytes * moved)
    t_h2d /= rates.h2d_bytes_per_s
    t_ssd = _cumsum0(prefix.nbytes * ssd)
    t_ssd /= rates.ssd_bytes_per_s
    t_remote = _cumsum0(prefix.nbytes * remote)
    t_remote /= rates.remote_bytes_per_s
    pos = _cumsum0(prefix.tokens)
    pos += prefix.start
    end = float(pos[-1] + suffix_tokens)

    flops = cost.attention_flops_upto(pos)
    np.subtract(cost.attention_flops_upto(end), flops, out=flops)
    flops += (end - pos) * cost.linear_flops_per_token
    if cost.fetch_flops_per_token:
        flops += (pos - prefix.start) * cost.fetch_flops_per_token
    comp = flops
    comp /= rates.prefill_flops_per_s
    if overlap:
        pipe = np.maximum(t_h2d, comp)
        pipe += np.minimum(t_h2d, comp) / cost.layers
    else:
        pipe = t_h2d + comp
    latency = np.zeros(n + 1)
    latency[_first(moved) + 1 :] = rates.h2d_latency_s
    latency[_first(ssd) + 1 :] += rates.ssd_latency_s
    latency[_first(remote) + 1 :] += rates.remote_latency_s
    pipe += latency
    pipe += t_ssd
    pipe += t_remote
    return CutCosts(latency, t_ssd, t_h2d, comp, pipe, t_remote)


def _cumsum0(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    out = np.empty(len(x) + 1)
    out[0] = 0.0
    np.cumsum(x, out=out[1:])
    return out


def plan(
    prefix: Prefix,
    cost: CostModel,
    rates: PlanRates,
    *,
    suffix_tokens: int = 0,
    overlap: bool = False,
) -> Plan:
    """Choose the prefix cut minimizing predicted time; see `Plan` and the module docstring.

    `suffix_tokens`: prompt tokens after the cached prefix (computed whatever the cut).
    `overlap`: price layer-pipelined loading (copy of layer i+1 overlaps compute of layer i).
    """
    _check_rates(rates)
    if suffix_tokens < 0:
        raise ValueError(f"suffix_tokens must be >= 0, got {suffix_tokens}")
    c = cut_costs(prefix, cost, rates, suffix_tokens, overlap)
    n = len(prefix)
    total = c.total
    cut = n - int(np.argmin(total[::-1]))
    tiers = prefix.tiers
    counts = np.bincount(tiers[:cut], minlength=4) if cut else np.zeros(4, np.int64)
    rest = tiers[cut:]
    promote = tuple((np.flatnonzero(rest == _SSD) + cut).tolist())
    return Plan(
        cut=cut,
        blocks_by_tier=(int(counts[0]), int(counts[1]), int(counts[2]), int(counts[3])),
        recompute_blocks=n - cut,
        fetch_s=float(c.latency[cut] + c.ssd[cut] + c.remote[cut] + c.h2d[cut]),
        recompute_avoided_s=float(c.compute[0] - c.compute[cut]),
        total_s=float(total[cut]),
        recompute_all_s=float(total[0]),
        fetch_all_s=float(total[n]),
        reason=_reason(c, tiers, cut),
        promote_in_background=promote,
    )


def _reason(c: CutCosts, tiers: npt.NDArray[np.int8], cut: int) -> Reason:
    n = len(tiers)
    if n == 0:
        return Reason.NO_PREFIX
    if cut == n:
        return Reason.FETCH_ALL
    fetched_nothing = not np.any(tiers[:cut] != _HBM)
    if fetched_nothing:
        without_latency = c.total - c.latency
        if without_latency.min() < without_latency[cut]:
            return Reason.RECOMPUTE_ALL_FIXED_LATENCY
    if tiers[cut] == _SSD:
        return Reason.SSD_SLOWER_THAN_RECOMPUTE
    if tiers[cut] == _REMOTE:
        return Reason.REMOTE_SLOWER_THAN_RECOMPUTE
    if fetched_nothing:
        return Reason.DRAM_SLOWER_THAN_RECOMPUTE
    return Reason.PARTIAL_CUT
