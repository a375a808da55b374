"""`kvtier simulate --nodes N`: the fleet flags, their checks, and the fleet run and report."""

from __future__ import annotations

import argparse
import json
import math
import re
from typing import TYPE_CHECKING

from kvtier.commands.flags import whole
from kvtier.core.errors import UsageError

if TYPE_CHECKING:
    from kvtier.sim.config import TierConfig
    from kvtier.sim.fleet import FleetConfig, Saving
    from kvtier.sim.fleet_report import FleetReport
    from kvtier.sim.trace import Request

FLEET_FLAGS = ("routing", "remote_blocks", "remote_bytes", "event_lag", "balance",
               "prefill_rate", "remote_bandwidth", "remote_write_rate")
_LAG = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s)?\s*$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtier.sim.fleet import DEFAULT_BALANCE, DEFAULT_PREFILL_TOKENS_PER_S, ROUTINGS

    g = parser.add_argument_group(
        "fleet (--nodes N)",
        "replay the trace over N nodes, each with the DRAM and SSD above, behind a router")
    g.add_argument("--nodes", metavar="N", help="number of nodes (a fleet replay)")
    g.add_argument("--routing", choices=ROUTINGS,
                   help="how requests pick a node (prefix-aware with --nodes)")
    g.add_argument("--remote-bytes", metavar="SIZE",
                   help="a shared remote tier below every node of this size, e.g. 1TiB")
    g.add_argument("--remote-blocks", metavar="N", help="the shared remote tier in blocks")
    g.add_argument("--event-lag", metavar="SECONDS",
                   help="how late prefix-aware routing sees node contents: seconds, or with "
                   "a unit (250ms, 2s); 0")
    g.add_argument("--balance", metavar="X",
                   help=f"prefix-aware load guard: a node takes a request only while its "
                   f"request count stays within X times the mean ({DEFAULT_BALANCE}; inf = off)")
    g.add_argument("--prefill-rate", metavar="TOKENS",
                   help=f"prefill tokens per second of one node, the clock of each node's "
                   f"queue (least-loaded; {DEFAULT_PREFILL_TOKENS_PER_S:,.0f})")
    g.add_argument("--remote-write-rate", metavar="SIZE",
                   help="bytes per second each node may write to the remote tier, as kvtier "
                   "serve's remote_write_bytes_per_s (its default, 200MB; off = no limit; "
                   "needs the block's bytes)")
    g.add_argument("--remote-bandwidth", metavar="SIZE",
                   help="bytes per second of a fetch from the remote tier, for the planner's "
                   "prefill seconds (default: kvtier serve's seed, 1.2GB)")
    parser.set_defaults(old_remote=None)


def wanted(args: argparse.Namespace) -> bool:
    """True for a fleet replay; a fleet flag without --nodes is a `UsageError`."""
    if args.nodes is not None:
        return True
    given = [f"--{f.replace('_', '-')}" for f in FLEET_FLAGS if getattr(args, f) is not None]
    if given:
        raise UsageError(f"{given[0]} is a fleet setting; give --nodes N with it")
    return False


def parse_lag(text: str) -> float:
    """`--event-lag`: seconds (`0.5`, `2s`) or milliseconds (`250ms`), finite and >= 0."""
    m = _LAG.match(text)
    if not m:
        raise UsageError(f"--event-lag must be seconds >= 0 (e.g. 0.5, 250ms, 2s), got {text!r}")
    value = float(m.group(1)) / (1000.0 if m.group(2) == "ms" else 1.0)
    if not math.isfinite(value):
        raise UsageError(f"--event-lag must be finite, got {text!r}")
    return value


def _number(text: str, flag: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"{flag} must be {what}, got {text!r}") from None


def fleet_config(args: argparse.Namespace, tiers: TierConfig, remote: int,
                 block_bytes: int | None) -> FleetConfig:
    """The fleet from the flags (`remote`: the remote tier's blocks from --remote-bytes or
    --remote-blocks, 0 = none); bad values are a `UsageError` naming the flag."""
    from kvtier.sim.fleet import (
        DEFAULT_BALANCE,
        DEFAULT_PREFILL_TOKENS_PER_S,
        FleetConfig,
    )

    nodes = whole(args.nodes, "--nodes", 1, what="a whole number of nodes")
    if remote == 0 and (args.remote_bytes or args.remote_blocks) is not None:
        raise UsageError(f"the remote tier holds no 512-token block "
                         f"({args.remote_bytes or args.remote_blocks}); give a larger size")
    lag = 0.0 if args.event_lag is None else parse_lag(args.event_lag)
    balance = DEFAULT_BALANCE
    if args.balance is not None:
        balance = (math.inf if args.balance.strip().lower() in ("inf", "off")
                   else _number(args.balance, "--balance", "a factor >= 1 or inf"))
        if not balance >= 1:
            raise UsageError(f"--balance must be >= 1 (x the mean) or inf, got {args.balance!r}")
    rate = DEFAULT_PREFILL_TOKENS_PER_S
    if args.prefill_rate is not None:
        rate = _number(args.prefill_rate, "--prefill-rate", "tokens per second > 0")
        if not (rate > 0 and math.isfinite(rate)):
            raise UsageError(f"--prefill-rate must be tokens per second > 0, got "
                             f"{args.prefill_rate!r}")
    if args.event_lag is not None and args.routing not in (None, "prefix-aware"):
        raise UsageError(f"--event-lag is what prefix-aware routing sees; {args.routing} "
                         "routing sees no node contents")
    routing = args.routing or "prefix-aware"
    write_rate = remote_write_rate(args, remote, block_bytes)
    return FleetConfig(tiers, nodes, routing, remote, lag, balance, rate, write_rate,
                       block_bytes or 0)


