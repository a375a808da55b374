"""Planner rates kept across restarts: `<data_dir>/rates.json`.

A daemon that restarts with blocks on SSD must not forget what it measured: on default rates
(an H100's prefill rate, an NVMe's read rate) its planner may judge that recomputing beats an
SSD read that, measured on this machine, was faster — and the first prompts after a restart
recompute what is cached. So the daemon writes what its `RateBook`s measured (from samples, not
seeds: `RateBook.measured`) — the node's copy, SSD, remote and prefill rates, and each tenant's
own copy and prefill rates (`kvtier.daemon.rates.tenants`; a prefill rate is FLOP/s, turned into
seconds per layout by that layout's cost model) — every `SAVE_EVERY_S` while serving and at
shutdown, atomically (temp file + rename). At start they are the seeds, laid over the
calibration's (`kvtier calibrate`) or the defaults; the first samples replace them as before.

Precedence at start: kept rates over `calibration.json`, unless the calibration file is newer
(a `kvtier calibrate` run after the daemon stopped is newer evidence). A rates file that cannot
be read or parsed is a one-line warning and is ignored, as a calibration file is. `describe`
says which rates the planner starts from, for the first log line.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from kvtier.core.errors import UsageError
from kvtier.daemon.rates.book import Link, LinkRate, Measured, RateBook
from kvtier.daemon.rates.calibrate import calibration_path, load_calibration_if_present

log = logging.getLogger(__name__)

FILE_NAME = "rates.json"
FORMAT_VERSION = 1
SAVE_EVERY_S = 60.0


class Kept(NamedTuple):
    node: Measured
    tenants: dict[str, Measured]
    saved_utc: str


class StartRates(NamedTuple):
    """What the daemon starts with: the node's book, each tenant's kept seeds, and a phrase for
    the first log line."""

    book: RateBook
    tenants: dict[str, Measured]
    described: str


def rates_path(data_dir: Path) -> Path:
    return data_dir / FILE_NAME


def _measured_json(m: Measured) -> dict[str, Any]:
    return {"links": {str(link): {"bytes_per_s": r.bytes_per_s, "latency_s": r.latency_s}
                      for link, r in m.links.items()},
            "prefill_flops_per_s": m.prefill_flops_per_s}


def save(data_dir: Path, node: RateBook, tenants: Mapping[str, RateBook]) -> None:
    """Writes the measured rates (nothing when nothing was measured). Raises OSError."""
    node_m = node.measured()
    tenants_m = {name: book.measured() for name, book in tenants.items()}
    tenants_m = {n: m for n, m in tenants_m.items() if m.links or m.prefill_flops_per_s}
    if not (node_m.links or node_m.prefill_flops_per_s or tenants_m):
        return
    doc = {"version": FORMAT_VERSION,
           "saved_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "node": _measured_json(node_m),
           "tenants": {n: _measured_json(m) for n, m in sorted(tenants_m.items())}}
    path = rates_path(data_dir)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _rate(v: object, where: str, zero_ok: bool = False) -> float:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or (v < 0 if zero_ok else v <= 0):  # type: ignore[operator]
        raise ValueError(f"{where} must be a finite number {'>=' if zero_ok else '>'} 0")
    return float(v)  # type: ignore[arg-type]


def _measured(doc: object, where: str) -> Measured:
    if not isinstance(doc, dict) or not isinstance(doc.get("links"), dict):
        raise ValueError(f"{where}: expected an object with 'links'")
    links: dict[Link, LinkRate] = {}
    for name, entry in doc["links"].items():
        try:
            link = Link(name)
        except ValueError:
            raise ValueError(f"{where}: unknown link {name!r}") from None
        if not isinstance(entry, dict):
            raise ValueError(f"{where}.links.{name}: expected an object")
        links[link] = LinkRate(_rate(entry.get("bytes_per_s"), f"{where}.links.{name}.bytes_per_s"),
                               _rate(entry.get("latency_s"), f"{where}.links.{name}.latency_s",
                                     zero_ok=True))
    prefill = doc.get("prefill_flops_per_s")
    return Measured(links, None if prefill is None else
                    _rate(prefill, f"{where}.prefill_flops_per_s"))


def load(data_dir: Path) -> Kept | None:
    """The kept rates; None when there is no file. Raises ValueError for a malformed one."""
    path = rates_path(data_dir)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: not a version-{FORMAT_VERSION} kvtier rates file")
    tenants = doc.get("tenants", {})
    if not isinstance(tenants, dict):
        raise ValueError(f"{path}: 'tenants' must be an object")
    return Kept(_measured(doc.get("node"), f"{path}: node"),
                {str(n): _measured(m, f"{path}: tenants.{n}") for n, m in tenants.items()},
                str(doc.get("saved_utc") or "undated"))


def _names(m: Measured) -> str:
    return ", ".join([str(link) for link in m.links] + (["prefill"] if m.prefill_flops_per_s
                                                          else []))


def start_rates(data_dir: Path) -> StartRates:
    """The planner's rates at start (see the module docstring for the precedence)."""
    cal_path = calibration_path(data_dir)
    try:
        cal = load_calibration_if_present(data_dir)
        book = RateBook.from_calibration(cal)
    except (UsageError, ValueError) as exc:
        reason = " ".join(str(exc).split())
        log.warning("ignoring the calibration file (planner uses default rates): %s", reason)
        book, cal, base = RateBook(), None, f"defaults (calibration {cal_path} unreadable)"
    else:
        base = ("defaults (no calibration; run `kvtier calibrate`)" if cal is None else
                f"calibration {cal_path} ({cal.details.get('created_utc') or 'undated'})")
    path = rates_path(data_dir)
    try:
        kept = load(data_dir)
    except ValueError as exc:
        log.warning("ignoring the kept planner rates: %s", " ".join(str(exc).split()))
        return StartRates(book, {}, base)
    if kept is None:
        return StartRates(book, {}, base)
    if cal is not None and cal_path.stat().st_mtime > path.stat().st_mtime:
        return StartRates(book, {}, f"{base}, newer than the rates kept in {path}")
    measured = _names(kept.node) or "none node-wide"
    tenants = f"; per tenant: {', '.join(sorted(kept.tenants))}" if kept.tenants else ""
    return StartRates(book.reseeded(kept.node), kept.tenants,
                      f"measured before the restart ({path}, saved {kept.saved_utc}: "
                      f"{measured}{tenants}), else {base}")
