"""The SSD tier is reserved on disk at open (README "Running the daemon"), with the default
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
    assert "cannot reserve" in line and "No space left on device" in line
    data = tmp_path / "data" / "ssd" / "data.mdb"
    assert not data.exists() or allocated(data) < 64 * MiB
    assert not (tmp_path / "data" / "kept.toml").exists()
