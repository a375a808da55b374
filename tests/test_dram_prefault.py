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


def _memory_cgroup() -> Path | None:
    """This process's cgroup-v1 memory directory when a child can be made in it (root)."""
    import os

    if os.geteuid() != 0:
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (d / "memory.usage_in_bytes").exists() and os.access(d, os.W_OK):
                return d
    return None


def test_prefaulted_pages_are_charged_to_the_daemon_not_the_writer(tmp_path: Path) -> None:
    """The reason the container image turns prefault on: shared-memory pages count against the
    memory cgroup of the process that first touches them. Without prefault, blocks an engine
    stores are charged to the engine; with it, the pool is the daemon's from the start."""
    import os
    import secrets
    import subprocess
    import sys
    import time

    import numpy as np
    import pytest

    from kvtier import Client, LayoutDecl, block_keys
    from tests.daemon_fixture import ROOT

    parent = _memory_cgroup()
    if parent is None:
        pytest.skip("needs root and a writable cgroup-v1 memory hierarchy")
    layout = LayoutDecl(fingerprint=b"prefault-test/v1", block_bytes=16384, block_tokens=16,
                        model_id="test/prefault@1")
    keys = block_keys(list(range(1024 * 16)), 16)  # 1024 blocks: 16 MiB written by the client
    blocks = [np.full(16384, 3, dtype=np.uint8)] * len(keys)
    usage: dict[str, tuple[int, int]] = {}
    for prefault in ("true", "false"):
        group = parent / f"kvtier-test-{secrets.token_hex(4)}"
        group.mkdir()
        sock = tmp_path / prefault / "kvtier.sock"
        args = [sys.executable, "-m", "kvtier", "serve", "--socket", str(sock), "--data-dir",
                str(tmp_path / prefault / "data"), "--dram-bytes", "256MiB", "--slot-bytes",
                "16KiB", "--ssd-bytes", "0", "--metrics", "", "--dram-prefault", prefault]
        procs = str(group / "cgroup.procs")

        def join(procs: str = procs) -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        proc = subprocess.Popen(args, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                preexec_fn=join, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not sock.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)
            started = int((group / "memory.usage_in_bytes").read_text())
            with Client(sock, layout=layout) as kv:
                assert kv.store(keys, blocks).stored == len(keys)
            stored = int((group / "memory.usage_in_bytes").read_text())
            usage[prefault] = (started, stored)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            deadline = time.monotonic() + 10
            while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
                time.sleep(0.1)
            group.rmdir()
    print({k: (a >> 20, b >> 20) for k, (a, b) in usage.items()}, "MiB charged")
    pool = 256 << 20  # well above the daemon's own ~40 MiB, so the two cases cannot overlap
    started, stored = usage["true"]
    assert started >= pool and stored - started < 8 << 20, usage  # the pool is the daemon's
    started, stored = usage["false"]
    assert started < pool // 2 and stored - started < 8 << 20, usage  # 16 MiB went elsewhere
