"""An engine's extra-config mapping (JSON from its command line) into a frozen settings
dataclass: every key known, every value of its field's type, or `SettingsError` naming the key.
Pure.

    s = parse_extra(MySettings, {"timeout_s": "2"}, where="hicache_storage_backend_extra_config")
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


class SettingsError(ValueError):
    """A bad extra-config value (raised at engine start, naming the key)."""


def parse_extra(cls: type[T], extra: Mapping[str, Any] | None, *, where: str,
                ignore: Collection[str] = ()) -> T:
    """`cls(**extra)` with the values coerced to the fields' default types (bool, int, float,
    str; numbers and "true"/"false" given as strings are accepted). Keys in `ignore` (the
    engine's own keys in the same mapping) are dropped; any other unknown key is an error."""
    values = {k: v for k, v in dict(extra or {}).items() if k not in ignore}
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise SettingsError(f"kvtier: unknown {where} key(s) {unknown}; known: {sorted(known)}")
    return cls(**{name: coerce(where, name, value, type(known[name].default))
                  for name, value in values.items()})


def coerce(where: str, name: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
    elif kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(value, str):
        return value
    raise SettingsError(f"kvtier: {where}[{name!r}] must be a {kind.__name__}, got {value!r}")
