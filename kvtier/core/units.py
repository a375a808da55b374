"""Byte sizes written by people: parse '80GB', '16GiB', '55.54e9'; format counts back.

The only size parser of kvtier: flags of every subcommand, `KVTIER_*` variables, the TOML config
and the tokens file all read sizes through `parse_size` / `parse_bytes`, so a size means the same
everywhere. Decimal units are powers of 1000 (GB = 10^9 B), binary units powers of 1024 (GiB =
2^30 B); a bare number is bytes. Single letters ('16G') are refused as ambiguous rather than
guessed. A bare number from 1 to `BARE_MIN` - 1 is refused as implausible (`--gpu-bytes 80` is
not 80 bytes anybody meant): write the unit, `80GiB`, or `80B` for bytes indeed. Parsing is exact
(decimal arithmetic): '55.54e9' is 55,540,000,000 bytes, never a float near it; a fractional byte
count is rounded down. `exact_size` writes a count back as the shortest text that parses to it
('64GiB', '3840GB'), which is what `kvtier serve --print-config` prints.
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
BARE_MIN = 4096
"""The smallest size accepted without a unit (0 is accepted too): every size kvtier takes is a
page or more, so a smaller bare number is a unit left out."""
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
    _check_bare(int(value), unit, what)
    return Size(int(value), label, _POWER[unit])


def _check_bare(n: int, unit: str, what: str) -> None:
    if not unit and 0 < n < BARE_MIN:
        raise UsageError(
            f"{what}: {n} without a unit would be {n} bytes, which no size here means; "
            f"write the unit ({n}GiB, {n}GB, ...; {n}B for bytes)"
        )


def parse_bytes(value: object, what: str = "size") -> int:
    """A size as bytes, from text (`parse_size`) or a whole number (a TOML integer, bytes, under
    the same `BARE_MIN` rule). Raises `UsageError` naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise UsageError(f"{what}: expected a size like 4GiB or 512MB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise UsageError(f"{what}: {value} is negative; sizes must be >= 0")
        if value >= MAX_BYTES:
            raise UsageError(f"{what}: {value} is too large (limit 2^64 B)")
        _check_bare(value, "", what)
        return value
    return parse_size(value, what).bytes


def exact_size(n: int) -> str:
    """The shortest text `parse_size` reads back as exactly `n` bytes: the largest binary unit
    that divides it, else the largest decimal one, else bytes ('64GiB', '3840GB', '4097B')."""
    if n == 0:
        return "0"
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB"):
        scale = _BINARY[unit.upper()]
        if n % scale == 0:
            binary = f"{n // scale}{unit}"
            break
    else:
        binary = f"{n}B"
    for unit in ("PB", "TB", "GB", "MB", "KB"):
        if n % _DECIMAL[unit] == 0:
            decimal = f"{n // _DECIMAL[unit]}{unit}"
            return decimal if len(decimal) < len(binary) else binary
    return binary


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
