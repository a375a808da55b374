"""`kvtier calibrate`: measure copy, SSD and prefill rates; save them for the daemon to load."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvtier.core.errors import UsageError

HELP = "Measure DRAM<->GPU copy, SSD read and prefill FLOP rates; save them for the planner."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        help="where calibration.json is written and the SSD is measured "
        "(default: the daemon's data_dir: $KVTIER_DATA_DIR, else ~/.local/share/kvtier)",
    )
    parser.add_argument("--config", help="daemon TOML config to take data_dir from")
    parser.add_argument(
        "--quick", action="store_true", help="small buffers and few repeats (seconds, for tests)"
    )
    parser.add_argument(
        "--skip",
        action="append",
        choices=("copy", "ssd", "prefill"),
        default=[],
        help="leave a step out (repeatable)",
    )
    parser.add_argument("--no-save", action="store_true", help="measure and print only")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _data_dir(args: argparse.Namespace) -> Path:
    if args.data_dir:
        return Path(args.data_dir).expanduser()
    from kvtier.daemon.config import load

    return load(config_path=args.config).data_dir


def _table(doc: dict[str, Any], saved: Path | None) -> str:
    lines = []
    for name, e in doc["links"].items():
        lines.append(
            f"{name:<11} {e['bytes_per_s'] / 1e9:9.2f} GB/s  latency {e['latency_s'] * 1e6:9.1f} µs"
            f"  ({e.get('method', '')})"
        )
        if e.get("suspect_cached"):
            lines.append("            warning: faster than any SSD; the page cache was not dropped")
    if doc["prefill"] is not None:
        p = doc["prefill"]
        lines.append(f"{'prefill':<11} {p['flops_per_s'] / 1e12:9.3f} TFLOP/s  ({p['method']})")
    lines.append(f"saved to {saved}" if saved else "not saved (--no-save)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvtier.daemon.rates.calibrate import calibration_path, run_calibration, save_calibration

    data_dir = _data_dir(args)
    if data_dir.exists() and not data_dir.is_dir():
        raise UsageError(f"data dir {data_dir} is not a directory")
    if len(set(args.skip)) == 3:
        raise UsageError("nothing to measure: every step is skipped")
    cal = run_calibration(data_dir, quick=args.quick, skip=tuple(args.skip),
                          progress=sys.stderr.isatty())  # a bar only on a terminal
    saved = None
    if not args.no_save:
        saved = calibration_path(data_dir)
        try:
            save_calibration(cal, saved)
        except OSError as exc:
            raise UsageError(f"cannot write {saved}: {exc.strerror}") from None
    doc = cal.to_json()
    if args.json:
        print(json.dumps({**doc, "path": str(saved) if saved else None}, indent=2, sort_keys=True))
    else:
        print(_table(doc, saved))
    return 0
