"""Moving estimates of realized transfer bandwidth and prefill FLOP rate, feeding the planner.

Estimator: the **median of a sliding window** of the last `window` (default 64) samples, per link
and for the prefill rate. Why not an EWMA: the samples are heavy-tailed in both directions — an SSD
read served from the page cache looks 10× fast, a read queued behind write-back or a copy sharing
PCIe with another replica looks 10× slow. One such sample moves an EWMA by its weight times its
error; a median ignores any minority of outliers, yet follows a real, lasting change (a shared drive
getting busy) within window/2 samples, and forgets everything older than `window` samples.

Bandwidth samples are ``(bytes, seconds)`` of one transfer, normally timed around the data movement
alone. For samples timed around a whole request (``includes_latency=True``) the per-request latency
(seeded by calibration or the defaults below, or fed with `observe_latency`) is subtracted first;
such samples at most twice that latency say little about bandwidth and are skipped.
Nonsense — non-positive, NaN or infinite values, or a rate beyond any hardware (> 10 TB/s,
> 100 PFLOP/s per GPU) — is rejected and counted, never stored.

Until a link has samples its estimate is the seed: the rates the daemon measured before its last
restart (`kvtier.daemon.rates.kept`: `measured()` out, `reseeded()` in), else `kvtier calibrate`
results, else the DESIGN.md physics defaults (documented on `DEFAULT_LINKS` /
`DEFAULT_PREFILL_FLOPS_PER_S`).

Contract: `RateBook` is thread-safe (one lock; every method is O(window) at most) and never raises
on bad samples — `observe_*` return False instead. Reads return the current estimates.
"""

from __future__ import annotations

import enum
import math
import numbers
import statistics
import threading
from collections import deque
from collections.abc import Mapping
from typing import NamedTuple, Protocol

from kvtier.core.costmodel import CostModel
from kvtier.core.planner import PlanRates


class Link(enum.StrEnum):
    """A tier and direction whose bandwidth is estimated."""

    DRAM_READ = "dram_read"  # DRAM slot → GPU pool (H2D); clients report on Release
    DRAM_WRITE = "dram_write"  # GPU pool → DRAM slot (D2H); clients report on store
    SSD_READ = "ssd_read"  # SSD → DRAM promotion; the daemon times its own reads
    SSD_WRITE = "ssd_write"  # DRAM → SSD write-back
    REMOTE_READ = "remote_read"  # remote store → DRAM (Acquire's fetch); the daemon times it
    REMOTE_WRITE = "remote_write"  # DRAM → remote store (write-through)

    @property
    def tier(self) -> str:
        """Metric label value of the tier: 'dram' | 'ssd' | 'remote'."""
        return self.value.split("_")[0]

    @property
    def direction(self) -> str:
        """Metric label value of the direction: 'read' | 'write'."""
        return self.value.split("_")[1]


class LinkRate(NamedTuple):
    bytes_per_s: float
    latency_s: float


DEFAULT_LINKS: Mapping[Link, LinkRate] = {
    # DESIGN physics: ~48 GB/s measured for 2 MiB DMA copies over PCIe Gen5 x16 (63 GB/s peak);
    # latency: an Acquire/Release round trip over a Unix socket plus a copy launch, ~200 µs.
    Link.DRAM_READ: LinkRate(48e9, 200e-6),
    Link.DRAM_WRITE: LinkRate(48e9, 200e-6),
    # One Gen4 NVMe: ~19 µs/token for Llama-3-8B's 128 KiB/token → 131072 / 19e-6 ≈ 6.9 GB/s;
    # latency: NVMe queueing plus an LMDB read transaction and promotion bookkeeping, ~300 µs.
    Link.SSD_READ: LinkRate(6.9e9, 300e-6),
    # Sustained NVMe writes run well under reads (SLC cache exhausted); ~3 GB/s, fsync ~1 ms.
    Link.SSD_WRITE: LinkRate(3e9, 1e-3),
    # A Redis/Valkey store across a 10 GbE link: ~1.2 GB/s of large values, and a pipelined
    # round trip (EXISTS/GET of a chain) ~0.5 ms. Measured rates replace these within a few
    # requests (`kvtier.daemon.cache.remote_tier` times every fetch and check).
    Link.REMOTE_READ: LinkRate(1.2e9, 500e-6),
    Link.REMOTE_WRITE: LinkRate(1.2e9, 500e-6),
}
DEFAULT_PREFILL_FLOPS_PER_S = 0.6 * 989e12
"""H100/H200 dense bf16 peak 989 TFLOP/s at the ~60% MFU vLLM's published prefill TTFTs imply."""

