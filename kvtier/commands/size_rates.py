"""The rates `kvtier size` prices with (`--tiers`, `--pd`, `--overload`), each with its source.

Precedence, per rate: a stated flag, else the calibration file (`--calibration`, else
`<data dir>/calibration.json` when present, as `serve` seeds its planner), else
`kvtier.daemon.rates.book`' defaults. The flags take the planner's rate names (`PlanRates`,
`RateBook`) in the vocabulary of the settings (`remote_write_bytes_per_s`): a bandwidth is a size
per second (`--h2d-bytes-per-s 48GB`), the prefill rate a FLOP count per second
(`--prefill-flops-per-s 5.934e14`). Latencies stay the calibration's or the defaults'.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from kvtier.core.errors import UsageError
from kvtier.core.paths import data_dir
from kvtier.core.units import parse_size
from kvtier.daemon.rates.book import (
    DEFAULT_LINKS,
    DEFAULT_PREFILL_FLOPS_PER_S,
    MAX_BYTES_PER_S,
    MAX_FLOPS_PER_S,
    Link,
    RateBook,
)
from kvtier.daemon.rates.calibrate import calibration_path, load_calibration

STATED_LINKS: dict[str, tuple[str, Link, str]] = {
    # flag -> (rate key, link, what it is)
    "--h2d-bytes-per-s": ("h2d_bytes_per_s", Link.DRAM_READ, "DRAM -> GPU copy"),
    "--d2h-bytes-per-s": ("d2h_bytes_per_s", Link.DRAM_WRITE, "GPU -> DRAM copy"),
    "--ssd-read-bytes-per-s": ("ssd_bytes_per_s", Link.SSD_READ, "SSD read"),
    "--remote-read-bytes-per-s": ("remote_bytes_per_s", Link.REMOTE_READ, "remote tier read"),
}
SOURCE_KEY = {
    Link.DRAM_READ: "dram",
    Link.DRAM_WRITE: "dram_write",
    Link.SSD_READ: "ssd",
    Link.REMOTE_READ: "remote",
}


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def add_arguments(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group(
        "rates for --tiers, --pd and --overload (stated, else the calibration file, else the "
        "planner's defaults)"
    )
    r.add_argument(
        "--calibration",
        metavar="PATH",
        help="a `kvtier calibrate` file (default: <data dir>/calibration.json when present, "
        "else the planner's default rates)",
    )
    for flag, (_, link, what) in STATED_LINKS.items():
        d = DEFAULT_LINKS[link].bytes_per_s
        r.add_argument(
            flag, metavar="SIZE", help=f"{what} bandwidth per second, e.g. {d / 1e9:g}GB"
        )
    r.add_argument(
        "--prefill-flops-per-s",
        metavar="N",
        help=f"achieved prefill FLOP rate of one GPU, e.g. {DEFAULT_PREFILL_FLOPS_PER_S:g}",
    )


def _stated_bandwidth(text: str, flag: str) -> float:
    n = parse_size(text, flag).bytes
    if n <= 0:
        raise UsageError(f"{flag} must be > 0, got {text}")
    if n > MAX_BYTES_PER_S:
        raise UsageError(f"{flag} {text} is beyond any link (limit {MAX_BYTES_PER_S:g} B/s)")
    return float(n)


def _stated_flops(text: str) -> float:
    flag = "--prefill-flops-per-s"
    try:
        x = float(text)
    except ValueError:
        raise UsageError(f"{flag} must be a number such as 5.934e14, got {text!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise UsageError(f"{flag} must be > 0, got {text}")
    if x > MAX_FLOPS_PER_S:
        raise UsageError(f"{flag} {text} is beyond any GPU (limit {MAX_FLOPS_PER_S:g} FLOP/s)")
    return x


def planner_rates(a: argparse.Namespace) -> tuple[dict[str, float], dict[str, str]]:
    """The rates (`PlanRates` names, plus d2h) and, per rate, where it came from."""
    path: Path | None = None
    if a.calibration is not None:
        path = Path(a.calibration)
    else:
        default = calibration_path(data_dir(os.environ))
        path = default if default.exists() else None
    cal = load_calibration(path) if path is not None else None
    book = RateBook.from_calibration(cal)
    r = book.snapshot()
    measured = set(cal.links) if cal else set()

    def src(link: Link) -> str:
        if link in measured:
            return f"calibration {path}"
        d = DEFAULT_LINKS[link]
        return f"default ({d.bytes_per_s:g} B/s, {d.latency_s:g} s; kvtier.daemon.rates)"

    rates = {
        "h2d_bytes_per_s": r.h2d_bytes_per_s,
        "h2d_latency_s": r.h2d_latency_s,
        "ssd_bytes_per_s": r.ssd_bytes_per_s,
        "ssd_latency_s": r.ssd_latency_s,
        "remote_bytes_per_s": r.remote_bytes_per_s,
        "remote_latency_s": r.remote_latency_s,
        "prefill_flops_per_s": r.prefill_flops_per_s,
        "d2h_bytes_per_s": book.bandwidth(Link.DRAM_WRITE),
        "d2h_latency_s": book.latency(Link.DRAM_WRITE),
    }
    sources = {key: src(link) for link, key in SOURCE_KEY.items()}
    sources["prefill"] = (
        f"calibration {path}"
        if cal and cal.prefill_flops_per_s
        else f"default ({DEFAULT_PREFILL_FLOPS_PER_S:g} FLOP/s = 60% of H100 bf16 peak; "
        "kvtier.daemon.rates)"
    )
    for flag, (key, link, _) in STATED_LINKS.items():
        text = getattr(a, _dest(flag))
        if text is not None:
            rates[key] = _stated_bandwidth(text, flag)
            latency = rates[key.replace("bytes_per_s", "latency_s")]
            origin = "calibration" if link in measured else "default"
            sources[SOURCE_KEY[link]] = f"stated: {flag} {text}; latency {latency:g} s {origin}"
    if a.prefill_flops_per_s is not None:
        rates["prefill_flops_per_s"] = _stated_flops(a.prefill_flops_per_s)
        sources["prefill"] = f"stated: --prefill-flops-per-s {a.prefill_flops_per_s}"
    return rates, sources
