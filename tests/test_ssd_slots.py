"""Slot-file payload mode: allocation, the reader quarantine, restart, refusals, format changes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import lmdb
import pytest

from kvtier.core.errors import UsageError
from kvtier.tiers.blockfmt import HEADER_SIZE
from kvtier.tiers.ssd.slots import SlotFile
from kvtier.tiers.ssd.store import SLOT_FILE, STORE_FORMAT, PutItem, SsdSpec, SsdStore

FP = b"slots-layout"
SLOT = 8192


def spec(tmp: Path, slots: int = 32, **kw: object) -> SsdSpec:
    """A slots-mode spec holding exactly `slots` blocks of up to SLOT bytes."""
    return SsdSpec(str(tmp / "ssd"), slots * (SLOT + HEADER_SIZE), FP, slot_size=SLOT,
                   **kw)  # type: ignore[arg-type]


def items(n: int, tag: bytes = b"k", size: int = SLOT) -> list[PutItem]:
    return [PutItem("t", tag + b"%04d" % i, None, os.urandom(size)) for i in range(n)]


def test_auto_mode_follows_the_slot_size(tmp_path: Path) -> None:
    assert SsdSpec("x", 1 << 20, FP).mode() == "lmdb"
    assert SsdSpec("x", 1 << 20, FP, slot_size=4096).mode() == "slots"
    with SsdStore(spec(tmp_path)) as s:
        assert s.mode == "slots" and s.free_slots() == 32
        # the whole slot file is allocated at open: 32 slots of 8 KiB
        assert os.stat(tmp_path / "ssd" / SLOT_FILE).st_blocks * 512 >= 32 * SLOT
        assert os.stat(tmp_path / "ssd" / SLOT_FILE).st_mode & 0o777 == 0o600


def test_a_batch_is_one_run_of_adjacent_slots(tmp_path: Path) -> None:
    f = SlotFile(str(tmp_path / "s"), 100, 10)  # stride 4096
    try:
        assert f.allocate(4) == [0, 1, 2, 3]
        f.release([1])
        assert f.allocate(3) == [4, 5, 6]  # next run after the cursor, not the hole at 1
        assert f.allocate(3) == [7, 8, 9]
        assert f.allocate(2) == [1]  # fragmented: what is left, one by one
        assert f.allocate(1) == [] and f.free_count() == 0
    finally:
        f.close()


def test_a_retired_slot_waits_for_readers_that_may_see_it(tmp_path: Path) -> None:
    f = SlotFile(str(tmp_path / "s"), 100, 2)
    try:
        assert f.allocate(2) == [0, 1]
        with f.reading():
            f.retire([0])
            with f.reading():  # a reader that started after the delete cannot see slot 0 ...
                assert f.allocate(1, wait_s=0.05) == []  # ... but the first one still may
            assert f.quarantined() == 1
        assert f.allocate(1) == [0] and f.quarantined() == 0
    finally:
        f.close()


def test_payload_larger_than_a_slot_is_refused_and_an_empty_one_is_stored(tmp_path: Path) -> None:
    with SsdStore(spec(tmp_path)) as s:
        r = s.put_many([*items(2), PutItem("t", b"big", None, b"x" * (SLOT + 1))])
        assert len(r.stored) == 2 and r.refused == [("t", b"big")]
        assert s.free_slots() == 30 and s.stats().refused_total == 1
        assert s.put_many([PutItem("t", b"empty", None, b"")]).stored == [("t", b"empty")]
        assert s.get("t", b"empty") == b"" and s.get_into("t", b"empty", bytearray(1)) == 0


def test_free_set_is_rebuilt_from_the_index_at_restart(tmp_path: Path) -> None:
    first = items(10)
    with SsdStore(spec(tmp_path)) as s:
        s.put_many(first)
        assert s.delete_many([("t", it.key) for it in first[:3]]) == [
            ("t", it.key) for it in first[:3]]
        assert s.free_slots() == 25
    with SsdStore(spec(tmp_path)) as s:
        assert s.free_slots() == 25 and len(s) == 7
        more = items(25, tag=b"m")
        assert len(s.put_many(more).stored) == 25 and s.free_slots() == 0
        assert s.put_many(items(1, tag=b"x")).refused == [("t", b"x0000")]
        for it in first[3:] + more:  # nothing overwrote a live block
            assert s.get("t", it.key) == it.payload
        assert s.stats().corrupt_total == 0


def test_slots_freed_by_deletes_are_rewritten_only_after_readers_finish(tmp_path: Path) -> None:
    """Readers copy blocks out while the writer deletes and rewrites a 6-slot store many times
    over: no reader ever gets bytes that fail their checksum (a slot rewritten under a reader)."""
    rounds = 200
    with SsdStore(spec(tmp_path, slots=6)) as s:
        stop = threading.Event()
        served: list[tuple[bytes, bytes]] = []
        written: dict[bytes, bytes] = {}
        lock = threading.Lock()

        def reader() -> None:
            buf = bytearray(SLOT)
            while not stop.is_set():
                for r in range(rounds):
                    k = b"r%03d-0000" % r
                    if s.get_into("t", k, buf) == SLOT:
                        with lock:
                            served.append((k, bytes(buf)))

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for r in range(rounds):
                batch = items(2, tag=b"r%03d-" % r)
                written.update((it.key, it.payload) for it in batch)
                assert not s.put_many(batch).refused  # 2 live + 2 quarantined <= 6 slots
                s.delete_many([("t", b"r%03d-%04d" % (r - 1, i)) for i in range(2)])
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert len(served) > rounds and len(s) == 2
        assert s.stats().corrupt_total == 0
        assert all(written[k] == v for k, v in served)


def test_a_failed_commit_returns_the_slots(tmp_path: Path) -> None:
    class TinyMap(SsdSpec):
        def map_size(self) -> int:
            return 1 << 20  # the index runs out of room long before the slots

    sp = TinyMap(str(tmp_path / "ssd"), 4000 * (64 + HEADER_SIZE), FP, slot_size=64)
    with SsdStore(sp) as s:
        big = [PutItem("t", b"%0200d" % i, b"%0200d" % (i - 1), b"p" * 64) for i in range(4000)]
        r = s.put_many(big)
        assert r.stored == [] and s.stats().map_full_total >= 1
        assert s.free_slots() == 4000 and len(s) == 0
        assert len(s.put_many(items(3, size=64)).stored) == 3


NO_SPACE = r"""
import resource, signal, sys
from kvtier.core.errors import UsageError
from kvtier.tiers.ssd.store import SsdSpec, SsdStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (96 << 20, 96 << 20))  # the index's 65 MiB fits
try:
    SsdStore(SsdSpec(sys.argv[1], 256 << 20, b"fp", slot_size=1 << 20))
