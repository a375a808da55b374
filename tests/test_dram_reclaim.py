"""Segment owner records (kvtier.tiers.segment_owner): a dead daemon's segment is unlinked, a live
one's never, and only files that are really the recorded kvtier pool are touched. Real /dev/shm
files and real (dead and live) processes."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.client.mapping import DramClient
from kvtier.core.errors import UsageError
from kvtier.core.segment import STATE_LIVE, VERSION
from kvtier.tiers import segment_owner as so
from kvtier.tiers.dram import DramPool, DramSpec, peek_header


@pytest.fixture
def pool() -> Iterator[DramPool]:
    p = DramPool.create(DramSpec(f"kvt-test-{uuid.uuid4().hex[:12]}", 4096, 4))
    yield p
    p.close()  # logs a warning only when a test unlinked it


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def record(tmp_path: Path, pool: DramPool, pid: int, ticks: int | None = None) -> Path:
    path = so.record_path(tmp_path / "kvtier.sock")
    ticks = so.start_ticks(pid) if ticks is None else ticks
    so.write_record(path, so.OwnerRecord(pool.spec.shm_dir, pool.spec.name, pool.generation,
                                         pid, ticks))
    return path


def test_record_roundtrip_is_private(tmp_path: Path, pool: DramPool) -> None:
    path = record(tmp_path, pool, os.getpid())
    assert path.name == "kvtier.sock.segment" and (path.stat().st_mode & 0o777) == 0o600
    got = so.read_record(path)
    assert got == so.this_process(pool.spec.shm_dir, pool.spec.name, pool.generation)
    assert got is not None and got.start_ticks > 0 and got.path == pool.path


def test_dead_owner_segment_is_unlinked(tmp_path: Path, pool: DramPool) -> None:
    client = DramClient.attach(pool.handle())
    path = record(tmp_path, pool, dead_pid(), ticks=-1)
    msg = so.reclaim(path)
    assert msg is not None and msg.startswith(f"reclaimed segment {pool.path}")
    assert not os.path.exists(pool.path) and not path.exists()
    assert client.view(0, 1) is not None  # a mapping outlives the unlink
    client.close()
    assert so.reclaim(path) is None  # nothing left to do


def test_live_owner_segment_is_never_unlinked(tmp_path: Path, pool: DramPool) -> None:
    path = record(tmp_path, pool, os.getpid())
    with pytest.raises(UsageError, match=f"daemon pid {os.getpid()} still runs"):
        so.reclaim(path)
    header = peek_header(pool.path)
    assert header is not None
    assert (header.version, header.state) == (VERSION, STATE_LIVE)
    assert header.generation == pool.generation
    assert path.exists()


def test_reused_pid_is_not_the_owner(tmp_path: Path, pool: DramPool) -> None:
    # This process is alive, but it started at another time than the recorded owner did.
    path = record(tmp_path, pool, os.getpid(), ticks=so.start_ticks(os.getpid()) + 1)
    assert so.reclaim(path) is not None
    assert not os.path.exists(pool.path)


def test_a_file_of_another_generation_is_left_alone(tmp_path: Path, pool: DramPool) -> None:
    pid = dead_pid()
    path = so.record_path(tmp_path / "kvtier.sock")
    so.write_record(path, so.OwnerRecord(pool.spec.shm_dir, pool.spec.name, pool.generation ^ 2,
                                         pid, -1))
    assert so.reclaim(path) == (
        f"segment {pool.path} of daemon pid {pid} already gone or replaced; left alone")
    assert os.path.exists(pool.path) and not path.exists()


def test_a_foreign_file_is_left_alone(tmp_path: Path) -> None:
    name = f"kvt-test-{uuid.uuid4().hex[:12]}"
    foreign = Path("/dev/shm") / name
    foreign.write_bytes(b"not a kvtier pool" * 300)
    try:
        pid = dead_pid()
        path = so.record_path(tmp_path / "kvtier.sock")
        so.write_record(path, so.OwnerRecord("/dev/shm", name, 7, pid, -1))
        assert peek_header(str(foreign)) is None
        assert so.reclaim(path) == (
            f"segment {foreign} of daemon pid {pid} already gone or replaced; left alone")
        assert foreign.exists() and not path.exists()
    finally:
        foreign.unlink()


def test_unreadable_record_is_dropped(tmp_path: Path, pool: DramPool) -> None:
    path = so.record_path(tmp_path / "kvtier.sock")
    for text in ("{not json", '{"name": "../etc", "shm_dir": "/dev/shm", "generation": 1, '
                 '"pid": 1, "start_ticks": 1}'):
        path.write_text(text)
        assert so.read_record(path) is None
        assert so.reclaim(path) is None and not path.exists()
    assert os.path.exists(pool.path)


def test_remove_record_keeps_a_successors(tmp_path: Path, pool: DramPool) -> None:
    path = record(tmp_path, pool, os.getpid())
    so.remove_record(path, pool.generation + 2)
    assert path.exists()
    so.remove_record(path, pool.generation)
    assert not path.exists()


def test_a_pool_never_closed_is_unlinked_at_exit_but_not_after_a_kill() -> None:
    script = (
        "import sys, uuid\n"
        "from kvtier.tiers.dram import DramPool, DramSpec\n"
        "p = DramPool.create(DramSpec(f'kvt-test-{uuid.uuid4().hex[:12]}', 4096, 4))\n"
        "print(p.path, flush=True)\n"
        "if sys.argv[1] == 'hang':\n"
        "    sys.stdin.read()\n"
    )
    ended = subprocess.run([sys.executable, "-c", script, "exit"], capture_output=True,
                           text=True, timeout=60, cwd=Path(__file__).parents[1])
    path = ended.stdout.strip()
    assert ended.returncode == 0 and path.startswith("/dev/shm/kvt-test-")
    assert not os.path.exists(path) and "was never closed; unlinking it" in ended.stderr
    killed = subprocess.Popen([sys.executable, "-c", script, "hang"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    assert killed.stdout is not None
    path = killed.stdout.readline().strip()
    killed.kill()
    killed.wait()
    try:
        assert os.path.exists(path)  # nothing runs in a SIGKILLed process: the owner record's job
    finally:
        os.unlink(path)


def test_a_garbage_collected_pool_is_unlinked() -> None:
    import gc

    p = DramPool.create(DramSpec(f"kvt-test-{uuid.uuid4().hex[:12]}", 4096, 4))
    path = p.path
    del p
    gc.collect()
    assert not os.path.exists(path)
