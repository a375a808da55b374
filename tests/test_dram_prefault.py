"""`dram_prefault`: a real daemon allocates its whole DRAM pool at start (so the pages are
charged to the daemon's memory cgroup and a full /dev/shm fails the start), and by default
takes pages only as blocks are written."""

from __future__ import annotations

from pathlib import Path

from tests.daemon_fixture import DaemonProc


def _segment(d: DaemonProc) -> Path:
    """The daemon's segment, from the owner record it keeps beside its socket."""
    from kvtier.tiers import segment_owner

    rec = segment_owner.read_record(segment_owner.record_path(d.socket))
    assert rec is not None
    return Path(rec.path)


def test_prefault_allocates_the_pool_at_start(tmp_path: Path) -> None:
    allocated = {}
    for flag in ("true", "false"):
        d = DaemonProc(tmp_path / flag, ["--dram-bytes", "64MiB", "--dram-prefault", flag])
        d.start()
        try:
            seg = _segment(d)
            st = seg.stat()
            allocated[flag] = (st.st_blocks * 512, st.st_size)
        finally:
            d.stop()
    used, size = allocated["true"]
    assert used >= size >= 64 << 20
    used, size = allocated["false"]
    assert used < size // 8  # the header and what start-up touched, not the pool