def remote_write_rate(args: argparse.Namespace, remote: int,
                      block_bytes: int | None) -> float | None:
    """Each node's remote write budget in bytes/s: --remote-write-rate, else kvtier serve's
    default when block sizes are known; None: no budget (off, no remote tier, or no sizes)."""
    from kvtier.core.units import parse_size
    from kvtier.daemon.config import DEFAULT_REMOTE_WRITE_BYTES_PER_S

    text = args.remote_write_rate
    if text is not None and not remote:
        raise UsageError("--remote-write-rate limits writes to the remote tier; give "
                         "--remote-bytes SIZE or --remote-blocks N with it")
    if text is not None and text.strip().lower() == "off":
        return None
    if block_bytes is None:
        if text is not None:
            raise UsageError("--remote-write-rate is bytes per second; give --preset NAME, "
                             "--hf-config PATH or --block-bytes SIZE for the block's bytes")
        return None
    if not remote:
        return None
    if text is None:
        return float(DEFAULT_REMOTE_WRITE_BYTES_PER_S)
    rate = parse_size(text, "--remote-write-rate").bytes
    if rate < 1:
        raise UsageError(f"--remote-write-rate must be > 0 bytes/s (or off), got {text!r}")
    return float(rate)


def saving(args: argparse.Namespace, block_bytes: int | None) -> tuple[Saving | None, str | None]:
    """The planner's prefill seconds saved per request, with the model of --preset or
    --hf-config and `kvtier serve`'s default rates (no model: None)."""
    if block_bytes is None or (args.preset is None and args.hf_config is None):
        if args.remote_bandwidth is not None:
            raise UsageError("--remote-bandwidth prices prefill seconds; give --preset NAME or "
                             "--hf-config PATH with it")
        return None, None
    from kvtier.core.costmodel import CostModel
    from kvtier.core.layout import DType
    from kvtier.core.units import parse_size
    from kvtier.daemon.rates.book import RateBook
    from kvtier.sim.fleet import planner_saving

    if args.preset is not None:
        from kvtier.core.presets import get_preset

        spec = get_preset(args.preset)
    else:
        from kvtier.commands.size import read_hf_config

        spec = read_hf_config(args.hf_config)
    dtype = DType.parse(args.dtype)
    cost = CostModel.from_spec(spec, tp=args.tp, dtype=dtype)
    from kvtier.sim.trace import TRACE_BLOCK_TOKENS

    rank_bytes = spec.layout(dtype, TRACE_BLOCK_TOKENS, args.tp).block_bytes()
    rates = RateBook().snapshot()
    if args.remote_bandwidth is not None:
        bw = parse_size(args.remote_bandwidth, "--remote-bandwidth").bytes
        if bw < 1:
            raise UsageError(f"--remote-bandwidth must be > 0 bytes/s, got "
                             f"{args.remote_bandwidth!r}")
        rates = rates._replace(remote_bytes_per_s=float(bw))
    name = f"{spec.name}, remote {rates.remote_bytes_per_s / 1e9:g} GB/s"
    return planner_saving(cost, rates, max(1, rank_bytes)), name


def report(requests: list[Request], fleet: FleetConfig, source: str, distinct: int,
           block_bytes: int | None, save: Saving | None, cost_name: str | None,
           show: bool) -> FleetReport:
    from kvtier.sim.ceilings import infinite_hits
    from kvtier.sim.fleet import ceilings, replay_fleet
    from kvtier.sim.fleet_report import FleetReport
    from kvtier.sim.progress import progress_bar

    with progress_bar(len(requests), f"{fleet.routing}", show) as bar:
        result = replay_fleet(requests, fleet, save, progress=bar)
    per_node, pooled = ceilings(requests, result)
    return FleetReport(source, distinct, block_bytes, result, per_node, pooled,
                       infinite_hits(requests), cost_name)


def run(args: argparse.Namespace, fleet: FleetConfig, requests: list[Request], source: str,
        block_bytes: int | None, show: bool, note: str | None = None) -> str:
    """The fleet replay's printed text (table or JSON); with --plot, every routing replayed
    and drawn. `note` says what a block of the model is in kvtier (`simulate.block_note`)."""
    from kvtier.sim.ceilings import flatten
    from kvtier.sim.fleet import ROUTINGS
    from kvtier.sim.fleet_report import compare_json, format_table, plot, to_json

    save, cost_name = saving(args, block_bytes)
    distinct = len(set(flatten(requests)))
    main = report(requests, fleet, source, distinct, block_bytes, save, cost_name, show)
    doc = to_json(main)
    doc["block_note"] = note
    if args.plot:
        every = [main if r == fleet.routing else report(
            requests, fleet._replace(routing=r), source, distinct, block_bytes, save,
            cost_name, show) for r in ROUTINGS]
        t = fleet.tiers
        title = (f"{source}: {fleet.nodes} nodes x (DRAM {t.dram_blocks:,} + SSD "
                 f"{t.ssd_blocks:,} blocks), remote {fleet.remote_blocks:,} blocks")
        plot(every, title, args.plot)
        doc["routings"] = compare_json(every)
        doc["plot"] = args.plot
    if args.json:
        return json.dumps(doc, indent=2)
    text = format_table(main) + (f"\nblock: {note}" if note else "")
    if args.plot:
        rows = ", ".join(f"{r['routing']} {r['hit_ratio']:.1%} (imbalance {r['imbalance']:.2f})"
                         for r in doc["routings"])
        text += f"\nplot: {args.plot} ({rows})"
    return text
