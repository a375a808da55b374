"""The DRAM tier survives the daemon's restart (`keep_dram`), against real daemon processes:
SIGTERM and SIGKILL, a dead daemon's leases, formats and shapes it cannot read, and a pool with
tenants whose memfds a real fd-store holder (`tests/fd_holder.py`) keeps.

Blocks are checked byte for byte after every restart (`payload`: bytes that follow from the key),
so a block served from the wrong slot, a half-written one or another tenant's shows as a
mismatch, never as a hit.
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import lmdb
import numpy as np
import pytest

from kvtier.client.sync_client import Client, KvtierRpcError, LayoutDecl
from kvtier.core.types import Tier
from kvtier.tiers import segment_owner
from kvtier.tiers.dram_keep import keep_path
from tests.daemon_fixture import DaemonProc, wait_for, wait_ssd_blocks
from tests.fd_holder import FdHolder

KEEP = ("--keep-dram", "true", "--ssd-bytes", "0")
SMALL = LayoutDecl(b"keep-test-layout-64k", 64 << 10, 16, model_id="keep-model")
ODD = LayoutDecl(b"keep-test-layout-odd", 100_000, 16, model_id="keep-model")  # another class


def chain(seed: int, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(n)]


def payload(key: bytes, nbytes: int) -> np.ndarray:
    """The block stored under `key`: bytes that follow from it (any other block differs)."""
    reps = -(-nbytes // 32)
    return np.frombuffer((key * reps)[:nbytes], dtype=np.uint8)


def store(kv: Client, keys: list[bytes]) -> None:
    n = kv.layout.block_bytes
    assert kv.store(keys, [payload(k, n) for k in keys]).stored == len(keys)


def loaded_right(kv: Client, keys: list[bytes]) -> int:
    """Blocks of `keys` served from DRAM, each checked byte for byte (AssertionError on a wrong
    one)."""
    n = kv.layout.block_bytes
    with kv.load(keys) as got:
        for k, view, tier in zip(keys, got.views, got.tiers, strict=False):
            assert tier is Tier.DRAM
            assert np.array_equal(view, payload(k, n)), "a wrong block was served"
        return int(got.blocks)


def pool_path(d: DaemonProc) -> str:
    rec = segment_owner.read_record(segment_owner.record_path(d.socket))
    assert rec is not None
    return rec.path


@pytest.fixture
def kept(tmp_path: Path) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path / "d", KEEP).start()
    try:
        yield d
    finally:
        if d.proc is not None:
            d.stop()
    assert not list(Path("/dev/shm").glob(Path(pool_name(d)).name + "*"))


def pool_name(d: DaemonProc) -> str:
    return "/dev/shm/kvtier-" + hashlib.sha256(str(d.socket).encode()).hexdigest()[:16]


def test_sigterm_and_sigkill_keep_every_committed_block(kept: DaemonProc) -> None:
    d = kept
    a, b = chain(1, 24), chain(2, 9)
    with Client(d.socket, layout=SMALL) as kv, Client(d.socket, layout=ODD) as odd:
        store(kv, a)
        store(odd, b)
        generation = kv.stats().segment.generation
        path = pool_path(d)
        d.stop(keep=True)
        assert "DRAM tier kept for the next daemon: 33 blocks" in d.log()
        assert os.path.exists(path) and os.path.exists(keep_path(path))
        d.start()
        assert "DRAM tier adopted from the previous daemon: 33 blocks" in d.log()
        assert loaded_right(kv, a) == 24 and loaded_right(odd, b) == 9
        # the same pool, the same generation: the client kept its mapping (nothing re-mapped)
        assert kv.stats().segment.generation == generation
        assert kv.stats().active_leases == 0
        d.kill(keep=True)
        d.start()
        assert loaded_right(kv, a) == 24 and loaded_right(odd, b) == 9
        assert kv.stats().segment.generation == generation
        more = chain(3, 5)  # and the adopted pool takes new blocks beside the old
        store(kv, more)
        assert loaded_right(kv, more) == 5 and loaded_right(kv, a) == 24
        assert sum(t.blocks for t in kv.stats().tiers if t.tier == 2) == 38


def test_without_keep_dram_a_restart_starts_cold(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d", ("--ssd-bytes", "0")).start()
    try:
        keys = chain(4, 6)
        with Client(d.socket, layout=SMALL) as kv:
            store(kv, keys)
            d.stop()
            assert not os.path.exists(pool_name(d))
            d.start()
            assert kv.lookup(keys).hit_blocks == 0
            assert "not kept at a stop (keep_dram off)" in d.log()
    finally:
        d.stop()


def test_a_dead_daemons_leases_are_void_but_hold_their_slots_until_their_deadline(
        kept: DaemonProc) -> None:
    """SIGKILL while a client writes blocks it has not committed and holds committed ones for
    reading: after the restart the unwritten blocks are never served and neither lease can be
    used (Commit, Release: NOT_FOUND); the write slots and the read blocks stay held until the
    dead daemon's leases would have ended (a writer or reader that has not noticed may still be
    copying), then are free."""
    d = kept
    done, writing = chain(5, 8), chain(6, 4)
    with Client(d.socket, layout=SMALL, lease_ttl_s=4.0) as kv:
        store(kv, done)
        tx_block = kv.store_into(writing)
        tx = tx_block.__enter__()
        for i, view in tx.slots[:2]:
            np.copyto(view, payload(writing[i], SMALL.block_bytes))  # half of them written
        reading = kv.acquire(done)
        assert reading.blocks == 8
        d.kill(keep=True)
        killed = time.monotonic()
        d.start()
        log = d.log()
        assert "DRAM tier adopted from the previous daemon: 8 blocks" in log
        assert "8 blocks and 4 slots held until the previous daemon's leases" in log
        assert kv.lookup(writing).hit_blocks == 0
        assert loaded_right(kv, done) == 8
        assert kv.stats().tenant_dram_bytes == 12 * SMALL.block_bytes  # 4 slots held
        with pytest.raises(KvtierRpcError) as exc:
            tx_block.__exit__(None, None, None)  # its Commit
        assert exc.value.code is grpc.StatusCode.NOT_FOUND
        with pytest.raises(KvtierRpcError) as exc:
            kv.release(reading.lease_id)
        assert exc.value.code is grpc.StatusCode.NOT_FOUND
        wait_for(lambda: kv.stats().tenant_dram_bytes == 8 * SMALL.block_bytes, 30)
        assert time.monotonic() - killed > 2.0  # not before the leases' deadline
        assert kv.lookup(writing).hit_blocks == 0
        store(kv, writing)  # written again under a lease of the new daemon
        assert loaded_right(kv, writing) == 4 and loaded_right(kv, done) == 8


def _set_u32(path: str, offset: int, value: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, struct.pack("<I", value), offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize("which", ["pool", "keep file"])
def test_a_pool_of_another_format_starts_cold_and_serves_nothing_of_it(
        kept: DaemonProc, which: str) -> None:
    d = kept
    keys = chain(8, 5)
    with Client(d.socket, layout=SMALL) as kv:
        store(kv, keys)
        path = pool_path(d)
        old = kv.stats().segment.generation
        d.stop(keep=True)
        _set_u32(path if which == "pool" else keep_path(path), 8, 99)  # the format version
        d.start()
        line = [x for x in d.log().splitlines() if "DRAM tier starts cold" in x]
        want = ("DRAM pool format version 99; this kvtier reads version 2" if which == "pool"
                else "its keep file has format 99; this kvtier reads format 1")
        assert len(line) == 1 and want in line[0], d.log()[-2000:]
        assert kv.lookup(keys).hit_blocks == 0
        assert kv.stats().segment.generation != old  # a fresh pool; the client re-mapped it
        store(kv, keys)
        assert loaded_right(kv, keys) == 5


def test_a_pool_of_another_shape_starts_cold(kept: DaemonProc) -> None:
    d = kept
    keys = chain(9, 5)
    with Client(d.socket, layout=SMALL) as kv:
        store(kv, keys)
        d.stop(keep=True)
        d.args[d.args.index("--dram-bytes") + 1] = "24MiB"
        d.start()
        assert "DRAM tier starts cold" in d.log() and "the kept pool has" in d.log()
        assert kv.lookup(keys).hit_blocks == 0


def test_an_ssd_store_of_another_format_starts_cold(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d", ("--ssd-admit-after", "1")).start()
    try:
        keys = chain(10, 4)
        with Client(d.socket, layout=SMALL) as kv:
            store(kv, keys)
            assert wait_ssd_blocks(kv, 4) == 4
            d.stop()
            env = lmdb.open(str(d.data_dir / "ssd"), max_dbs=8, subdir=True)
            with env.begin(write=True) as txn:
                info = env.open_db(b"info", txn=txn)
                txn.put(b"format", struct.pack("<Q", 99), db=info)
            env.close()
            d.start()
            lines = [x for x in d.log().splitlines() if "store format 99" in x]
            assert len(lines) == 1 and "discarding it and starting empty" in lines[0]
            assert kv.lookup(keys).hit_blocks == 0
    finally:
        d.stop()


TOKENS = ('[tenants.alice]\ntoken = "alice-token-1"\n\n'
          '[tenants.bob]\ntoken = "bob-token-1"\n')


class HeldDaemon:
    """A daemon with tenants run by the fd-store holder (`tests.fd_holder`), which keeps the
    memfds the daemon hands it and passes them to the next start, as systemd does."""

    def __init__(self, workdir: Path, args: tuple[str, ...]) -> None:
        self.d = DaemonProc(workdir, args)
        self.d.workdir.mkdir(parents=True, exist_ok=True)
        self.holder = FdHolder(workdir / "holder",
                               [sys.executable, "-m", "kvtier", "serve", *self.d.args],
                               self.d.env, self.d.log_path)

    @property
    def socket(self) -> Path:
        return self.d.socket

    def start(self) -> None:
        self.holder.start()
        assert self.holder.wait_ready(), self.d.log()[-3000:]  # READY=1 over NOTIFY_SOCKET
        wait_for(self.d._healthy, 60)

    def close(self) -> None:
        self.holder.close()


def test_tenants_dram_survives_restarts_in_the_fd_store(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS)
    h = HeldDaemon(tmp_path / "d", (*KEEP, "--tokens-file", str(tokens)))
    try:
        h.start()
        a_keys, b_keys = chain(20, 10), chain(21, 6)
        with Client(h.socket, layout=SMALL, token="alice-token-1") as a, \
                Client(h.socket, layout=SMALL, token="bob-token-1") as b:
            store(a, a_keys)
            store(b, b_keys)
            held = h.holder.stored()
            assert held.pop("kvtier-keep") == 1
            assert len(held) == 2 and all(n.startswith("kvtier-dram-") for n in held)
            generation = a.stats().segment.generation
            for stop in (h.holder.term, h.holder.kill):
                stop()
                h.start()
                assert loaded_right(a, a_keys) == 10 and loaded_right(b, b_keys) == 6
                assert a.lookup(b_keys).hit_blocks == 0 and b.lookup(a_keys).hit_blocks == 0
                assert a.stats().segment.generation == generation  # the same memfd, mapped
            assert "DRAM tier adopted from the previous daemon: 16 blocks" in h.d.log()
            mine = a._segment.dram._buf.tobytes() if a._segment and a._segment.dram else b""
            assert all(k in mine for k in a_keys)  # her blocks are in her mapping ...
            assert not any(k in mine for k in b_keys)  # ... and none of his
            # bob's token changes while the daemon is down: his region is not adopted (a client
            # of the old token may still map it), and what that client maps is emptied
            old = b._segment.dram._buf if b._segment and b._segment.dram else None
            before = set(h.holder.stored())
            h.holder.term()
            tokens.write_text(TOKENS.replace("bob-token-1", "bob-token-2"))
            h.start()
            assert "tenant 'bob''s DRAM starts cold: its tenant's token changed" in h.d.log()
            assert loaded_right(a, a_keys) == 10
            with Client(h.socket, layout=SMALL, token="bob-token-2") as b2:
                assert b2.lookup(b_keys).hit_blocks == 0
            assert old is not None and not any(k in old.tobytes() for k in b_keys)
            after = set(h.holder.stored())  # the keep file, alice's region, bob's new one
            assert len(after) == 3 and len(before & after) == 2  # bob's old one: released
    finally:
        h.close()


def test_tenants_without_a_holder_start_cold_and_say_so(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS)
    d = DaemonProc(tmp_path / "d", (*KEEP, "--tokens-file", str(tokens)))
    d.env.pop("NOTIFY_SOCKET", None)
    d.start()
    try:
        assert "keep_dram: nothing holds the tenants' DRAM (memfds) across a restart" in d.log()
        keys = chain(22, 4)
        with Client(d.socket, layout=SMALL, token="alice-token-1") as a:
            store(a, keys)
            d.stop()
            d.start()
            assert a.lookup(keys).hit_blocks == 0
    finally:
        d.stop()


def test_sigkills_during_batched_writes_lose_nothing_committed_and_serve_nothing_wrong(
        tmp_path: Path) -> None:
    """The benchmark's loop (`bench.restart`, 50 kills there), 5 kills: a writer stores chains
    without pause, each block copied in two halves; after each SIGKILL and restart every chain it
    saw committed loads byte for byte, and every block that loads is the one its key names."""
    from bench.restart import kill_loop

    got = kill_loop(5, tmp_path / "k", dram="64MiB")
    assert got["kills"] == 5 and got["committed_checked"] > 0
    assert got["lost"] == 0 and got["wrong"] == 0
    assert not list(Path("/dev/shm").glob(
        "kvtier-" + hashlib.sha256(str(tmp_path / "k" / "kvtier.sock").encode()).hexdigest()[:16]
        + "*"))


HOLDER = """
import sys, time
from kvtier.client.sync_client import Client, LayoutDecl
from tests.test_daemon_keep import SMALL, chain
kv = Client(sys.argv[1], layout=SMALL, lease_ttl_s=600)
kv.acquire(chain(30, 6))
tx = kv.store_into(chain(31, 3))
tx.__enter__()
print("held", flush=True)
time.sleep(600)
"""


def test_a_killed_clients_leases_end_with_its_session_after_a_restart(kept: DaemonProc) -> None:
    """An engine that dies after the daemon restarted loses its leases at once, as before the
    restart: they end with its session (600 s leases: no TTL ends them in this test)."""
    d = kept
    with Client(d.socket, layout=SMALL) as kv:
        store(kv, chain(30, 6))
        d.stop(keep=True)
        d.start()
        child = subprocess.Popen([sys.executable, "-c", HOLDER, str(d.socket)],
                                 stdout=subprocess.PIPE, text=True, env=d.env,
                                 cwd=Path(__file__).resolve().parents[1])
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "held"
            assert kv.stats().active_leases == 2
            child.kill()
            child.wait()
            wait_for(lambda: kv.stats().active_leases == 0, 30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            if child.stdout is not None:
                child.stdout.close()
        assert loaded_right(kv, chain(30, 6)) == 6 and kv.lookup(chain(31, 3)).hit_blocks == 0


def test_an_engine_link_uses_a_restarted_daemon_at_once(kept: DaemonProc) -> None:
    """An engine's link (`integrations/common/link.py`) that met the daemon dead waits out its
    `retry_after_s` (10 minutes here) before it asks again — unless a new daemon takes the
    socket: then it reconnects at once and loads the blocks the kept DRAM tier still holds. A
    daemon that is gone and not replaced keeps the outage."""
    from kvtier.integrations.common.link import DaemonLink

    settings = SimpleNamespace(socket=str(kept.socket), token="", timeout_s=5.0,
                               retry_after_s=600.0, lease_ttl_s=0.0)
    link = DaemonLink(settings, SMALL, "test")
    keys = chain(40, 6)
    try:
        client = link.client()
        assert client is not None
        store(client, keys)
        kept.kill(keep=True)
        with pytest.raises(KvtierRpcError) as exc:
            client.lookup(keys)
        link.failed(exc.value, "Lookup")
        assert link.down() and link.client() is None
        time.sleep(0.3)  # longer than the link's probe interval: still the dead daemon's file
        assert link.down() and link.client() is None
        kept.start()
        wait_for(lambda: not link.down(), 10)
        again = link.client()
        assert again is not None and loaded_right(again, keys) == 6
        assert link.outages == 1
    finally:
        link.close()


def test_blocks_with_an_ssd_copy_are_adopted_beside_it(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d", ("--keep-dram", "true", "--ssd-admit-after", "1")).start()
    try:
        keys = chain(50, 8)
        with Client(d.socket, layout=SMALL) as kv:
            store(kv, keys)
            assert wait_ssd_blocks(kv, 8) == 8
            d.stop(keep=True)
            d.start()
            assert "DRAM tier adopted from the previous daemon: 8 blocks" in d.log()
            assert loaded_right(kv, keys) == 8  # from DRAM (checked), not promoted from SSD
            tiers = {t.tier: t.blocks for t in kv.stats().tiers}
            assert tiers[2] == 8 and tiers[3] == 8
            assert kv.stats().tenant_dram_bytes == 8 * SMALL.block_bytes
    finally:
        d.stop()
