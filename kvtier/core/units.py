"""Byte sizes written by people: parse '80GB', '16GiB', '55.54e9'; format counts back.

Decimal units are powers of 1000 (GB = 10^9 B), binary units powers of 1024 (GiB = 2^30 B); a
bare number is bytes. Single letters ('16G') are refused as ambiguous rather than guessed.
Parsing is exact (decimal arithmetic): '55.54e9' is 55,540,000,000 bytes, never a float near it;
a fractional byte count is rounded down.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import NamedTuple

from kvtier.core.errors import UsageError

_DECIMAL = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15}
_BINARY = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}
_SPELLING = {"KIB": "KiB", "MIB": "MiB", "GIB": "GiB", "TIB": "TiB", "PIB": "PiB"}
_POWER = {
    "": "no unit: bytes",
    "B": "bytes",
    "KB": "10^3 B",
    "MB": "10^6 B",
    "GB": "10^9 B",
    "TB": "10^12 B",
    "PB": "10^15 B",
    "KIB": "2^10 B",
    "MIB": "2^20 B",
    "GIB": "2^30 B",
    "TIB": "2^40 B",
    "PIB": "2^50 B",
}
MAX_BYTES = 2**64
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


class Size(NamedTuple):
    """A parsed size: the exact byte count, the unit as written, and what that unit means."""

    bytes: int
    unit: str
    meaning: str

    def explain(self) -> str:
        """E.g. '80,000,000,000 B (GB = 10^9 B)'."""
        if not self.unit:
            return f"{self.bytes:,} B ({self.meaning})"
        return f"{self.bytes:,} B ({self.unit} = {self.meaning})"


def parse_size(text: str, what: str = "size") -> Size:
    """Parse a non-negative size; raise `UsageError` naming `what` on anything else."""
    m = _RE.match(text) if isinstance(text, str) else None
    if m is None and isinstance(text, str) and text.strip().startswith("-"):
        raise UsageError(f"{what}: {text!r} is negative; sizes must be >= 0")
    if m is None:
        raise UsageError(f"{what}: cannot read {text!r} as a size (examples: 80GB, 16GiB, 55.54e9)")
    number, unit = m.group(1), m.group(2).upper()
    if unit in ("", "B"):
        scale, label = 1, "B" if unit else ""
    elif unit in _DECIMAL:
        scale, label = _DECIMAL[unit], unit
    elif unit in _BINARY:
        scale, label = _BINARY[unit], _SPELLING[unit]
    elif unit in ("K", "M", "G", "T", "P"):
        raise UsageError(
            f"{what}: unit {m.group(2)!r} in {text!r} is ambiguous; "
            f"write {unit}B ({_POWER[unit + 'B']}) or {unit}iB ({_POWER[unit + 'IB']})"
        )
    else:
        raise UsageError(f"{what}: unknown unit {m.group(2)!r} in {text!r} (use B, GB, GiB, ...)")
    try:
        value = Decimal(number) * scale
    except InvalidOperation:
        raise UsageError(f"{what}: cannot read {text!r} as a size") from None
    if value >= MAX_BYTES:
        raise UsageError(f"{what}: {text!r} is too large (limit 2^64 B)")
    return Size(int(value), label, _POWER[unit])


def format_bytes(n: int | float) -> str:
    """Binary-unit rendering: 2097152 -> '2 MiB', 1536 -> '1.5 KiB', 100 -> '100 B'."""
    if n < 0:
        return "-" + format_bytes(-n)
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    value = float(n)
    i = 0
    while value >= 1024 and i < len(units) - 1:
        value /= 1024
        i += 1
    if i == 0:
        return f"{int(n)} B" if float(n).is_integer() else f"{n:.2f} B"
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{text} {units[i]}"


def format_decimal(n: int | float) -> str:
    """Decimal-unit rendering: 80e9 -> '80 GB'."""
    if n < 0:
        return "-" + format_decimal(-n)
    units = ["B", "KB", "MB", "GB", "TB", "PB"]
    value = float(n)
    i = 0
    while value >= 1000 and i < len(units) - 1:
        value /= 1000
        i += 1
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{text} {units[i]}"
