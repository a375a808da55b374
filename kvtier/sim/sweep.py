"""Hit ratio against capacity: a sweep of replays and Belady ceilings, and its plot.

The sweep keeps the DRAM share of the user's configuration (all DRAM when no SSD was given) and
spaces total capacities geometrically from ~1% of the trace's distinct blocks up to all of them
(where a cache can reach the infinite ceiling), plus the configured point.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from kvtier.core.errors import UsageError
from kvtier.sim.ceilings import belady, flatten, next_uses
from kvtier.sim.config import TierConfig
from kvtier.sim.replay import replay
from kvtier.sim.trace import Request


class SweepPoint(NamedTuple):
    dram_blocks: int
    ssd_blocks: int
    hit_ratio: float
    belady_hit_ratio: float

    @property
    def total_blocks(self) -> int:
        return self.dram_blocks + self.ssd_blocks


def sweep_configs(base: TierConfig, distinct_blocks: int, points: int) -> list[TierConfig]:
    """`points` geometric total capacities in [~1% of distinct, distinct], plus `base` itself."""
    if points < 2:
        raise UsageError(f"--sweep-points must be >= 2, got {points}")
    total = base.total_blocks
    share = base.dram_blocks / total if total else 1.0
    lo, hi = max(8, distinct_blocks // 100), max(16, distinct_blocks)
    totals = {round(lo * (hi / lo) ** (i / (points - 1))) for i in range(points)}
    out = {base}
    for t in totals:
        dram = round(t * share)
        out.add(replace(base, dram_blocks=dram, ssd_blocks=t - dram))
    return sorted(out, key=lambda c: (c.total_blocks, c.dram_blocks))


def run_sweep(
    requests: Sequence[Request],
    configs: Sequence[TierConfig],
    on_point: Callable[[], None] | None = None,
) -> list[SweepPoint]:
    """Replay and compute Belady MIN at every configuration."""
    refs = flatten(requests)
    nxt = next_uses(refs)
    n = len(refs)
    out = []
    for cfg in configs:
        stats = replay(requests, cfg)
        best = belady(requests, cfg.total_blocks, nxt).prefix_hits
        out.append(SweepPoint(cfg.dram_blocks, cfg.ssd_blocks, stats.hit_ratio, best / n))
        if on_point is not None:
            on_point()
    return out


def sweep_json(points: Sequence[SweepPoint]) -> list[dict[str, Any]]:
    return [
        {
            "dram_blocks": p.dram_blocks,
            "ssd_blocks": p.ssd_blocks,
            "hit_ratio": p.hit_ratio,
            "belady_hit_ratio": p.belady_hit_ratio,
        }
        for p in points
    ]


def check_plot_target(path: str) -> None:
    """Fail fast, before a long sweep, when matplotlib is missing or the file cannot be written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib, which is not installed (pip install 'matplotlib>=3.8')"
        ) from None
    target = Path(path)
    if target.suffix.lower() != ".png":
        raise UsageError(f"--plot writes a PNG file; {path!r} does not end in .png")
    if not target.parent.is_dir():
        raise UsageError(f"--plot: directory {str(target.parent)!r} does not exist")


def save_plot(fig: Any, path: str) -> None:
    """Writes matplotlib figure `fig` to `path` and closes it; an unwritable path is a
    UsageError (`--plot`)."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path)
    except OSError as exc:
        raise UsageError(f"--plot: cannot write {path!r}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def plot(
    points: Sequence[SweepPoint],
    infinite_ratio: float,
    base: TierConfig,
    title: str,
    path: str,
    block_bytes: int | None = None,
) -> None:
    """Write hit ratio (replay, Belady MIN, infinite) against total capacity as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p.total_blocks for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot(
        xs, [p.belady_hit_ratio for p in points], "s--", label="Belady MIN (clairvoyant optimum)"
    )
    ax.plot(xs, [p.hit_ratio for p in points], "o-", label=f"kvtier index, {base.policy}")
    ax.axhline(infinite_ratio, color="gray", linestyle=":", label="infinite cache")
    ax.axvline(base.total_blocks, color="tab:red", alpha=0.3, label="configured capacity")
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    ax.set_xlabel("DRAM + SSD capacity (512-token blocks)")
    if block_bytes:
        gib = block_bytes / 2**30

        def to_gib(blocks: Any) -> Any:
            return blocks * gib

        def to_blocks(size: Any) -> Any:
            return size / gib

        sec = ax.secondary_xaxis("top", functions=(to_gib, to_blocks))
        sec.set_xlabel("GiB")
    ax.set_ylabel("prefix-hit ratio")
    ax.set_title(title, fontsize=10, pad=30 if block_bytes else 6)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    save_plot(fig, path)