MAX_BYTES_PER_S = 1e13
MAX_FLOPS_PER_S = 1e17


class Measured(NamedTuple):
    """What a book measured (from samples, not seeds): the links with samples (their current
    bandwidth and latency) and the prefill rate, None when it has no prefill samples."""

    links: dict[Link, LinkRate]
    prefill_flops_per_s: float | None


class CalibrationLike(Protocol):
    """What `RateBook.from_calibration` reads (see `kvtier.daemon.rates.calibrate.Calibration`)."""

    @property
    def prefill_flops_per_s(self) -> float | None: ...

    def seed_links(self) -> Mapping[Link, LinkRate]: ...


def _finite_pos(*xs: object) -> bool:
    """Every x is a real number (not a bool or a string), finite and > 0."""
    ok = (isinstance(x, numbers.Real) and not isinstance(x, bool) for x in xs)
    return all(ok) and all(math.isfinite(x) and float(x) > 0 for x in xs)  # type: ignore[arg-type]


class _Window:
    """Last `size` values and their cached median. Not thread-safe (the RateBook locks)."""

    __slots__ = ("_median", "_values")

    def __init__(self, size: int) -> None:
        self._values: deque[float] = deque(maxlen=size)
        self._median: float | None = None

    def add(self, x: float) -> None:
        self._values.append(x)
        self._median = None

    def median(self) -> float | None:
        if self._median is None and self._values:
            self._median = statistics.median(self._values)
        return self._median

    def __len__(self) -> int:
        return len(self._values)


