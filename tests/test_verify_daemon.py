"""The daemon's side of shadow verification (ReportVerification) against real daemons: counts, the
quarantine of a mismatched block and its descendants on DRAM, SSD (also across a restart) and
the remote store (a real redis-server), the BlockRemoved events, a pinned subtree (lookups stop
at once, removal at the release), a block stored again after a quarantine, the WARNING line,
bad reports refused and tenants kept apart."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier._proto import kvtier_pb2 as pb
from kvtier.client.sync_client import Client, KvtierRpcError, LayoutDecl
from kvtier.commands import top_view
from kvtier.core.types import Tier
from tests.daemon_fixture import ROOT, DaemonProc, daemon, wait_for, wait_ssd_blocks  # noqa: F401
from tests.redis_fixture import RedisServer, needs_redis

BLOCK = 65536
LAYOUT = LayoutDecl(fingerprint=b"verify-layout-fp-1", block_bytes=BLOCK, block_tokens=16,
                    model_id="verify-test-model")


def chain(tag: int, n: int, start: int = 0) -> list[bytes]:
    return [bytes([tag, start + i]) + bytes(30) for i in range(n)]


def data(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(n)]


def metric(d: DaemonProc, name: str, labels: str = "") -> float:
    pat = re.compile(rf"^{name}(\{{[^}}]*\}})? (\S+)$", re.M)
    return sum(float(v) for lab, v in pat.findall(d.metrics_text()) if labels in lab)


def removals(kv: Client, n: int) -> list[pb.BlockRemoved]:
    """The first `n` BlockRemoved events of the tenant (replayed from its buffer: they
    happened before the call)."""
    out = []
    for e in kv.watch(since=1):
        if e.HasField("removed"):
            out.append(e.removed)
            if len(out) == n:
                return out
    raise AssertionError("the event stream ended")


def test_a_mismatch_quarantines_the_block_and_its_descendants(
        daemon: DaemonProc) -> None:  # noqa: F811
    """a -> b -> c, b -> d (a branch), and another prompt's chain: a report that b did not
    match removes b, c and d from DRAM (the events say so), keeps a and the other chain, and
    counts; a block stored again under b is served again."""
    main, other = chain(1, 3), chain(2, 2)
    d_key = chain(1, 1, start=9)
    with Client(daemon.socket, layout=LAYOUT) as kv:
        kv.store(main, data(3, 1))
        kv.store(d_key, data(1, 2), parent=main[1])
        kv.store(other, data(2, 3))
        seen = kv.stats()
        got = kv.report_verification(main[1:], matched=0, mismatched=True,
                                     detail="layer 1 (full, bfloat16): relative error 1.4")
        assert (got.quarantined_dram, got.quarantined_ssd, got.deferred) == (3, 0, False)
        assert kv.lookup(main).hit_blocks == 1
        assert kv.lookup([*main[:2], *d_key]).hit_blocks == 1
        assert kv.lookup(other).hit_blocks == 2
        removed = removals(kv, 1)[0]
        assert removed.medium == pb.TIER_DRAM
        assert set(removed.block_hashes) == {main[1], main[2], d_key[0]}
        s = kv.stats()
        assert (s.verify_verified_blocks, s.verify_mismatched_blocks,
                s.verify_quarantined_blocks) == (1, 1, 3)
        assert s.tiers[0].blocks == seen.tiers[0].blocks - 3
        # a match is counted, nothing removed
        assert kv.report_verification(other, matched=2, mismatched=False).quarantined_dram == 0
        assert kv.lookup(other).hit_blocks == 2
        # the engine's recomputed KV stored again under the quarantined keys: served again
        fresh = data(2, 9)
        assert kv.store(main[1:], fresh, parent=main[0]).stored == 2
        with kv.load(main) as loaded:
            assert loaded.blocks == 3 and [bytes(v) for v in loaded.views[1:]] == fresh
    assert metric(daemon, "kvtier_verify_verified_blocks_total") == 3
    assert metric(daemon, "kvtier_verify_matched_blocks_total") == 2
    assert metric(daemon, "kvtier_verify_mismatched_blocks_total",
                  'model="verify-test-model"') == 1
    assert metric(daemon, "kvtier_verify_quarantined_blocks_total", 'tier="dram"') == 3
    assert metric(daemon, "kvtier_evictions_total", 'reason="quarantine",tier="dram"') == 3
    out = subprocess.run([sys.executable, "-m", "kvtier", "stats", "--socket",
                          str(daemon.socket)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout
    assert "verification: 3 blocks verified, 1 mismatched, 3 quarantined" in out, out
    top = top_view.row(None, top_view.from_metrics("d", 0.0, daemon.metrics_text()))
    assert "1 of 3 verified blocks wrong (quarantined)" in top_view._cells(top)[-1]
    line = next(x for x in daemon.log().splitlines() if "verification MISMATCH" in x)
    assert "WARNING" in line and "tenant default" in line and "model verify-test-model" in line
    assert main[1].hex() in line and "layer 1 (full, bfloat16)" in line
    assert "3 DRAM, 0 SSD copies removed" in line


def test_quarantine_reaches_ssd_and_survives_a_restart(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d", ["--ssd-admit-after", "1"]).start()
    try:
        keys = chain(3, 4)
        with Client(d.socket, layout=LAYOUT) as kv:
            kv.store(keys, data(4, 4))
            assert wait_ssd_blocks(kv, 4) == 4
            got = kv.report_verification(keys[1:3], matched=1, mismatched=True)
            assert (got.quarantined_dram, got.quarantined_ssd) == (2, 2)
            assert kv.lookup(keys).hit_blocks == 2
        assert metric(d, "kvtier_verify_quarantined_blocks_total", 'tier="ssd"') == 2
        d.stop()  # the SSD tier is what survives: the removed blocks must not come back
        d.start()
        with Client(d.socket, layout=LAYOUT) as kv:
            assert kv.lookup(keys).tiers == [Tier.SSD, Tier.SSD]
    finally:
        d.stop()


def test_a_pinned_subtree_is_cut_at_once_and_removed_at_its_release(
        daemon: DaemonProc) -> None:  # noqa: F811
    keys = chain(4, 4)
    with Client(daemon.socket, layout=LAYOUT) as kv, Client(daemon.socket,
                                                           layout=LAYOUT) as reader:
        kv.store(keys, data(4, 5))
        lease = reader.acquire(keys)
        assert lease.blocks == 4
        got = kv.report_verification(keys[2:], matched=0, mismatched=True)
        assert got.deferred and got.quarantined_dram == 0
        assert kv.lookup(keys).hit_blocks == 2  # never served again, from now on
        assert kv.acquire(keys).blocks == 2
        assert "pending (a block of its subtree is pinned" in daemon.log()
        reader.release(lease.lease_id)
        wait_for(lambda: metric(daemon, "kvtier_verify_quarantined_blocks_total",
                                'tier="dram"') == 2)
        assert kv.stats().tiers[0].blocks == 2
        assert kv.stats().verify_quarantined_blocks == 2
        # settled: the key may be stored and served again
        assert kv.store(keys[2:], data(2, 6), parent=keys[1]).stored == 2
        assert kv.lookup(keys).hit_blocks == 4


def test_bad_reports_are_refused_and_change_nothing(
        daemon: DaemonProc) -> None:  # noqa: F811
    keys = chain(5, 3)
    with Client(daemon.socket, layout=LAYOUT) as kv:
        kv.store(keys, data(3, 7))
        for matched, mismatched in ((4, False), (3, True)):
            with pytest.raises(KvtierRpcError) as err:
                kv.report_verification(keys, matched=matched, mismatched=mismatched)
            assert err.value.code.name == "INVALID_ARGUMENT", err.value
        with pytest.raises(KvtierRpcError, match="at most 1024"):
            kv.report_verification(keys, 0, True, detail="x" * 1025)
        with pytest.raises(KvtierRpcError, match="repeat"):
            kv.report_verification([keys[0], keys[0]], 0, True)
        raw = kv._stub.ReportVerification  # a key width that does not match the layout
        with pytest.raises(Exception, match="key_width"):
            raw(pb.ReportVerificationRequest(layout=LAYOUT.layout_id, key_width=16,
                                             keys=bytes(32), matched=0, mismatched=True))
        with pytest.raises(Exception, match=r"NOT_FOUND|unknown layout"):
            raw(pb.ReportVerificationRequest(layout=bytes(32), key_width=32, keys=keys[0],
                                             matched=0, mismatched=True))
        assert kv.lookup(keys).hit_blocks == 3
        assert kv.stats().verify_verified_blocks == 0
    assert daemon.healthy()


def test_detail_cannot_forge_log_lines(
        daemon: DaemonProc) -> None:  # noqa: F811
    keys = chain(6, 2)
    with Client(daemon.socket, layout=LAYOUT) as kv:
        kv.store(keys, data(2, 8))
        kv.report_verification(keys, 1, True, detail="x\nWARNING forged line\rend")
    assert "forged line" in daemon.log()
    assert not any(x.startswith("WARNING forged") for x in daemon.log().splitlines())


def test_a_tenant_quarantines_only_its_own_blocks(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tenants.alice]\ntoken = "alice-token-1"\n'
                      '[tenants.bob]\ntoken = "bob-token-22"\n')
    d = DaemonProc(tmp_path / "d", ["--tokens-file", str(tokens)]).start()
    try:
        keys = chain(7, 3)
        with Client(d.socket, layout=LAYOUT, token="alice-token-1") as alice, \
                Client(d.socket, layout=LAYOUT, token="bob-token-22") as bob:
            alice.store(keys, data(3, 9))
            got = bob.report_verification(keys, 0, True)  # the same key bytes, bob's namespace
            assert (got.quarantined_dram, got.quarantined_ssd) == (0, 0)
            assert alice.lookup(keys).hit_blocks == 3
            assert alice.stats().verify_verified_blocks == 0
            assert bob.stats().verify_mismatched_blocks == 1
    finally:
        d.stop()


@needs_redis
def test_quarantine_deletes_the_remote_copies(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    r = RedisServer(tmp_path / "redis").start()
    a = DaemonProc(tmp_path / "a", ["--remote-url", r.url, "--ssd-bytes", "0"]).start()
    b = DaemonProc(tmp_path / "b", ["--remote-url", r.url, "--ssd-bytes", "0"]).start()
    try:
        keys = chain(8, 4)
        with Client(a.socket, layout=LAYOUT) as kv:
            kv.store(keys, data(4, 10))
            wait_for(lambda: r.client().dbsize() == 4)
            got = kv.report_verification(keys[1:], 0, True)
            assert (got.quarantined_dram, got.quarantined_remote) == (3, 3)
            assert r.client().dbsize() == 1
            kinds = [e.medium for e in removals(kv, 2)]
            assert sorted(kinds) == [pb.TIER_DRAM, pb.TIER_REMOTE]
        with Client(b.socket, layout=LAYOUT) as other:  # another node: only the first block
            assert other.lookup(keys).tiers == [Tier.REMOTE]
        assert metric(a, "kvtier_verify_quarantined_blocks_total", 'tier="remote"') == 3
    finally:
        a.stop()
        b.stop()
        r.stop()


def test_quarantine_of_a_block_not_held_counts_and_removes_nothing(
        daemon: DaemonProc) -> None:  # noqa: F811
    keys = chain(9, 2)
    with Client(daemon.socket, layout=LAYOUT) as kv:
        kv.store(keys[:1], data(1, 11))
        got = kv.report_verification(keys[1:], 0, True)
        assert (got.quarantined_dram, got.deferred) == (0, False)
        assert kv.lookup(keys).hit_blocks == 1
        assert kv.stats().verify_quarantined_blocks == 0
        assert kv.store(keys[1:], data(1, 12), parent=keys[0]).stored == 1
        assert kv.lookup(keys).hit_blocks == 2
