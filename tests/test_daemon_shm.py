"""The daemon's shared-memory segment does not outlive it: a SIGKILLed daemon's segment is
reclaimed by the next daemon on the same socket, a live daemon's is never touched, and a clean
stop leaves nothing behind. Real daemon processes, real /dev/shm files."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kvtier.core.segment import STATE_LIVE
from kvtier.tiers import segment_owner as so
from kvtier.tiers.dram import peek_header
from tests.daemon_fixture import DaemonProc


def owner(d: DaemonProc) -> so.OwnerRecord:
    rec = so.read_record(so.record_path(d.socket))
    assert rec is not None and d.proc is not None and rec.pid == d.proc.pid
    header = peek_header(rec.path)
    assert header is not None and (header.state, header.generation) == (STATE_LIVE,
                                                                         rec.generation)
    return rec


def test_restart_after_sigkill_reclaims_the_segment(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d").start()
    try:
        old = owner(d)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGKILL)  # not d.kill(): that would clean up for the daemon
        d.proc.wait()
        assert peek_header(old.path) is not None  # leaked: nobody unlinked it
        d.start()
        new = owner(d)
        assert new.pid != old.pid and new.generation != old.generation
        # Same socket, same segment name: the file now is the new pool; the old one is gone.
        assert new.path == old.path
        log = d.log()
        assert f"reclaimed segment {old.path} of daemon pid {old.pid}" in log
        assert "replacing stale shared-memory segment" not in log
    finally:
        d.stop()
    assert not os.path.exists(new.path) and not so.record_path(d.socket).exists()


def test_fixture_kill_unlinks_the_dead_daemons_segment(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d").start()
    rec = owner(d)
    d.kill()
    assert not os.path.exists(rec.path) and not so.record_path(d.socket).exists()


def test_a_live_daemons_segment_is_never_unlinked(tmp_path: Path) -> None:
    a = DaemonProc(tmp_path / "d").start()
    b = DaemonProc(tmp_path / "d")
    try:
        rec = owner(a)
        a.socket.unlink()  # a's socket is gone, so b cannot tell a runs by connecting
        with pytest.raises(RuntimeError, match="daemon exited 2"):
            b.start()
        assert f"daemon pid {rec.pid} still runs with shared-memory segment {rec.path}" in b.log()
        assert owner(a) == rec and a.proc is not None and a.proc.poll() is None
    finally:
        b.kill()
        assert a.stop() == 0
    assert not os.path.exists(rec.path) and not so.record_path(a.socket).exists()
