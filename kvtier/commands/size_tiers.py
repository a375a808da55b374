"""`kvtier size --tiers`: what each tier is worth per hit token, and SSD wear.

Per hit token of a `--prompt-tokens` prefix, on one TP rank (each rank moves and computes its
share in parallel), priced with the planner's rates (`kvtier.core.planner.PlanRates`):

    recompute  = prefill FLOPs of the prefix / prompt tokens / prefill FLOP rate
                 (`CostModel.from_spec`, one rank's share)
    DRAM fetch = b / h2d bandwidth + h2d latency / prompt tokens
    SSD fetch  = b / SSD read + b / h2d + (SSD + h2d latency) / prompt tokens  (promoted, copied)
    remote     = b / remote read + b / h2d + (remote + h2d latency) / prompt tokens
    worth      = recompute - fetch    (b = one rank's KV bytes per token)

No layer-pipelined overlap is counted (the planner may hide part of the h2d copy behind compute).
Break-even: a model whose KV per token is b pays the same to fetch as to recompute when its
linear FLOPs 2 x P / TP equal fetch x rate, so below P = fetch x rate x TP / 2 active parameters
(attention FLOPs ignored) the tier should not exist for it.

Rates: `kvtier.commands.size_rates` (stated flags, else the calibration file, else the planner's
defaults); each is printed with its source. SSD wear: the drive's rated endurance (`--ssd-dwpd`,
`--ssd-warranty-years`) over the write rate a workload implies (`--ssd-writes-per-day`, or a
`kvtier simulate --json` file with `--trace-seconds`), against the budget `serve` enforces
(ssd_bytes x ssd_dwpd a day).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from kvtier.commands.size_rates import planner_rates
from kvtier.core.costmodel import CostModel
from kvtier.core.errors import UsageError
from kvtier.core.layout import KVLayout
from kvtier.core.presets import ModelSpec
from kvtier.core.units import format_bytes, parse_size

SECONDS_PER_DAY = 86_400


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("what each tier is worth (--tiers)")
    t.add_argument(
        "--tiers",
        action="store_true",
        help="price a hit token from DRAM, SSD and the remote tier against recomputing it",
    )
    t.add_argument(
        "--ssd-dwpd",
        metavar="X",
        default="1",
        help="the drive's rated drive writes per day, also serve's ssd_dwpd budget (1)",
    )
    t.add_argument(
        "--ssd-warranty-years",
        metavar="Y",
        default="5",
        help="years the rating covers (5)",
    )
    t.add_argument(
        "--ssd-writes-per-day",
        metavar="SIZE",
        help="the workload's SSD write rate per day, e.g. 3TB",
    )
    t.add_argument(
        "--simulate-json",
        metavar="PATH",
        help="take the write rate from `kvtier simulate --json` output (ssd_bytes_written) "
        "over --trace-seconds",
    )
    t.add_argument(
        "--trace-seconds",
        metavar="S",
        help="the simulated trace's span in seconds (with --simulate-json)",
    )


def _number(text: str, flag: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise UsageError(f"{flag} must be a number, got {text!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise UsageError(f"{flag} must be > 0, got {text}")
    return x


def _write_rate(a: argparse.Namespace) -> tuple[float | None, str]:
    if a.ssd_writes_per_day is not None and a.simulate_json is not None:
        raise UsageError("give --ssd-writes-per-day or --simulate-json, not both")
    if a.ssd_writes_per_day is not None:
        return float(parse_size(a.ssd_writes_per_day, "--ssd-writes-per-day").bytes), (
            f"--ssd-writes-per-day {a.ssd_writes_per_day}"
        )
    if a.simulate_json is None:
        return None, "no write rate given (--ssd-writes-per-day or --simulate-json)"
    if a.trace_seconds is None:
        raise UsageError("--simulate-json needs --trace-seconds (the trace's span)")
    span = _number(a.trace_seconds, "--trace-seconds")
    try:
        doc = json.loads(Path(a.simulate_json).read_text(encoding="utf-8"))
        written = doc["ssd_bytes_written"]
    except OSError as exc:
        raise UsageError(f"cannot read {a.simulate_json!r}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError):
        raise UsageError(
            f"{a.simulate_json!r} is not `kvtier simulate --json` output (no ssd_bytes_written)"
        ) from None
    if not isinstance(written, (int, float)) or isinstance(written, bool) or written < 0:
        raise UsageError(f"{a.simulate_json!r}: ssd_bytes_written must be a byte count")
    per_day = written / span * SECONDS_PER_DAY
    return per_day, (
        f"simulate: {int(written):,} B written in {span:g} s of trace = {per_day:,.0f} B/day"
    )


def compute(
    spec: ModelSpec, layout: KVLayout, prompt_tokens: int, ssd_bytes: int | None,
    a: argparse.Namespace,
) -> dict[str, Any]:
    """The `tiers` object of `--json` (see the module docstring)."""
    rates, sources = planner_rates(a)
    cost = CostModel.from_spec(spec, tp=layout.tp_size, dtype=layout.dtype)
    n = prompt_tokens
    f = rates["prefill_flops_per_s"]
    flops = float(cost.prefill_flops(0, n))
    recompute = flops / n / f
    b = layout.bytes_per_token()
    h2d = b / rates["h2d_bytes_per_s"]
    fetch = {
        "dram": h2d + rates["h2d_latency_s"] / n,
        "ssd": b / rates["ssd_bytes_per_s"] + h2d
        + (rates["ssd_latency_s"] + rates["h2d_latency_s"]) / n,
        "remote": b / rates["remote_bytes_per_s"] + h2d
        + (rates["remote_latency_s"] + rates["h2d_latency_s"]) / n,
    }
    tiers = {
        name: {
            "fetch_s_per_token": s,
            "worth_s_per_token": recompute - s,
            "worth_it": bool(recompute > s),
            "break_even_active_params": s * f * layout.tp_size / 2,
            "rate_source": sources[name],
        }
        for name, s in fetch.items()
    }
    return {
        "prompt_tokens": n,
        "kv_bytes_per_token": b,
        "rates": rates,
        "prefill_source": sources["prefill"],
        "recompute_s_per_token": recompute,
        "recompute_flops": flops,
        "tiers": tiers,
        "ssd_wear": _wear(ssd_bytes, a),
    }


def _wear(ssd_bytes: int | None, a: argparse.Namespace) -> dict[str, Any] | None:
    dwpd = _number(a.ssd_dwpd, "--ssd-dwpd")
    years = _number(a.ssd_warranty_years, "--ssd-warranty-years")
    rate, rate_source = _write_rate(a)
    if ssd_bytes is None:
        if rate is not None:
            raise UsageError("SSD wear needs the drive size: give --ssd SIZE")
        return None
    endurance = ssd_bytes * dwpd * 365 * years
    budget = ssd_bytes * dwpd
    out: dict[str, Any] = {
        "drive_bytes": ssd_bytes,
        "dwpd": dwpd,
        "warranty_years": years,
        "endurance_bytes": endurance,
        "budget_bytes_per_day": budget,
        "write_bytes_per_day": rate,
        "write_source": rate_source,
        "days_to_endurance": None,
        "days_to_endurance_under_budget": None,
        "budget_refuses_share": None,
    }
    if rate:
        out["days_to_endurance"] = endurance / rate
        granted = min(rate, budget)
        out["days_to_endurance_under_budget"] = endurance / granted
        out["budget_refuses_share"] = max(0.0, 1 - budget / rate)
    return out


def _t(s: float) -> str:
    return f"{s * 1e6:.3f} us"


def render(t: dict[str, Any]) -> list[str]:
    r = t["rates"]
    n, b = t["prompt_tokens"], t["kv_bytes_per_token"]
    lines = [
        "",
        f"what each tier is worth per hit token ({n:,}-token prefix, one rank, "
        f"{b:,} B of KV per token)",
        f"  recompute  {_t(t['recompute_s_per_token'])} = {t['recompute_flops']:.4g} FLOPs / "
        f"{n:,} tokens / {r['prefill_flops_per_s']:.4g} FLOP/s  [{t['prefill_source']}]",
    ]
    forms = {
        "dram": f"{b:,} B / {r['h2d_bytes_per_s']:.4g} B/s + {r['h2d_latency_s']:g} s / {n:,}",
        "ssd": f"{b:,} B / {r['ssd_bytes_per_s']:.4g} + {b:,} B / {r['h2d_bytes_per_s']:.4g} "
        f"+ ({r['ssd_latency_s']:g} + {r['h2d_latency_s']:g}) s / {n:,}",
        "remote": f"{b:,} B / {r['remote_bytes_per_s']:.4g} + {b:,} B / "
        f"{r['h2d_bytes_per_s']:.4g} + ({r['remote_latency_s']:g} + {r['h2d_latency_s']:g}) "
        f"s / {n:,}",
    }
    for name, x in t["tiers"].items():
        net = x["worth_s_per_token"]
        verdict = (
            f"saves {_t(net)} per hit token"
            if x["worth_it"]
            else f"loses {_t(-net)} per hit token: NOT worth it, recompute"
        )
        lines += [
            f"  {name:<7}    fetch {_t(x['fetch_s_per_token'])} = {forms[name]}  "
            f"[{x['rate_source']}]",
            f"             {verdict}; "
            f"break-even below {x['break_even_active_params'] / 1e9:.3g}B active params "
            f"= fetch x rate x TP / 2",
        ]
    w = t["ssd_wear"]
    if w:
        budget = format_bytes(int(w["budget_bytes_per_day"]))
        lines.append(
            f"  SSD wear   endurance {format_bytes(int(w['endurance_bytes']))} = "
            f"{format_bytes(w['drive_bytes'])} x {w['dwpd']:g} DWPD x 365 x "
            f"{w['warranty_years']:g} years; serve's budget {budget}/day"
        )
        if w["write_bytes_per_day"]:
            lines.append(
                f"             at {format_bytes(int(w['write_bytes_per_day']))}/day "
                f"[{w['write_source']}]: spent in {w['days_to_endurance']:,.0f} days unbudgeted; "
                f"serve's budget refuses {w['budget_refuses_share']:.1%} of the writes and the "
                f"drive lasts {w['days_to_endurance_under_budget']:,.0f} days"
            )
        else:
            lines.append(f"             {w['write_source']}")
    return lines