class RateBook:
    """Per-link bandwidth/latency and prefill FLOP-rate estimates. Thread-safe."""

    def __init__(
        self,
        seed: Mapping[Link, LinkRate] | None = None,
        prefill_flops_per_s: float | None = None,
        window: int = 64,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._lock = threading.Lock()
        self._seed = dict(DEFAULT_LINKS)
        for link, rate in (seed or {}).items():
            if not (_finite_pos(rate.bytes_per_s) and math.isfinite(rate.latency_s)
                    and rate.latency_s >= 0):
                raise ValueError(f"invalid seed for {link}: {rate}")
            self._seed[Link(link)] = rate
        if prefill_flops_per_s is not None and not _finite_pos(prefill_flops_per_s):
            raise ValueError(f"invalid prefill seed {prefill_flops_per_s}")
        self._prefill_seed = prefill_flops_per_s or DEFAULT_PREFILL_FLOPS_PER_S
        self._window = window
        self._bw = {link: _Window(window) for link in Link}
        self._lat = {link: _Window(window) for link in Link}
        self._prefill = _Window(window)
        self.rejected = 0
        self.skipped = 0

    @classmethod
    def from_calibration(cls, cal: CalibrationLike | None, window: int = 64) -> RateBook:
        """Seeded from `kvtier calibrate` results; defaults for anything not measured."""
        if cal is None:
            return cls(window=window)
        return cls(cal.seed_links(), cal.prefill_flops_per_s, window)

    def fork(self) -> RateBook:
        """A new book with this one's seeds and no samples (one per tenant in the daemon)."""
        return RateBook(self._seed, self._prefill_seed, self._window)

    def reseeded(self, measured: Measured) -> RateBook:
        """A new book whose seeds are this one's with `measured` laid over them; no samples."""
        seeds = {**self._seed, **measured.links}
        return RateBook(seeds, measured.prefill_flops_per_s or self._prefill_seed, self._window)

    def measured(self) -> Measured:
        """The estimates that come from samples (for keeping across a restart)."""
        links = {link: LinkRate(self.bandwidth(link), self.latency(link)) for link in Link
                 if self.samples(link) or self._latency_samples(link)}
        prefill = self.prefill_flops_per_s() if self.samples(None) else None
        return Measured(links, prefill)

    def _latency_samples(self, link: Link) -> int:
        with self._lock:
            return len(self._lat[link])

    def observe_transfer(
        self, link: Link, nbytes: float, seconds: float, *, includes_latency: bool = False
    ) -> bool:
        """One request moved `nbytes` in `seconds` over `link`. False if rejected or skipped.

        By default `seconds` is the data movement alone (a client timing its copy for Release,
        the daemon timing an SSD read). With `includes_latency` it is a whole request: the
        link's latency is subtracted, and a sample at most twice the latency is skipped.
        """
        if not _finite_pos(nbytes, seconds) or nbytes / seconds > MAX_BYTES_PER_S:
            return self._reject()
        with self._lock:
            moving = seconds
            if includes_latency:
                lat = self._latency(link)
                if seconds <= 2 * lat:
                    self.skipped += 1
                    return False
                moving = seconds - lat
            self._bw[link].add(nbytes / moving)
        return True

    def observe_latency(self, link: Link, seconds: float) -> bool:
        """The fixed cost of one (near-empty) request on `link`."""
        if not (_finite_pos(seconds) or seconds == 0) or not seconds < 60:
            return self._reject()
        with self._lock:
            self._lat[link].add(float(seconds))
        return True

    def observe_prefill(self, flops: float, seconds: float) -> bool:
        """An engine spent `seconds` on `flops` of prefill work (one GPU's share)."""
        if not _finite_pos(flops, seconds) or flops / seconds > MAX_FLOPS_PER_S:
            return self._reject()
        with self._lock:
            self._prefill.add(flops / seconds)
        return True

    def observe_prefill_tokens(
        self, cost: CostModel, context_tokens: int, tokens: int, seconds: float
    ) -> bool:
        """An engine prefilled `tokens` after `context_tokens` cached ones in `seconds`."""
        if not (_finite_pos(tokens) and (context_tokens == 0 or _finite_pos(context_tokens))):
            return self._reject()
        return self.observe_prefill(cost.prefill_flops(int(context_tokens), int(tokens)), seconds)

    def _reject(self) -> bool:
        with self._lock:
            self.rejected += 1
        return False

    def _latency(self, link: Link) -> float:
        m = self._lat[link].median()
        return self._seed[link].latency_s if m is None else m

    def bandwidth(self, link: Link) -> float:
        with self._lock:
            m = self._bw[link].median()
            return self._seed[link].bytes_per_s if m is None else m

    def latency(self, link: Link) -> float:
        with self._lock:
            return self._latency(link)

    def prefill_flops_per_s(self) -> float:
        with self._lock:
            m = self._prefill.median()
            return self._prefill_seed if m is None else m

    def samples(self, link: Link | None = None) -> int:
        """Bandwidth samples held for `link` (prefill samples when None)."""
        with self._lock:
            return len(self._prefill if link is None else self._bw[link])

    def snapshot(self) -> PlanRates:
        """The planner's view: DRAM read = H2D copy, SSD read = promotion into DRAM, remote read
        = fetch from the remote store into DRAM."""
        return PlanRates(
            self.bandwidth(Link.DRAM_READ),
            self.latency(Link.DRAM_READ),
            self.bandwidth(Link.SSD_READ),
            self.latency(Link.SSD_READ),
            self.prefill_flops_per_s(),
            self.bandwidth(Link.REMOTE_READ),
            self.latency(Link.REMOTE_READ),
        )

    def export(self) -> dict[str, float]:
        """Flat gauges for metrics: '<link>_bytes_per_s', '<link>_latency_seconds',
        'prefill_flops_per_s', plus 'rejected_total' and 'skipped_total'."""
        out: dict[str, float] = {}
        for link in Link:
            out[f"{link}_bytes_per_s"] = self.bandwidth(link)
            out[f"{link}_latency_seconds"] = self.latency(link)
        out["prefill_flops_per_s"] = self.prefill_flops_per_s()
        with self._lock:
            out["rejected_total"] = float(self.rejected)
            out["skipped_total"] = float(self.skipped)
        return out
