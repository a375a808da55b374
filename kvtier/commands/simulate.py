"""`kvtier simulate`: replay a trace (or a built-in workload) through the real prefix index."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.core.errors import UsageError

if TYPE_CHECKING:
    from kvtier.sim.trace import Request

HELP = "replay a request trace through the prefix index and report hit ratios and tier traffic"

_EPILOG = """\
capacities: a whole number is 512-token trace blocks ("4000"); a size with a unit ("64GiB",
"500GB") is bytes and needs --model (KV bytes of a 512-token block from a preset) or --block-bytes.

examples:
  kvtier simulate --trace trace.jsonl --dram 4000 --ssd 16000
  kvtier simulate --workload chat --dram 64GiB --ssd 1TiB --model Llama-3-8B --json
  kvtier simulate --trace trace.jsonl --dram 4000 --ssd 16000 --plot hit_ratio.png
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtier.index.policy_registry import DEFAULT_POLICY, POLICIES
    from kvtier.sim.workloads import WORKLOADS

    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="FILE", help="Mooncake JSONL trace (one request per line)")
    src.add_argument("--workload", choices=WORKLOADS, help="built-in generated workload")
    parser.add_argument("--requests", type=int, metavar="N", help="--workload size (4000)")
    parser.add_argument("--seed", type=int, metavar="N", help="--workload seed (0)")
    parser.add_argument(
        "--dram", metavar="CAP", required=True, help="DRAM capacity: blocks or a size"
    )
    parser.add_argument(
        "--ssd", metavar="CAP", default="0", help="SSD capacity: blocks or a size (0)"
    )
    parser.add_argument("--model", metavar="PRESET", help="model preset for byte capacities")
    parser.add_argument("--dtype", default="bf16", help="KV dtype with --model (bf16)")
    parser.add_argument(
        "--tp", type=int, default=1, metavar="N", help="tensor-parallel size with --model (1)"
    )
    parser.add_argument("--block-bytes", metavar="SIZE", help="bytes of one 512-token block")
    parser.add_argument(
        "--policy", choices=sorted(POLICIES), default=DEFAULT_POLICY,
        help=f"eviction and admission policy ({DEFAULT_POLICY})",
    )
    parser.add_argument(
        "--ssd-admit-k",
        type=int,
        default=2,
        metavar="K",
        help="admit to SSD on the K-th access (2)",
    )
    parser.add_argument(
        "--admission-history",
        type=int,
        metavar="N",
        help="remember the access counts of N dropped blocks (4 bytes each; 0 = off; default: "
        "one per block of DRAM + SSD capacity when SSD > 0; kept fixed across a --plot sweep)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="FILE.png", help="also plot hit ratio against capacity")
    parser.add_argument(
        "--sweep-points", type=int, default=8, metavar="N", help="capacities in --plot (8)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _load(args: argparse.Namespace) -> tuple[list[Request], str]:
    from kvtier.sim.trace import read_trace
    from kvtier.sim.workloads import generate

    if args.trace is not None:
        if args.requests is not None or args.seed is not None:
            raise UsageError(
                "--requests and --seed shape a --workload; a --trace is replayed whole"
            )
        return read_trace(args.trace), Path(args.trace).name
    n = 4000 if args.requests is None else args.requests
    seed = 0 if args.seed is None else args.seed
    if n < 1:
        raise UsageError(f"--requests must be >= 1, got {n}")
    return generate(args.workload, n, seed), f"workload {args.workload} (seed {seed})"


def serve_write_budget(dram: int, ssd: int, block_bytes: int | None) -> dict[str, int]:
    """The SSD write budget `kvtier serve` enforces on these tiers with its defaults (`ssd_dwpd`
    drive writes a day, its default burst), as `TierConfig` fields; {} without an SSD tier.
    Without a block size the budget is counted in blocks (a block write costs 1)."""
    if not ssd:
        return {}
    from kvtier.daemon.config import default_burst, defaults
    from kvtier.tiers.blockfmt import HEADER_SIZE

    slot = block_bytes or 1
    cost = slot + HEADER_SIZE if block_bytes else 1
    dram_bytes = dram * slot
    queue = max(slot, min(dram_bytes // 4, 1 << 30 if block_bytes else dram_bytes) // slot * slot)
    per_day = int(ssd * slot * float(defaults(os.environ)["ssd_dwpd"]))
    burst = max(default_burst(per_day, queue, slot), min(slot, dram_bytes) + cost - slot, cost)
    return {"ssd_write_bytes_per_day": per_day, "ssd_write_burst_bytes": burst,
            "ssd_block_bytes": cost}


def run(args: argparse.Namespace) -> int:
    from kvtier.sim.capacity import parse_capacity, trace_block_bytes
    from kvtier.sim.ceilings import belady, flatten, infinite_hits
    from kvtier.sim.config import TierConfig
    from kvtier.sim.progress import progress_bar
    from kvtier.sim.replay import replay
    from kvtier.sim.report import SimReport, format_table, to_json

    block_bytes = trace_block_bytes(args.model, args.dtype, args.tp, args.block_bytes)
    dram = parse_capacity(args.dram, block_bytes, "--dram")
    ssd = parse_capacity(args.ssd, block_bytes, "--ssd")
    if args.ssd_admit_k < 1:
        raise UsageError(f"--ssd-admit-k must be >= 1, got {args.ssd_admit_k}")
    if args.admission_history is not None and args.admission_history < 0:
        raise UsageError(f"--admission-history must be >= 0, got {args.admission_history}")
    config = TierConfig(dram, ssd, args.policy, args.ssd_admit_k, args.admission_history,
                        **serve_write_budget(dram, ssd, block_bytes))
    if args.plot:
        from kvtier.sim.sweep import check_plot_target

        check_plot_target(args.plot)
        if args.sweep_points < 2:
            raise UsageError(f"--sweep-points must be >= 2, got {args.sweep_points}")
    requests, source = _load(args)
    show = not args.quiet and sys.stderr.isatty()

    refs = flatten(requests)
    with progress_bar(len(requests), "replay", show) as bar:
        stats = replay(requests, config, progress=bar)
    report = SimReport(
        source,
        len(set(refs)),
        config,
        block_bytes,
        stats,
        infinite_hits(requests),
        belady(requests, config.total_blocks).prefix_hits,
    )
    doc = to_json(report)
    if args.plot:
        from kvtier.sim.sweep import plot, run_sweep, sweep_configs, sweep_json

        configs = sweep_configs(config, report.distinct_blocks, args.sweep_points)
        with progress_bar(len(configs), "sweep", show, unit="capacity") as bar:
            points = run_sweep(requests, configs, on_point=lambda: bar(1))
        share = config.dram_blocks / config.total_blocks if config.total_blocks else 1.0
        title = (
            f"{source}: {config.policy}, SSD admission k={config.ssd_admit_k}, "
            f"DRAM {share:.0%} of capacity"
        )
        plot(points, doc["infinite_hit_ratio"], config, title, args.plot, block_bytes)
        doc["sweep"] = sweep_json(points)
        doc["plot"] = args.plot
    text = json.dumps(doc, indent=2) if args.json else format_table(report)
    if args.plot and not args.json:
        text += f"\nplot: {args.plot} ({len(doc['sweep'])} capacities)"
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. `| head`: the reader is gone, nothing left to report to
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
