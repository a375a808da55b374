"""`kvtier simulate`: replay a trace (or a built-in workload) through the real prefix index."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.commands.flags import whole
from kvtier.core.errors import UsageError

if TYPE_CHECKING:
    from kvtier.sim.trace import Request

HELP = "replay a request trace through the prefix index and report hit ratios and tier traffic"

_EPILOG = """\
capacities: --dram-blocks/--ssd-blocks count 512-token trace blocks; --dram-bytes/--ssd-bytes are
sizes ("64GiB", "500GB"; as in `kvtier serve` and `kvtier size`, a size needs its unit) and need
the bytes of a 512-token block: from --preset, --hf-config or --block-bytes.

examples:
  kvtier simulate --trace trace.jsonl --dram-blocks 4000 --ssd-blocks 16000
  kvtier simulate --workload chat --dram-bytes 64GiB --ssd-bytes 1TiB --preset Llama-3-8B --json
  kvtier simulate --workload chat --dram-bytes 64GiB --hf-config ./my-model/config.json
  kvtier simulate --trace trace.jsonl --dram-blocks 4000 --ssd-blocks 16000 --plot hit_ratio.png
  kvtier simulate --trace trace.jsonl --dram-blocks 512 --ssd-blocks 2048 --nodes 8
  kvtier simulate --trace trace.jsonl --dram-blocks 512 --nodes 8 --routing round-robin
  kvtier simulate --workload chat --preset Llama-3-8B --dram-bytes 32GiB --nodes 4 \\
      --remote-bytes 1TiB --event-lag 250ms --plot fleet.png
