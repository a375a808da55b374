"""SSD fault tests on real files and real processes: SIGKILL mid-write, bit rot, a full store."""

from __future__ import annotations

import os
import random
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvtier.tiers import blockfmt
from kvtier.tiers.ssd.store import PutItem, SsdSpec, SsdStore, split_key, stored_key

FP = b"fault-layout"
PER_BATCH = 32
BLOCK = 96 << 10


def payload(batch: int, i: int) -> bytes:
    return np.random.default_rng(batch * 1000 + i).bytes(BLOCK)


def key(batch: int, i: int) -> bytes:
    return b"b%06d-%02d" % (batch, i)


WRITER = f"""
import sys
import numpy as np
from kvtier.tiers.ssd.store import PutItem, SsdSpec, SsdStore
path, start, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = SsdStore(SsdSpec(path, 1 << 30, {FP!r}, payload=mode, slot_size={BLOCK}))
print("ready", flush=True)
rng = np.random.default_rng
b = start
while True:
    items = [
        PutItem("t", b"b%06d-%02d" % (b, i), None, rng(b * 1000 + i).bytes({BLOCK}))
        for i in range({PER_BATCH})
    ]
    print("begin", b, flush=True)
    r = s.put_many(items)
    assert len(r.stored) == {PER_BATCH}, r
    print("committed", b, flush=True)
    b += 1
"""


MODES = pytest.mark.parametrize("mode", ["lmdb", "slots"])


def check_store(path: str, mode: str) -> tuple[set[int], int]:
    """Every batch is all-or-nothing, every block verifies, and the index matches the store
    (lmdb mode: the same keys in `meta` and `blocks`; slots mode: every entry names its own
    slot, and the free set is the rest)."""
    spec = SsdSpec(path, 1 << 30, FP, payload=mode, slot_size=BLOCK)  # type: ignore[arg-type]
    with SsdStore(spec) as s:
        entries = s.entries()
        keys = {e.key for e in entries}
        assert s.stats().used_bytes == sum(e.size for e in entries)
        batches: dict[int, int] = {}
        for k in keys:
            batches[int(k[1:7])] = batches.get(int(k[1:7]), 0) + 1
        assert all(n == PER_BATCH for n in batches.values()), "a partial batch is visible"
        buf = bytearray(BLOCK)
        for k in keys:
            b, i = int(k[1:7]), int(k[8:10])
            assert s.get_into("t", k, buf) == BLOCK and buf == payload(b, i)
        assert s.stats().corrupt_total == 0
        if mode == "slots":
            assert s.free_slots() == spec.slot_count() - len(keys), "slots leaked or shared"
    env = lmdb.open(path, max_dbs=4, readonly=True, lock=False)
    with env.begin() as txn:
        blocks = {split_key(k)[1] for k, _ in txn.cursor(db=env.open_db(b"blocks", txn=txn))}
        slots = [struct.unpack_from("<q", v, 33)[0]
                 for _, v in txn.cursor(db=env.open_db(b"meta", txn=txn))]
    env.close()
    if mode == "lmdb":
        assert blocks == keys, "persistent index and stored blocks disagree"
    else:
        assert not blocks and len(set(slots)) == len(keys)
        assert all(0 <= x < spec.slot_count() for x in slots)
    return set(batches), len(keys)


@MODES
def test_sigkill_during_batched_puts(tmp_path: Path, mode: str) -> None:
    path = str(tmp_path / "ssd")
    rng = random.Random(4)
    committed: set[int] = set()
    start = 0
    in_flight_kills = 0
    for _ in range(12):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, path, str(start), mode],
            stdout=subprocess.PIPE, text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        # kill a few milliseconds after the writer starts its k-th batch: the count of batches,
        # not the machine's speed, decides how much is written (12 runs of at most 24 batches
        # stay far below the store's ~10,900 slots, so no put is refused for space)
        # and a random fraction of the time the previous put_many took, so the kill lands inside
        # a put as often on a fast disk as on a slow one
        seen = ["ready\n"]
        put_s, began = 0.004, 0.0
        for _ in range(rng.randint(1, 24)):
            while True:
                line = proc.stdout.readline()
                seen.append(line)
                if line.startswith("committed"):
                    put_s = time.monotonic() - began
                if line.startswith("begin") or not line:
                    began = time.monotonic()
                    break
        time.sleep(rng.uniform(0.0, put_s))
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate()
        out = "".join(seen) + rest
        assert proc.returncode == -signal.SIGKILL
        # a kill can cut the last line short: count complete lines only
        lines = [m.groups() for m in re.finditer(r"^(begin|committed) (\d+)\n", out, re.M)]
        reported = {int(n) for what, n in lines if what == "committed"}
        begun = {int(n) for what, n in lines if what == "begin"}
        in_flight_kills += bool(begun - reported)
        committed |= reported
        present, _ = check_store(path, mode)
        assert committed <= present, "a reported commit was lost"
        # at most the one batch in flight when killed may be present without being reported
        assert len(present - committed) <= 1, (sorted(present - committed), sorted(reported))
        committed = present
        start = max(present, default=-1) + 1
    assert len(committed) >= 12
    assert in_flight_kills >= 3, f"only {in_flight_kills} of 12 kills landed inside put_many"


