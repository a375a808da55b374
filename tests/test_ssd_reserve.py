"""The SSD tier is reserved on disk at open (docs/daemon.md), with the default
settings too: a real daemon's `data.mdb` holds its whole map in allocated blocks after the start,
and a tier larger than the free disk is refused at start, in one line, with nothing allocated."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kvtier.tiers.ssd.store import SsdSpec, SsdStore
from tests.daemon_fixture import DaemonProc
from tests.test_daemon_conventions import one_line_exit_2, serve

MiB = 1 << 20


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_daemon_reserves_the_ssd_tier_at_start(tmp_path: Path) -> None:
    # the fixture's sizes leave slot_bytes < max_block_bytes, as the defaults do: payloads in LMDB
    d = DaemonProc(tmp_path / "d").start()
    try:
        data = d.data_dir / "ssd" / "data.mdb"
        assert allocated(data) >= 64 * MiB
        assert "SSD tier 64 MiB" in d.log()
        # the start line says what it took: 64 MiB x 1.25 + 64 MiB of LMDB map
        assert "144 MiB reserved on disk" in d.log()
        assert allocated(data) >= 144 * MiB
    finally:
        assert d.stop() == 0


def test_store_without_writemap_is_reserved(tmp_path: Path) -> None:
    spec = SsdSpec(str(tmp_path / "ssd"), 32 * MiB, b"fp", payload="lmdb")
    with SsdStore(spec):
        assert allocated(tmp_path / "ssd" / "data.mdb") >= spec.map_size()


def test_a_full_disk_is_found_at_start(tmp_path: Path) -> None:
    too_big = 4 * shutil.disk_usage(tmp_path).free
    run = serve("--socket", str(tmp_path / "run" / "s.sock"), "--data-dir", str(tmp_path / "data"),
                "--dram-bytes", "16MiB", "--slot-bytes", "64KiB", "--metrics", "",
                "--ssd-bytes", str(too_big))
    line = one_line_exit_2(run)
    assert "the SSD tier (its blocks and their LMDB index) needs" in line
    assert "but its filesystem has" in line and "lower ssd_bytes" in line
    data = tmp_path / "data" / "ssd" / "data.mdb"
    assert not data.exists() or allocated(data) < 64 * MiB
    assert not (tmp_path / "data" / "kept.toml").exists()


def test_shrinking_the_ssd_tier_gives_its_disk_back(tmp_path: Path) -> None:
    """Defect: a smaller ssd_bytes evicted what no longer fit but the store's file kept its old
    reservation (LMDB never shrinks a file), and no line said so. The daemon now rewrites the
    file without its free pages at the start that shrinks the tier, reserves the new size, and
    says what it gave back; the blocks that fit are still served."""
    import numpy as np

    from kvtier.client.sync_client import Client, LayoutDecl
    from tests.daemon_fixture import wait_ssd_blocks

    layout = LayoutDecl(fingerprint=b"shrink-layout-01", block_bytes=65536, block_tokens=16,
                        model_id="shrink/model")
    keys = [bytes([7, i]) * 16 for i in range(24)]
    d = DaemonProc(tmp_path / "d", ["--ssd-admit-after", "1"]).start()
    data = d.data_dir / "ssd" / "data.mdb"
    try:
        with Client(d.socket, layout=layout) as kv:
            assert kv.store(keys, [np.full(65536, i, np.uint8) for i in range(24)]).stored == 24
            assert wait_ssd_blocks(kv, 24) == 24
    finally:
        assert d.stop() == 0
    assert allocated(data) >= 144 * MiB  # 64 MiB x 1.25 + 64 MiB
    d.args += ["--ssd-bytes", "8MiB"]  # 8 MiB x 1.25 + 64 MiB = 74 MiB of map
    d.start()
    try:
        assert allocated(data) <= 75 * MiB
        line = next(ln for ln in d.log().splitlines() if "gave back" in ln)
        assert "SSD tier: its file now reserves 74 MiB (was 144 MiB): gave back" in line, line
        assert "74 MiB reserved on disk" in d.log()
        with Client(d.socket, layout=layout) as kv:
            assert kv.lookup(keys).hit_blocks == 24  # 1.5 MiB of blocks: all still fit
    finally:
        assert d.stop() == 0


def test_an_ssd_tier_of_billions_of_blocks_is_refused_without_sizing_memory_by_it(
        tmp_path: Path) -> None:
    """Defect: `--ssd-bytes 100TB` (6 billion blocks of the default 16 KiB) sized the policy's
    frequency sketch and the admission history by the block count: the daemon took 15 GB and was
    killed by the kernel before any message. Both are now bounded, and a tier larger than its
    disk is refused before the store is mapped: one line, exit 2, a small peak memory."""
    code = (
        "import os, resource, subprocess, sys\n"
        "env = {**os.environ}; env.pop('KVTIER_CONFIG', None)\n"
        "p = subprocess.run([sys.executable, '-m', 'kvtier', 'serve', *sys.argv[1:]], env=env,"
        " capture_output=True, text=True, timeout=120)\n"
        "sys.stderr.write(p.stderr)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.exit(p.returncode)\n")
    import subprocess
    import sys

    from tests.daemon_fixture import ROOT
    run = subprocess.run(
        [sys.executable, "-c", code, "--socket", str(tmp_path / "run" / "s.sock"),
         "--data-dir", str(tmp_path / "data"), "--dram-bytes", "16MiB", "--metrics", "",
         "--ssd-bytes", "100TB"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=180)
    line = one_line_exit_2(run)
    assert "needs" in line and "TiB" in line and "but its filesystem has" in line
    assert int(run.stdout.strip()) < 1024 * 1024  # peak RSS in KiB: under 1 GiB
    assert not (tmp_path / "data" / "ssd" / "data.mdb").exists()
