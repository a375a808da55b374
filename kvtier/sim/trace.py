"""Request traces: the record type every workload produces, and the Mooncake JSONL reader.

A trace is a list of `Request`s in arrival order. `hash_ids` are chained prefix-block ids: two
requests share id k only if they share every block before it, so an id always has the same parent
(the id before it, or none at position 0). `read_trace` checks that, along with the fields, and
reports the first bad line by number as a `UsageError` (the CLI exits 2).

Mooncake format (kvcache-ai/Mooncake FAST25-release/traces), one JSON object per line:

    {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, ..., 78]}

timestamp is in milliseconds; each id stands for a 512-token block (`TRACE_BLOCK_TOKENS`), the last
one possibly partial (len(hash_ids) == ceil(input_length / 512) in the sample; not enforced).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from kvtier.core.errors import UsageError

TRACE_BLOCK_TOKENS = 512
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_NO_PARENT = -1


class Request(NamedTuple):
    """One request of a trace: arrival time (ms), prompt/output tokens, prefix-block ids."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _is_int(v: object) -> bool:
    return type(v) is int


def _check_number(obj: dict[str, Any], name: str, integer: bool) -> str | None:
    v = obj[name]
    if type(v) is bool or not isinstance(v, int | float) or (integer and not _is_int(v)):
        kind = "an integer" if integer else "a number"
        return f"{name!r} must be {kind}, got {json.dumps(v)}"
    if not math.isfinite(v) or v < 0:
        return f"{name!r} must be a finite number >= 0, got {json.dumps(v)}"
    return None


def parse_line(text: str) -> Request:
    """Parse one JSONL line into a `Request`; raise `ValueError` naming what is wrong."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in _FIELDS if f not in obj]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(repr(m) for m in missing)}")
    for name, integer in (("timestamp", False), ("input_length", True), ("output_length", True)):
        problem = _check_number(obj, name, integer)
        if problem:
            raise ValueError(problem)
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise ValueError(f"'hash_ids' must be a list of integers, got {type(ids).__name__}")
    for pos, h in enumerate(ids):
        if not _is_int(h) or h < 0:
            raise ValueError(f"'hash_ids'[{pos}] must be an integer >= 0, got {json.dumps(h)}")
    return Request(obj["timestamp"], obj["input_length"], obj["output_length"], tuple(ids))


class ChainChecker:
    """Checks that every block id keeps one parent across a whole trace (ids are chained)."""

    __slots__ = ("_parent",)

    def __init__(self) -> None:
        self._parent: dict[int, int] = {}

    def check(self, hash_ids: tuple[int, ...]) -> str | None:
        """Record `hash_ids`; return a description of the first conflict, or None."""
        parent_of = self._parent
        prev = _NO_PARENT
        for pos, h in enumerate(hash_ids):
            known = parent_of.setdefault(h, prev)
            if known != prev:
                where = "first" if prev == _NO_PARENT else f"after id {prev}"
                was = "first" if known == _NO_PARENT else f"after id {known}"
                return (
                    f"hash id {h} at position {pos} comes {where}, but an earlier request had it "
                    f"{was}; ids must be chained prefix blocks"
                )
            prev = h
        return None


def parse_lines(lines: Iterable[str | bytes], source: str = "<trace>") -> list[Request]:
    """Parse JSONL lines (blank lines skipped). Raises `UsageError("SOURCE:LINE: ...")`."""
    out: list[Request] = []
    chain = ChainChecker()
    for lineno, raw in enumerate(lines, start=1):
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            if not text.strip():
                continue
            req = parse_line(text)
        except UnicodeDecodeError as exc:
            raise UsageError(f"{source}:{lineno}: not UTF-8 text ({exc.reason})") from None
        except ValueError as exc:
            raise UsageError(f"{source}:{lineno}: {exc}") from None
        conflict = chain.check(req.hash_ids)
        if conflict:
            raise UsageError(f"{source}:{lineno}: {conflict}")
        out.append(req)
    if not out:
        raise UsageError(f"{source}: the trace has no requests")
    return out


def read_trace(path: str | Path) -> list[Request]:
    """Read a Mooncake JSONL trace file; bad input raises `UsageError` with the line number."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return parse_lines(fh, str(p))
    except OSError as exc:
        raise UsageError(f"cannot read trace {str(p)!r}: {exc.strerror or exc}") from None


def write_trace(requests: Iterable[Request], path: str | Path) -> None:
    """Write requests as Mooncake JSONL (the format `read_trace` reads)."""
    with Path(path).open("w", encoding="utf-8") as fh:
        for line in dump_lines(requests):
            fh.write(line)


def dump_lines(requests: Iterable[Request]) -> Iterator[str]:
    """Mooncake JSONL lines, newline-terminated."""
    for r in requests:
        ts: float = int(r.timestamp) if float(r.timestamp).is_integer() else r.timestamp
        yield (
            json.dumps(
                {
                    "timestamp": ts,
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + "\n"
        )


def block_refs(requests: Iterable[Request]) -> int:
    """Total block references (the hit ratio's denominator)."""
    return sum(len(r.hash_ids) for r in requests)
