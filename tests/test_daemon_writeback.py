"""Write-back sizing with a real daemon: with the default write-back queue and wear budget, a
long document (512 blocks, 8K tokens at 16 tokens a block) reaches SSD in full after one
admitting lookup; with the old sizing (a 256-block queue, a burst of 1/24 of a day's budget) it
did not, and the drops are counted while the lookup returns at once."""

from __future__ import annotations

import os
import re
import time

from kvtier._proto import kvtier_pb2 as pb
from kvtier.client.sync_client import Client, LayoutDecl
from tests.daemon_fixture import DaemonProc

SLOT = 16 << 10
BLOCKS = 512
LAYOUT = LayoutDecl(b"writeback-layout-01", SLOT, 16, model_id="writeback-model")
# 64 MiB DRAM = 4096 slots; 64 MiB SSD cap, 1 DWPD -> 64 MiB/day. Defaults: queue min(64 MiB/4,
# 1 GiB) = 16 MiB = 1024 slots; burst min(64 MiB, max(16 MiB, 4 * 16 MiB)) = 64 MiB. The document
# is 512 * (16 KiB + 64 B header) = 8.03 MiB of SSD writes.
SIZES = ["--dram-bytes", "64MiB", "--slot-bytes", "16KiB", "--ssd-bytes", "64MiB"]


def ssd_blocks(kv: Client) -> int:
    return int(next(t.blocks for t in kv.stats().tiers if t.tier == pb.TIER_SSD))


def dropped(d: DaemonProc) -> float:
    found = re.search(r"^kvtier_writeback_dropped_total (\S+)$", d.metrics_text(), re.M)
    assert found is not None
    return float(found.group(1))


def store_and_admit(d: DaemonProc, kv: Client) -> tuple[list[bytes], float]:
    """Stores the document (access 1), looks it up once (access 2: admitted, write-backs
    queued); returns the keys and the lookup's seconds."""
    keys = [i.to_bytes(4, "big") + bytes(28) for i in range(BLOCKS)]
    for start in range(0, BLOCKS, 128):
        parent = keys[start - 1] if start else b""
        chunk = keys[start : start + 128]
        assert kv.store(chunk, [os.urandom(SLOT) for _ in chunk], parent).stored == len(chunk)
    started = time.perf_counter()
    assert kv.lookup(keys).hit_blocks == BLOCKS
    return keys, time.perf_counter() - started


def ssd_blocks_after(kv: Client, want: int, timeout: float = 60.0) -> int:
    """SSD block count once it reached `want` (or the timeout passed) and a second more went by
    (so a count that would overshoot `want` has time to)."""
    deadline = time.monotonic() + timeout
    while ssd_blocks(kv) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    return ssd_blocks(kv)


def test_default_sizing_writes_a_long_document_back_in_full(tmp_path: os.PathLike[str]) -> None:
    d = DaemonProc(tmp_path / "d", SIZES).start()  # type: ignore[operator]
    try:
        assert "(write-back queue 16 MiB, SSD writes 64 MiB/day (burst 64 MiB))" in d.log()
        with Client(d.socket, layout=LAYOUT) as kv:
            store_and_admit(d, kv)
            assert ssd_blocks_after(kv, BLOCKS) == BLOCKS
        assert dropped(d) == 0
    finally:
        d.stop()


def test_old_sizing_dropped_most_of_it_without_blocking(tmp_path: os.PathLike[str]) -> None:
    per_day = 64 << 20
    old = ["--writeback-queue-bytes", str(256 * SLOT), "--ssd-write-burst-bytes",
           str(per_day // 24)]  # the sizing before: 256 blocks, 1 hour of budget
    d = DaemonProc(tmp_path / "d", [*SIZES, *old]).start()  # type: ignore[operator]
    try:
        with Client(d.socket, layout=LAYOUT) as kv:
            _, lookup_s = store_and_admit(d, kv)
            assert lookup_s < 2.0  # drops do not make the lookup wait for the writer
            # 2796202 B of burst / 16448 B a block = 170 blocks, then over budget.
            assert ssd_blocks_after(kv, 170) == 170
        assert dropped(d) >= 1
    finally:
        d.stop()
