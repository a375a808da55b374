"""A request's kvtier hints: what a client (an agent harness, a router) asks of kvtier for one
request, through the engine's per-request transfer parameters (vLLM: `kv_transfer_params`, the
OpenAI API's request field of that name), under the key "kvtier":

    {"kvtier": {"pin_s": 600, "store": false, "prefetch": true}}

    pin_s      keep this request's blocks (its prompt's and its output's full blocks, those
               cached before and those it stores) through pressure for this many seconds
               after it (`Pin`; 0: no pin). Bounded by the daemon's `max_pin_ttl_s`, and a
               tenant's pins by its quota: a pin refused is a warning, never a failure.
    store      false: store nothing of this request (its blocks are still loaded from kvtier).
    prefetch   true: before its lookup, bring its cached prefix from SSD or the remote tier
               into DRAM (`Prefetch`), so the load reads DRAM.

A hint that cannot be used — an unknown key, a value of the wrong type, the "kvtier" value not
an object — is one warning for that request, and ignored; the request is served as if it had
not been given. Pure: no engine import (`parse_hints` reads a plain mapping).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("kvtier.integrations.common")

HINTS_KEY = "kvtier"
KNOWN = ("pin_s", "store", "prefetch")


@dataclass(frozen=True, slots=True)
class Hints:
    pin_s: float = 0.0
    store: bool = True
    prefetch: bool = False


NO_HINTS = Hints()


def parse_hints(params: object, where: str) -> Hints:
    """The hints in a request's transfer parameters (`params`: vLLM's `kv_transfer_params`,
    None without any); what cannot be used is logged as one warning naming `where` (the
    request) and ignored."""
    if not isinstance(params, Mapping) or HINTS_KEY not in params:
        return NO_HINTS
    given = params[HINTS_KEY]
    if not isinstance(given, Mapping):
        log.warning("kvtier: %s: ignoring kv_transfer_params[%r]: expected an object like "
                    '{"pin_s": 600, "store": false, "prefetch": true}, got %s', where,
                    HINTS_KEY, type(given).__name__)
        return NO_HINTS
    problems = []
    unknown = sorted(str(k) for k in given if k not in KNOWN)
    if unknown:
        problems.append(f"unknown key(s) {', '.join(map(repr, unknown))} (known: "
                        f"{', '.join(KNOWN)})")
    pin_s, store, prefetch = 0.0, True, False
    if "pin_s" in given:
        v = given["pin_s"]
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) \
                and v >= 0:
            pin_s = float(v)
        else:
            problems.append(f"pin_s must be a number of seconds >= 0, got {v!r}")
    for name in ("store", "prefetch"):
        if name in given:
            v = given[name]
            if isinstance(v, bool):
                if name == "store":
                    store = v
                else:
                    prefetch = v
            else:
                problems.append(f"{name} must be true or false, got {v!r}")
    if problems:
        log.warning("kvtier: %s: ignoring hint %s", where, "; ".join(problems))
    return Hints(pin_s, store, prefetch)
