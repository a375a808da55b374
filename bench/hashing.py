"""Block-key throughput: tokens/s hashing whole token sequences into block keys.

    python -m bench.hashing [--tokens N] [--repeats R]

For each mode (sha256_cbor, xxh3_128) and block size (16, 256 tokens): `KeyScheme.block_keys`
(vectorised canonical-CBOR token encoding, one digest per block) against a baseline measured in
the same run — the per-block reference path `KeyScheme.block_key` (cbor2.dumps of
(parent, tuple(tokens), extras) then the digest), which is exactly what vLLM's
`hash_block_tokens` does. Both produce the same keys (asserted). Medians over R repeats.
Writes bench/results/hashing.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvtier.core.keys import KeyScheme

RESULTS = Path(__file__).parent / "results" / "hashing.json"


def _time_pair(fn: Any, base: Any, repeats: int) -> tuple[float, float]:
    """Median seconds of `fn` and `base`, interleaved so load changes hit both alike."""
    a, b = [], []
    for _ in range(repeats):
        for f, out in ((fn, a), (base, b)):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


def _reference(scheme: KeyScheme, toks: list[int], bt: int) -> list[bytes]:
    keys: list[bytes] = []
    parent: bytes | None = None
    for i in range(len(toks) // bt):
        parent = scheme.block_key(parent, toks[i * bt:(i + 1) * bt])
        keys.append(parent)
    return keys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m bench.hashing", description=__doc__.split("\n")[0],
    )
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per sequence")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    toks = [rng.randrange(152064) for _ in range(args.tokens)]  # Qwen-sized vocabulary
    rows = []
    for mode in ("sha256_cbor", "xxh3_128"):
        scheme = KeyScheme.vllm(mode)  # type: ignore[arg-type]
        for bt in (16, 256):
            assert scheme.block_keys(toks, bt) == _reference(scheme, toks, bt)
            fast, ref = _time_pair(lambda s=scheme, b=bt: s.block_keys(toks, b),
                                   lambda s=scheme, b=bt: _reference(s, toks, b), args.repeats)
            n = len(toks) // bt * bt
            rows.append({"mode": mode, "block_tokens": bt, "tokens": n,
                         "tokens_per_s": n / fast, "baseline_tokens_per_s": n / ref,
                         "speedup": ref / fast, "us_per_block": fast / (n // bt) * 1e6})
    print(f"{'mode':<12} {'block':>5} {'Mtok/s':>8} {'baseline':>9} {'x':>6} {'us/block':>9}")
    for r in rows:
        print(f"{r['mode']:<12} {r['block_tokens']:>5} {r['tokens_per_s'] / 1e6:>8.2f} "
              f"{r['baseline_tokens_per_s'] / 1e6:>9.2f} {r['speedup']:>6.2f} "
              f"{r['us_per_block']:>9.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(), "python": platform.python_version(),
        "command": "python -m bench.hashing " + " ".join(argv or []),
        "repeats": args.repeats, "rows": rows}, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
