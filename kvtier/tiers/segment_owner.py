"""Who owns a daemon's DRAM segment: a record beside its socket, so that the segment of a daemon
that died without closing it is unlinked at the next start instead of holding RAM forever.

/dev/shm is memory. A daemon that exits normally unlinks its segment (`DramPool.close`); one that
is SIGKILLed, OOM-killed or crashes cannot, and with the default pool (up to 4 GiB) each such
death would leak that much RAM until reboot. So once its pool exists the daemon writes
`<socket>.segment` (JSON: shm_dir, name, generation, pid, the pid's start time), and removes it
after a clean close. Before creating its pool, a daemon on the same socket calls `reclaim`:

- no record: nothing to do;
- the recorded segment still carries our header with the recorded generation, is live, and its
  owner still runs (same pid *and* same start time, so a reused pid is not taken for the owner):
  `UsageError` — a live daemon's segment is never unlinked (e.g. its socket file was deleted);
- the segment file still carries our header (magic) with the recorded generation: unlinked;
  a file of another generation, or not a kvtier pool at all, is left alone;
- the record is removed.

Whoever SIGKILLs a daemon on purpose (tests, supervisors) may call
`reclaim(record_path(socket), pid)` once it is dead, for the same effect. Records are 0600 files
in the socket's 0700 directory.

With `keep_dram` a daemon keeps its segment for the next one instead: a stop leaves the segment,
its keep file (`kvtier.tiers.dram_keep`) and this record, and the next daemon on the socket asks
`dead_owner` and re-adopts the segment rather than unlinking it (or unlinks it, with its keep
file, when it cannot read it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import NamedTuple

from kvtier.core.errors import UsageError
from kvtier.core.segment import STATE_LIVE
from kvtier.tiers.dram import peek_header
from kvtier.tiers.dram_keep import keep_path

log = logging.getLogger(__name__)


class OwnerRecord(NamedTuple):
    shm_dir: str
    name: str
    generation: int
    pid: int
    start_ticks: int  # field 22 of /proc/<pid>/stat; -1 when unknown

    @property
    def path(self) -> str:
        return os.path.join(self.shm_dir, self.name)


def record_path(socket: Path) -> Path:
    return socket.with_name(socket.name + ".segment")


def start_ticks(pid: int) -> int:
    """When process `pid` started (clock ticks since boot), or -1 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return -1
    fields = stat[stat.rfind(b")") + 2 :].split()  # the command name may contain spaces
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return -1


def owner_alive(rec: OwnerRecord) -> bool:
    """Whether the recorded owner process still runs (a reused pid does not count)."""
    try:
        os.kill(rec.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    now = start_ticks(rec.pid)
    return rec.start_ticks < 0 or now < 0 or now == rec.start_ticks


def this_process(shm_dir: str, name: str, generation: int) -> OwnerRecord:
    pid = os.getpid()
    return OwnerRecord(shm_dir, name, generation, pid, start_ticks(pid))


def write_record(path: Path, rec: OwnerRecord) -> None:
    """Atomically (write + rename) records `rec` at `path`, mode 0600."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(rec._asdict(), f)
    os.replace(tmp, path)


def read_record(path: Path) -> OwnerRecord | None:
    """The record at `path`; None when there is none or it is unreadable (logged)."""
    try:
        data = json.loads(path.read_text())
        rec = OwnerRecord(str(data["shm_dir"]), str(data["name"]), int(data["generation"]),
                          int(data["pid"]), int(data["start_ticks"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable segment record %s: %s", path, exc)
        return None
    if not rec.name or "/" in rec.name or rec.name.startswith("."):
        log.warning("ignoring segment record %s naming %r", path, rec.name)
        return None
    return rec


def remove_record(path: Path, generation: int) -> None:
    """Removes the record at `path` if it is the one for `generation` (not a successor's)."""
    rec = read_record(path)
    if rec is not None and rec.generation == generation:
        path.unlink(missing_ok=True)


def dead_owner(path: Path) -> OwnerRecord | None:
    """The record at `path` when its owner is gone (its pool may be adopted: `keep_dram`),
    else None; raises UsageError, as `reclaim` does, while the owner still runs with its
    segment live. Changes nothing."""
    rec = read_record(path)
    if rec is None:
        return None
    header = peek_header(rec.path)
    if (header is not None and header.generation == rec.generation
            and header.state == STATE_LIVE and owner_alive(rec)):
        raise UsageError(
            f"daemon pid {rec.pid} still runs with shared-memory segment {rec.path} (recorded "
            f"in {path}); stop it first"
        )
    return rec


def reclaim(path: Path, pid: int | None = None) -> str | None:
    """Unlinks the segment recorded at `path` if its owner is gone (see the module docstring);
    returns a one-line account for the log, or None when there was no record (or, with `pid`,
    none of that process's). Raises UsageError while the owner still runs with that segment live.
    """
    rec = read_record(path)
    if rec is None or (pid is not None and rec.pid != pid):
        if rec is None and path.exists():
            path.unlink(missing_ok=True)
        return None
    header = peek_header(rec.path)
    ours = header is not None and header.generation == rec.generation
    if ours and header is not None and header.state == STATE_LIVE and owner_alive(rec):
        raise UsageError(
            f"daemon pid {rec.pid} still runs with shared-memory segment {rec.path} (recorded "
            f"in {path}); stop it first"
        )
    if ours:
        try:
            os.unlink(rec.path)
        except FileNotFoundError:
            ours = False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(keep_path(rec.path))  # its keep file (`kvtier.tiers.dram_keep`)
    path.unlink(missing_ok=True)
    if ours:
        return f"reclaimed segment {rec.path} of daemon pid {rec.pid} (no longer running)"
    return f"segment {rec.path} of daemon pid {rec.pid} already gone or replaced; left alone"