except UsageError as exc:
    print("refused:", exc)
"""


def test_no_room_for_the_slot_file_is_a_clean_error_at_open(tmp_path: Path) -> None:
    """A disk that cannot hold the slot file (here a 96 MiB file-size limit) fails at open with a
    one-line reason, not later in a write-back."""
    proc = subprocess.run(
        [sys.executable, "-c", NO_SPACE, str(tmp_path / "ssd")], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith("refused: cannot reserve") and "slots" in proc.stdout


def test_no_slot_fits_the_capacity(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        SsdStore(SsdSpec(str(tmp_path / "ssd"), 1000, FP, slot_size=4096))


def test_an_old_format_store_is_discarded_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ssd"
    path.mkdir()
    env = lmdb.open(str(path), max_dbs=4, map_size=64 << 20)  # a format-2 store (kvtier <= 0.x)
    with env.begin(write=True) as txn:
        txn.put(b"format", (2).to_bytes(8, "little"), db=env.open_db(b"info", txn=txn))
        txn.put(b"\x01tk", b"x" * (8 << 20), db=env.open_db(b"blocks", txn=txn))
    env.close()
    with caplog.at_level(logging.WARNING, "kvtier.tiers.ssd.store"), SsdStore(spec(tmp_path)) as s:
        assert len(s) == 0 and s.entries() == []
        assert len(s.put_many(items(2)).stored) == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"SSD store {path}: store format 2, this kvtier reads and writes format {STORE_FORMAT}; "
        "discarding it and starting empty"
    ]
    # the old payloads' space is returned: the file is the new store's reservation, none of it
    assert os.path.getsize(path / "data.mdb") == spec(tmp_path).map_size()
    assert b"x" * 4096 not in (path / "data.mdb").read_bytes()
    caplog.clear()
    with caplog.at_level(logging.WARNING, "kvtier.tiers.ssd.store"), SsdStore(spec(tmp_path)) as s:
        assert len(s) == 2 and not caplog.records  # this format: kept


def test_changing_the_payload_mode_discards_the_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with SsdStore(spec(tmp_path)) as s:
        s.put_many(items(3))
    lmdb_spec = SsdSpec(str(tmp_path / "ssd"), 1 << 20, FP, payload="lmdb")
    with caplog.at_level(logging.WARNING, "kvtier.tiers.ssd.store"), SsdStore(lmdb_spec) as s:
        assert len(s) == 0
    assert "payload mode slots:8192, configured lmdb" in caplog.text
    assert not (tmp_path / "ssd" / SLOT_FILE).exists()


def test_entries_naming_one_slot_twice_are_dropped_at_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = items(2)
    with SsdStore(spec(tmp_path)) as s:
        s.put_many(first)
    env = lmdb.open(str(tmp_path / "ssd"), max_dbs=4)
    with env.begin(write=True) as txn:  # a damaged index: k0001 claims k0000's slot
        meta = env.open_db(b"meta", txn=txn)
        first_rec, second_rec = txn.get(b"\x01tk0000", db=meta), txn.get(b"\x01tk0001", db=meta)
        assert first_rec is not None and second_rec is not None
        slot_of_first = first_rec[33:41]  # META: <QQddB then the slot
        rec = bytearray(second_rec)
        rec[33:41] = slot_of_first
        txn.put(b"\x01tk0001", bytes(rec), db=meta)
    env.close()
    with caplog.at_level(logging.WARNING, "kvtier.tiers.ssd.store"), SsdStore(spec(tmp_path)) as s:
        assert len(s) == 1 and s.free_slots() == 31
        assert s.get("t", b"k0000") == first[0].payload and s.get("t", b"k0001") is None
        assert s.stats().used_bytes == SLOT + HEADER_SIZE
    assert "1 index entries were undecodable or shared a slot; dropped" in caplog.text


def test_a_failed_payload_write_is_a_refusal_and_returns_the_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with SsdStore(spec(tmp_path)) as s:
        assert s._slots is not None

        def disk_full(*_: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(s._slots, "write", disk_full)
        r = s.put_many(items(4))
        assert r.stored == [] and len(r.refused) == 4 and s.stats().refused_total == 4
        assert s.free_slots() == 32 and len(s) == 0 and s.counters.io_errors == 1
        monkeypatch.undo()
        batch = items(4, tag=b"ok")
        assert len(s.put_many(batch).stored) == 4
        assert all(s.get("t", it.key) == it.payload for it in batch)
