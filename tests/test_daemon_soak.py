"""Soak: 32 concurrent clients with mixed load against one daemon: 5 s in the default run, 30 s
under `-m slow` (`pytest -m slow tests/test_daemon_soak.py`). Asserts: no unexpected errors,
every load bit-exact, no leaked slots or leases at the end, SSD hits served, and the daemon's RSS
bounded (growth after the first second under 64 MiB).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import grpc
import pytest

from kvtier.client.sync_client import Client, KvtierRpcError, LayoutDecl
from tests.daemon_fixture import DaemonProc

BLOCK = 16384
LAYOUT = LayoutDecl(b"soak-layout-00001", BLOCK, 16, model_id="soak-model")
CLIENTS = 32


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _payload(key: bytes) -> bytes:
    return (key * (BLOCK // len(key) + 1))[:BLOCK]  # content derived from the key: checkable


def test_soak_32_clients_mixed_load_short(tmp_path: Path) -> None:
    soak(tmp_path, 5.0, warmup=1.0, least=10)


@pytest.mark.slow
def test_soak_32_clients_mixed_load(tmp_path: Path) -> None:
    soak(tmp_path, 30.0, warmup=3.0, least=100)


def soak(tmp_path: Path, seconds: float, warmup: float, least: int) -> None:
    """CLIENTS clients for `seconds`; RSS growth measured from `warmup` on; at least `least`
    stores, loads and blocks loaded."""
    d = DaemonProc(tmp_path / "d", ["--dram-bytes", "8MiB", "--slot-bytes", "16KiB",
                                    "--ssd-bytes", "16MiB", "--ssd-admit-after", "2",
                                    "--ssd-write-bytes-per-day", "1TiB",
                                    "--lease-ttl-s", "5"]).start()
    assert d.proc is not None
    errors: list[str] = []
    counts = {"store": 0, "load": 0, "lookup": 0, "abort": 0, "busy": 0, "blocks": 0}
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker(n: int) -> None:
        rng = random.Random(n)
        streaming = n % 4 == 3
        try:
            kv = Client(d.socket, layout=LAYOUT, streaming=streaming)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(f"client {n}: {exc!r}")
            return
        with kv:
            while time.monotonic() < stop:
                prompt = rng.randrange(200)  # shared prefixes; 1,600 keys > 512 slots
                depth = rng.randrange(1, 9)
                keys = [bytes([prompt, i]) + bytes(30) for i in range(depth)]
                op = rng.random()
                try:
                    if op < 0.35:
                        kv.store(keys, [_payload(k) for k in keys])
                        kind = "store"
                    elif op < 0.45 and not streaming:
                        with kv.store_into(keys):
                            raise InterruptedError
                    elif op < 0.75:
                        with kv.load(keys) as got:
                            for k, v in zip(keys, got.views, strict=False):
                                if bytes(v) != _payload(k):
                                    errors.append(f"client {n}: wrong bytes for {k[:2]!r}")
                            with lock:
                                counts["blocks"] += got.blocks
                        kind = "load"
                    else:
                        kv.lookup(keys)
                        kind = "lookup"
                except InterruptedError:
                    kind = "abort"
                except KvtierRpcError as exc:
                    if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                        kind = "busy"  # the pool is full of pinned blocks: a clean refusal
                    else:
                        errors.append(f"client {n}: {exc}")
                        continue
                with lock:
                    counts[kind] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(CLIENTS)]
    rss_start = 0
    try:
        for t in threads:
            t.start()
        time.sleep(warmup)
        rss_start = _rss_bytes(d.proc.pid)
        for t in threads:
            t.join(seconds + 60)
        rss_end = _rss_bytes(d.proc.pid)
        with Client(d.socket, layout=LAYOUT) as kv:
            s = kv.stats()
        assert errors == [], errors[:10]
        assert all(t.is_alive() is False for t in threads)
        assert min(counts["store"], counts["load"], counts["blocks"]) >= least, counts
        assert s.active_leases == 0
        assert s.tiers[0].used_bytes == s.tiers[0].blocks * BLOCK  # no leaked slot
        assert rss_end < rss_start + (64 << 20), (rss_start, rss_end)
        assert d.healthy()
        metrics = d.metrics_text()
        promoted = [ln for ln in metrics.splitlines()
                    if ln.startswith('kvtier_moved_bytes_total{direction="promote"')]
        assert promoted and float(promoted[0].rsplit(" ", 1)[1]) > 0  # SSD hits were served
        print(f"soak: {counts}, RSS {rss_start >> 20} -> {rss_end >> 20} MiB, "
              f"DRAM {s.tiers[0].blocks} blocks, SSD {s.tiers[1].blocks} blocks")
    finally:
        d.stop()