"""


def _folded(name: str) -> str:
    """A policy name in any case, as presets are (`--preset llama-3-8b`)."""
    return name.strip().lower()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtier.commands.flags import alias
    from kvtier.index.policies import DEFAULT_POLICY, POLICIES
    from kvtier.sim.workloads import HELD_OUT, WORKLOADS

    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="FILE", help="Mooncake JSONL trace (one request per line)")
    src.add_argument("--workload", choices=WORKLOADS + HELD_OUT, help="built-in generated workload")
    parser.add_argument("--requests", type=int, metavar="N", help="--workload size (4000)")
    parser.add_argument("--seed", type=int, metavar="N", help="--workload seed (0)")
    for tier in ("dram", "ssd"):
        dflt = "" if tier == "dram" else " (default 0: no SSD tier)"
        parser.add_argument(f"--{tier}-blocks", metavar="N",
                            help=f"{tier.upper()} capacity in 512-token blocks{dflt}")
        parser.add_argument(f"--{tier}-bytes", metavar="SIZE",
                            help=f"{tier.upper()} capacity as a size, e.g. 64GiB{dflt}")
        alias(parser, f"--{tier}", f"--{tier}-blocks N or --{tier}-bytes SIZE", f"old_{tier}")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--preset", metavar="NAME", help="model preset for byte capacities "
                       "(as in kvtier size --preset)")
    model.add_argument("--hf-config", metavar="PATH", help="a local Hugging Face config.json "
                       "for byte capacities (as in kvtier size --hf-config)")
    alias(model, "--model", "--preset", "preset")
    parser.add_argument("--dtype", default="bf16", help="KV dtype with a model (bf16)")
    parser.add_argument(
        "--tp", type=int, default=1, metavar="N", help="tensor-parallel size with a model (1)"
    )
    parser.add_argument("--block-bytes", metavar="SIZE", help="bytes of one 512-token block")
    parser.add_argument(
        "--policy", choices=sorted(POLICIES), default=DEFAULT_POLICY, type=_folded,
        help=f"eviction and admission policy ({DEFAULT_POLICY})",
    )
    parser.add_argument("--ssd-admit-after", type=int, default=2, metavar="K",
                        help="write a block to SSD from its K-th access (2; as in kvtier serve)")
    alias(parser, "--ssd-admit-k", "--ssd-admit-after", "ssd_admit_after", type=int)
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
    from kvtier.commands import simulate_fleet

    simulate_fleet.add_arguments(parser)


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


def _block_bytes(args: argparse.Namespace) -> int | None:
    """Bytes of one 512-token trace block, from --block-bytes, --preset or --hf-config."""
    from kvtier.sim.capacity import trace_block_bytes

    if args.hf_config is None:
        return trace_block_bytes(args.preset, args.dtype, args.tp, args.block_bytes)
    if args.block_bytes is not None:
        raise UsageError("give either --hf-config or --block-bytes, not both")
    from kvtier.commands.size import read_hf_config
    from kvtier.core.layout import DType
    from kvtier.sim.trace import TRACE_BLOCK_TOKENS

    if args.tp < 1:
        raise UsageError(f"--tp must be >= 1, got {args.tp}")
    spec = read_hf_config(args.hf_config)
    n = spec.layout(DType.parse(args.dtype), TRACE_BLOCK_TOKENS, args.tp).block_bytes_stored()
    if n < 1:
        raise UsageError(f"{args.hf_config} stores no per-token KV; byte capacities mean nothing")
    return n


def block_note(args: argparse.Namespace, block_bytes: int | None) -> str | None:
    """What one trace block of the model is in kvtier, in words (None without a model)."""
    if block_bytes is None or (args.preset is None and args.hf_config is None):
        return None
    from kvtier.commands.size import read_hf_config, stored_note
    from kvtier.core.layout import DType
    from kvtier.core.presets import get_preset
    from kvtier.sim.trace import TRACE_BLOCK_TOKENS

    spec = get_preset(args.preset) if args.preset is not None else read_hf_config(args.hf_config)
    layout = spec.layout(DType.parse(args.dtype), TRACE_BLOCK_TOKENS, args.tp)
    return (f"a {TRACE_BLOCK_TOKENS}-token block of {spec.name} at TP {args.tp}, "
            f"{layout.dtype.value}: {block_bytes:,} B in kvtier = {stored_note(layout)}")


def capacity(args: argparse.Namespace, tier: str, block_bytes: int | None,
              required: bool) -> int:
    """A tier's capacity in trace blocks from --TIER-blocks, --TIER-bytes or the old --TIER."""
    from kvtier.core.units import parse_size
    from kvtier.sim.capacity import parse_capacity

    given = {f"--{tier}-{k}": getattr(args, f"{tier}_{k}") for k in ("blocks", "bytes")}
    given[f"--{tier}"] = getattr(args, f"old_{tier}")
    named = [flag for flag, v in given.items() if v is not None]
    if len(named) > 1:
        raise UsageError(f"give one {tier.upper()} capacity, not {' and '.join(named)}")
    if not named:
        if required:
            raise UsageError(f"give --{tier}-blocks N or --{tier}-bytes SIZE")
        return 0
    flag, text = named[0], given[named[0]]
    if flag.endswith("-blocks"):
        return whole(text, flag, 0, what="a whole number of blocks")
    if flag.endswith("-bytes"):
        size = parse_size(text, flag).bytes
        if block_bytes is None:
            raise UsageError(f"{flag} {text} is a size; give --preset NAME, --hf-config PATH or "
                             "--block-bytes SIZE to turn it into 512-token blocks (or give "
                             f"--{tier}-blocks N)")
        return size // block_bytes
    return parse_capacity(text, block_bytes, flag)


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
    from kvtier.sim.ceilings import belady, flatten, infinite_hits
    from kvtier.sim.config import TierConfig
    from kvtier.sim.progress import progress_bar
    from kvtier.sim.replay import replay
    from kvtier.sim.report import SimReport, format_table, to_json

    block_bytes = _block_bytes(args)
    dram = capacity(args, "dram", block_bytes, required=True)
    ssd = capacity(args, "ssd", block_bytes, required=False)
    if args.ssd_admit_after < 1:
        raise UsageError(f"--ssd-admit-after must be >= 1, got {args.ssd_admit_after}")
    if args.admission_history is not None and args.admission_history < 0:
        raise UsageError(f"--admission-history must be >= 0, got {args.admission_history}")
    config = TierConfig(dram, ssd, args.policy, args.ssd_admit_after, args.admission_history,
                        **serve_write_budget(dram, ssd, block_bytes))
    from kvtier.commands import simulate_fleet

    fleet = None
    if simulate_fleet.wanted(args):
        remote = capacity(args, "remote", block_bytes, required=False)
        fleet = simulate_fleet.fleet_config(args, config, remote, block_bytes)
    if args.plot:
        from kvtier.sim.sweep import check_plot_target

        check_plot_target(args.plot)
        if args.sweep_points < 2:
            raise UsageError(f"--sweep-points must be >= 2, got {args.sweep_points}")
    requests, source = _load(args)
    show = not args.quiet and sys.stderr.isatty()
    note = block_note(args, block_bytes)
    if fleet is not None:
        return _print(simulate_fleet.run(args, fleet, requests, source, block_bytes, show, note))

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
    doc["block_note"] = note
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
    if note and not args.json:
        text = f"{text}\nblock: {note}"
    if args.plot and not args.json:
        text += f"\nplot: {args.plot} ({len(doc['sweep'])} capacities)"
    return _print(text)


def _print(text: str) -> int:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. `| head`: the reader is gone, nothing left to report to
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
