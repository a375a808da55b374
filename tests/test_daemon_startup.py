"""Durability and start-up, on a real `kvtier serve` process: a damaged SSD store never stops the
daemon from starting, one daemon per data dir, the SSD size is kept across starts, and the
where-and-how-much line is the first log line."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvtier._version import __version__
from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.core.types import Tier
from kvtier.daemon import config
from tests.daemon_fixture import DaemonProc, wait_for

BLOCK = 65536
LAYOUT = LayoutDecl(fingerprint=b"startup-fp-01", block_bytes=BLOCK, block_tokens=16,
                    model_id="startup-model@1")


def chain(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) + bytes(30) for i in range(n)]


def payloads(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(n)]


def fill(d: DaemonProc, chains: int, per_chain: int) -> list[tuple[list[bytes], list[bytes]]]:
    """Stores `chains` chains and waits until all of them are on SSD."""
    stored = [(chain(40 + c, per_chain), payloads(per_chain, c)) for c in range(chains)]
    with Client(d.socket, layout=LAYOUT) as kv:
        for keys, data in stored:
            kv.store(keys, data)
        wait_for(lambda: kv.stats().tiers[1].blocks == chains * per_chain)
    return stored


def metric(d: DaemonProc, name: str, **labels: str) -> float:
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels
                   else "")
    for line in d.metrics_text().splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{want} not exported")


def first_line(d: DaemonProc) -> str:
    return d.log().splitlines()[0]


def serves_and_keeps(d: DaemonProc) -> None:
    """The (fresh) store takes blocks and keeps them over a restart."""
    keys, data = chain(99, 3), payloads(3, 99)
    with Client(d.socket, layout=LAYOUT) as kv:
        kv.store(keys, data)
        wait_for(lambda: kv.stats().tiers[1].blocks >= 3)
    d.stop()
    d.start()
    with Client(d.socket, layout=LAYOUT) as kv, kv.load(keys) as got:
        assert got.blocks == 3 and [bytes(v) for v in got.views] == data


# -- item 8: a damaged SSD index never stops the daemon ---------------------------------------

def test_undecodable_tenant_byte_is_skipped_counted_and_the_rest_serves(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d", ["--ssd-admit-after", "1"]).start()
    try:
        stored = fill(d, 3, 2)
        d.stop()
        env = lmdb.open(str(d.data_dir / "ssd"), max_dbs=4, map_size=1 << 30)
        meta = env.open_db(b"meta")
        with env.begin(write=True, db=meta) as txn:  # one byte of one key's tenant name
            skey, rec = next(iter(txn.cursor()))
            assert skey[1:9] == b"default/"
            txn.delete(skey)
            txn.put(skey[:1] + b"\xff" + skey[2:], rec)
        env.close()
        d.start()
        assert d.healthy()
        assert "index entries could not be decoded; skipped and deleted" in d.log()
        assert metric(d, "kvtier_ssd_damage_total", kind="undecodable_entry") == 1
        served = 0
        with Client(d.socket, layout=LAYOUT) as kv:
            for keys, data in stored:
                with kv.load(keys) as got:
                    assert [bytes(v) for v in got.views] == data[:got.blocks]  # never wrong
                    served += got.blocks
        assert served >= 4  # the two other chains whole (the damaged key's chain may go)
    finally:
        d.stop()


def test_stored_keys_keep_the_namespace_string_of_earlier_versions(tmp_path: Path) -> None:
    """The index keys blocks by a typed `Namespace(tenant, layout id)`; the SSD store must still
    write (and so read back) the string earlier versions wrote, `len | "<tenant>/ns2:<layout id
    hex>" | block key`, or a restart after an upgrade would drop every stored block."""
    d = DaemonProc(tmp_path / "d", ["--ssd-admit-after", "1"]).start()
    try:
        (keys, data), = fill(d, 1, 3)
        d.stop()
        # the layout id: SHA-256 over canonical CBOR of ("kvtier-root/v1", model id, fingerprint)
        cbor = (b"\x83" + b"\x6ekvtier-root/v1" + b"\x6fstartup-model@1"
                + b"\x4dstartup-fp-01")
        ns = b"default/ns2:" + hashlib.sha256(cbor).hexdigest().encode()
        env = lmdb.open(str(d.data_dir / "ssd"), max_dbs=4, map_size=1 << 30, readonly=True,
                        lock=False)
        with env.begin(db=env.open_db(b"meta", create=False)) as txn:
            stored = sorted(bytes(k) for k, _ in txn.cursor())
        env.close()
        assert len(ns) == 76
        assert stored == sorted(b"\x4c" + ns + k for k in keys)
        d.start()
        with Client(d.socket, layout=LAYOUT) as kv, kv.load(keys) as got:
            assert got.tiers == [Tier.SSD] * 3 and [bytes(v) for v in got.views] == data
    finally:
        d.stop()


@pytest.mark.parametrize("damage", ["invalid", "truncated", "garbled"])
def test_store_that_cannot_be_opened_is_moved_aside(tmp_path: Path, damage: str) -> None:
    d = DaemonProc(tmp_path / "d", ["--ssd-admit-after", "1"]).start()
    try:
        fill(d, 8, 8)
        d.stop()
        path = d.data_dir / "ssd" / "data.mdb"
        if damage == "invalid":  # MDB_INVALID on main: exit 2 at every start
            path.write_bytes(b"this is not an LMDB file" * 1000)
        elif damage == "truncated":  # half its pages: SIGBUS on main, nothing logged
            env = lmdb.open(str(path.parent), readonly=True, lock=False, max_dbs=4)
            used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]  # the file is reserved
            env.close()  # beyond its pages (`ssd_files.preallocate`): cut into the pages
            with open(path, "r+b") as fh:
                fh.truncate(used // 2)
        else:  # every page but the two meta pages overwritten: MDB_CORRUPTED or a SIGBUS
            raw = bytearray(path.read_bytes())
            noise = np.random.default_rng(7).integers(0, 256, len(raw), dtype=np.uint8)
            raw[2 * 4096:] = noise[2 * 4096:].tobytes()
            path.write_bytes(bytes(raw))
        before = path.read_bytes()
        d.log_path.unlink()
        d.start()
        assert d.healthy()
        aside = [p for p in d.data_dir.iterdir() if p.name.startswith("ssd.damaged-")]
        assert len(aside) == 1 and (aside[0] / "data.mdb").read_bytes() == before  # kept as is
        errors = [ln for ln in d.log().splitlines() if " ERROR " in ln]
        assert len(errors) == 1 and str(d.data_dir / "ssd") in errors[0]
        assert str(aside[0]) in errors[0] and "moved it aside" in errors[0]
        assert first_line(d).split(": ", 1)[1].startswith(f"kvtier {__version__} serving on")
        assert metric(d, "kvtier_ssd_damage_total", kind="store_moved_aside") == 1
        serves_and_keeps(d)
    finally:
        d.stop()


# -- item 9: one daemon per data dir ------------------------------------------------------------

def test_second_daemon_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    first = DaemonProc(tmp_path / "a").start()
    try:
        store = first.data_dir / "ssd" / "data.mdb"
        size = store.stat().st_size
        proc = subprocess.run(
            [sys.executable, "-m", "kvtier", "serve", "--socket", str(tmp_path / "b.sock"),
             "--data-dir", str(first.data_dir), "--ssd-bytes", "256MiB", "--dram-bytes",
             "16MiB", "--slot-bytes", "64KiB", "--metrics", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=60, env=first.env)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.splitlines() == [
            f"kvtier serve: error: data dir {first.data_dir} is in use by another kvtier daemon "
            f"(pid {first.proc.pid}, socket {first.socket}); give each daemon its own "
            "--data-dir"]
        assert store.stat().st_size == size and first.healthy()
        assert not (tmp_path / "b.sock").exists()
    finally:
        first.stop()
    again = DaemonProc(tmp_path / "a").start()  # the lock went with the first daemon
    again.stop()


def test_the_lock_dies_with_a_sigkilled_daemon(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d").start()
    d.kill()
    d.start()
    lock = json.loads((d.data_dir / "daemon.lock").read_text())
    assert lock == {"pid": d.proc.pid if d.proc else -1, "socket": str(d.socket)}
    d.stop()


# -- item 10: the SSD size is kept --------------------------------------------------------------

def without_ssd_flag(d: DaemonProc) -> DaemonProc:
    i = d.args.index("--ssd-bytes")
    del d.args[i:i + 2]
    return d


def test_ssd_size_is_kept_and_a_shrink_evicts_and_says_how_much(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d", ["--ssd-admit-after", "1", "--ssd-bytes", "4MiB"]).start()
    def capacity() -> int:
        with Client(d.socket, layout=LAYOUT) as kv:
            return int(kv.stats().tiers[1].capacity_bytes)

    try:
        assert capacity() == 4 << 20
        fill(d, 10, 4)  # 40 blocks of 64 KiB + 64 B header: 2.5 MiB
        d.stop()
        without_ssd_flag(d).start()  # no setting: the size kept, not a fresh default
        assert capacity() == 4 << 20
        serving = [ln for ln in d.log().splitlines() if " serving on unix:" in ln]
        assert len(serving) == 2 and "SSD tier 4 MiB under" in serving[-1]
        assert "SSD tier shrank" not in d.log()
        printed = subprocess.run(
            [sys.executable, "-m", "kvtier", "serve", "--data-dir", str(d.data_dir),
             "--print-config"], capture_output=True, text=True, timeout=60, env=d.env)
        # this machine's kept size, printed as derived (a file read elsewhere sizes afresh)
        assert any(ln.startswith('# ssd_bytes = "4MiB"  # derived: ') and "kept.toml" in ln
                   for ln in printed.stdout.splitlines())
        d.stop()
        d.args += ["--ssd-bytes", "1MiB"]  # explicit: shrink to 15 blocks
        d.log_path.unlink()
        d.start()
        assert capacity() == 1 << 20
        line = next(ln for ln in d.log().splitlines() if "SSD tier shrank" in ln)
        m = re.search(r"shrank to 1 MiB \(ssd_bytes\): evicted (\d+) stored "
                      r"blocks \(([\d.]+ [KM]iB)\) that no longer fit, with their descendants; "
                      r"(\d+) kept", line)
        assert m, line
        evicted, kept = int(m.group(1)), int(m.group(3))
        assert evicted + kept == 40 and 0 < kept <= 15
        with Client(d.socket, layout=LAYOUT) as kv:
            assert kv.stats().tiers[1].blocks == kept
        d.stop()
        without_ssd_flag(d).start()  # the explicit size is kept in turn
        assert capacity() == 1 << 20
    finally:
        d.stop()


def test_default_size_does_not_follow_the_free_disk_once_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"HOME": str(tmp_path)}
    data = tmp_path / ".local" / "share" / "kvtier"
    monkeypatch.setattr(config, "free_bytes", lambda _p: 40 << 30)
    first = config.load({}, env)
    assert first.ssd_bytes == 10 << 30 and first.data_dir == data
    data.mkdir(parents=True)
    config.write_kept(data, first.ssd_bytes)  # what the daemon does once the tier is open
    monkeypatch.setattr(config, "free_bytes", lambda _p: 28 << 30)  # the tier took its space
    assert config.load({}, env).ssd_bytes == 10 << 30
    assert config.load({"ssd_bytes": "2GiB"}, env).ssd_bytes == 2 << 30  # explicit wins
    (data / config.KEPT_FILE).write_text("ssd_bytes = [")
    with pytest.raises(config.UsageError, match=r"kept\.toml"):
        config.load({}, env)


# -- item 17: the first log line ----------------------------------------------------------------

def test_first_log_line_says_where_and_how_much(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d").start()
    try:
        line = first_line(d)
        assert f" INFO kvtier.daemon.server: kvtier {__version__} serving on unix:" in line
        for what in (str(d.socket), "metrics http://127.0.0.1:", "DRAM pool 16 MiB",
                     f"SSD tier 64 MiB under {d.data_dir}", "planner rates from"):
            assert what in line, what
        assert "SSD tier: 0 blocks indexed" in d.log().splitlines()[1]
    finally:
        d.stop()


def test_the_default_ssd_tier_is_off_on_a_small_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A default tier is a quarter of the free disk, at most 16 GiB, and off under 64 MiB."""
    MiB = 1 << 20
    for free, want in ((255 * MiB, 0), (256 * MiB, 64 * MiB), (100 << 30, 16 << 30)):
        monkeypatch.setattr(config, "free_bytes", lambda _p, f=free: f)
        assert config.default_ssd_bytes(tmp_path) == want, free


def test_a_daemon_on_a_small_disk_starts_with_the_ssd_tier_off(tmp_path: Path) -> None:
    """Defect: on a disk with 60 MiB free the default SSD tier (15 MiB, reserving 83 MiB)
    failed the start ("cannot reserve ..."); it is now off, and the start line says why. A
    real 60 MiB tmpfs (mounting needs root: skipped otherwise)."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=60m", "tmpfs", str(small)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        d = DaemonProc(tmp_path / "d")
        d.args = [a for a in d.args if a not in ("--ssd-bytes", "64MiB")]  # the default
        d.args += ["--data-dir", str(small / "kvtier")]
        d.start()
        try:
            line = next(ln for ln in d.log().splitlines() if " serving on unix:" in ln)
            assert re.search(rf"SSD tier off \([\d.]+ MiB free under {small}/kvtier: a default "
                             r"tier needs 256 MiB\)", line), line
            with Client(d.socket, layout=LayoutDecl(b"small-disk-fp-01", 4096, 16,
                                                    model_id="small/disk")) as kv:
                assert kv.store([b"k" * 32], [np.zeros(4096, np.uint8)]).stored == 1
        finally:
            assert d.stop() == 0
    finally:
        subprocess.run(["umount", str(small)], check=True)