def stored_with_flips(
    path: str, seed: int, mode: str
) -> tuple[SsdSpec, dict[bytes, bytes], set[bytes]]:
    """80 blocks of mixed sizes; one random bit flipped on disk in 60 of them (half in the
    header, half in the payload); 20 stay intact as a control group."""
    # slots mode: 33554432 // 300064 = 111 slots of 300000 bytes, room for all 80
    spec = SsdSpec(path, 32 << 20, FP, payload=mode, slot_size=300_000)  # type: ignore[arg-type]
    rng = random.Random(seed)
    sizes = [rng.choice([100, 3000, 70_000, 300_000]) for _ in range(80)]
    payloads = {b"k%03d" % i: os.urandom(n) for i, n in enumerate(sizes)}
    with SsdStore(spec) as s:
        s.put_many([PutItem("t", k, None, p) for k, p in payloads.items()])
    # headers live in the index records (data.mdb); payloads in their own LMDB values or in
    # slots.dat
    files = [os.path.join(path, f) for f in ("data.mdb", "slots.dat")]
    files = [f for f in files if os.path.exists(f)]
    assert len(files) == (2 if mode == "slots" else 1)
    raws = {f: open(f, "rb").read() for f in files}  # noqa: SIM115
    layout = blockfmt.layout_digest(FP)
    flipped: set[bytes] = set()
    for i, (k, p) in enumerate(payloads.items()):
        if i % 4 == 3:
            continue
        target = blockfmt.encode_header(stored_key("t", k), layout, p) if i % 2 else p
        where, bit = rng.randrange(len(target)), 1 << rng.randrange(8)
        hits = 0
        for f, raw in raws.items():
            # copy-on-write can leave stale copies of a page in free space: flip the same bit
            # in every copy, so the live one is surely hit
            fd = os.open(f, os.O_RDWR)
            try:
                at = raw.find(target)
                while at >= 0:
                    byte = bytearray(os.pread(fd, 1, at + where))
                    byte[0] ^= bit
                    os.pwrite(fd, bytes(byte), at + where)
                    hits += 1
                    at = raw.find(target, at + 1)
            finally:
                os.close(fd)
        assert hits
        flipped.add(k)
    assert len(flipped) == 60
    return spec, payloads, flipped


@MODES
def test_flipped_bits_are_always_detected_and_never_served(tmp_path: Path, mode: str) -> None:
    spec, payloads, flipped = stored_with_flips(str(tmp_path / "ssd"), 7, mode)
    with SsdStore(spec) as s:
        for k, p in payloads.items():
            got = s.get("t", k)
            if k in flipped:
                assert got is None
                assert not s.contains("t", k)
            else:
                assert got == p
        assert s.stats().corrupt_total == len(flipped)
        assert s.get("t", next(iter(flipped))) is None
        assert s.stats().corrupt_total == len(flipped)  # deleted: a plain miss afterwards
    with SsdStore(spec) as s:
        assert {e.key for e in s.entries()} == set(payloads) - flipped


@MODES
def test_flipped_bits_in_a_batch_read(tmp_path: Path, mode: str) -> None:
    spec, payloads, flipped = stored_with_flips(str(tmp_path / "ssd"), 8, mode)
    with SsdStore(spec) as s:
        bufs = [bytearray(len(p)) for p in payloads.values()]
        got = s.get_many_into([("t", k, b) for k, b in zip(payloads, bufs, strict=True)])
        for (k, p), n, b in zip(payloads.items(), got, bufs, strict=True):
            if k in flipped:
                assert n is None
            else:
                assert n == len(p) and b == p
        st = s.stats()
        assert (st.corrupt_total, st.hits_total, st.misses_total) == (60, 20, 60)
    with SsdStore(spec) as s:
        assert {e.key for e in s.entries()} == set(payloads) - flipped


@MODES
@pytest.mark.parametrize("with_evictor", [False, True])
def test_fill_far_beyond_capacity(tmp_path: Path, with_evictor: bool, mode: str) -> None:
    path = str(tmp_path / "ssd")
    order: list[tuple[str, bytes]] = []

    def evict(need: int) -> list[tuple[str, bytes]]:
        out, freed = [], 0
        while order and freed < need:
            out.append(order.pop(0))
            freed += 200_000  # an upper bound of a block's stored size here
        return out

    rng = random.Random(3)
    kept: dict[bytes, bytes] = {}
    cap = 4 << 20
    # slots mode: 4194304 // 200064 = 20 slots of 200000 bytes
    spec = SsdSpec(path, cap, FP, payload=mode, slot_size=200_000)  # type: ignore[arg-type]
    with SsdStore(spec, evictor=evict if with_evictor else None) as s:
        for b in range(60):  # ~60 * 8 * 100 KB = 48 MB offered to a 4 MiB store
            items = [
                PutItem("t", b"f%03d-%d" % (b, i), None, os.urandom(rng.randrange(1, 200_000 - 64)))
                for i in range(8)
            ]
            r = s.put_many(items)
            stored = set(r.stored)
            for it in items:
                if (it.ns, it.key) in stored:
                    kept[it.key] = it.payload
                    order.append((it.ns, it.key))
            for _, k in r.evicted:
                kept.pop(k)
            assert s.stats().used_bytes <= cap
        assert set(kept) == {e.key for e in s.entries()}
        for k, p in kept.items():
            assert s.get("t", k) == p
        if with_evictor:
            assert s.stats().evicted_total > 0
        else:
            assert s.stats().refused_total > 0
