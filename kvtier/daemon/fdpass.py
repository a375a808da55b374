"""The fd socket of a daemon with tenants: hands a client its tenant's DRAM memory as an fd
(SCM_RIGHTS) after checking its token, and makes the daemon non-dumpable.

An isolated pool (`kvtier.tiers.dram_regions`) has no name to open, so a client cannot map it by
itself: it connects to `<socket>.fds` (`kvtier.core.segment.fd_socket_path`, mode 0600 like the
gRPC socket, or 0660 with the socket group), sends `KVTFD1 <token>\\n` and gets one JSON line
naming its tenant, its file's generation and size, with its tenant's file as ancillary
data — the memory of that tenant's pages only. A reload that changes or revokes a tenant's token
gives it a fresh file with another generation (`DramPool.retire_tenant`); replies name it, so its
clients fetch the new one, and an fd fetched before sees no block stored after. A missing,
malformed or unknown token gets an error line and no fd. The token is checked by the same
`Authenticator` as every RPC (a reload's new tokens apply to the next request).

An fd the daemon holds is still reachable by a process of the same user through
`/proc/<daemon pid>/fd/N` or ptrace; `make_undumpable` (prctl PR_SET_DUMPABLE 0) closes both: the
kernel then refuses them to anyone without CAP_SYS_PTRACE. (It also stops core dumps of the
daemon.)

One thread serves the socket with a selector: many connections at once, each with a 2 s deadline
to send its request (a client that connects and sends nothing, or sends slowly, holds nothing but
its own connection, and no other client waits on it); at most `connection_cap()` are open (an
eighth of the daemon's file-descriptor limit), the oldest waiting one closed to make room. The
thread outlives anything a client does: a connection closed to make room is forgotten before
its events are looked at, an error on one connection closes that one only, and when accepting
fails for want of descriptors (EMFILE: gRPC connections can take them all) the listener rests
`ACCEPT_PAUSE_S` rather than spin, with one warning per `WARN_EVERY_S`. The path is claimed as
the gRPC socket's is (`kvtier.daemon.sockpath`): anything there that is not a stale socket is
refused, never removed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.core.errors import KvtierError, UsageError
from kvtier.core.segment import FD_MESSAGE_MAX, fd_reply, fd_socket_path, parse_fd_request
from kvtier.daemon import sharing, sockpath
from kvtier.daemon.auth import Authenticator
from kvtier.daemon.rpc.guard import WARNINGS
from kvtier.tiers.dram import DramPool

log = logging.getLogger(__name__)

PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3
CONNECTION_TIMEOUT_S = 2.0
ACCEPT_PAUSE_S = 0.1
_NO_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def connection_cap() -> int:
    """How many fd-socket connections may wait at once: an eighth of the soft RLIMIT_NOFILE
    (at least 16, at most 256; each holds one descriptor for at most `CONNECTION_TIMEOUT_S`)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 256
    return max(16, min(256, soft // 8))


def make_undumpable() -> bool:
    """prctl(PR_SET_DUMPABLE, 0) for this process; False (logged) when the kernel refuses."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_DUMPABLE, 0) failed: %s", os.strerror(ctypes.get_errno()))
        return False
    return bool(libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0)


class FdServer:
    """Serves `fd_socket_path(socket)` for `pool` (see the module docstring)."""

    def __init__(self, socket_path: Path, pool: DramPool, auth: Callable[[], Authenticator],
                 group: str = "") -> None:
        self.path = Path(fd_socket_path(str(socket_path)))
        self._pool = pool
        self._auth = auth
        self._group = group
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.cap = connection_cap()
        self._resume_at = 0.0  # the listener rests until then (accept ran out of descriptors)
        self.served = 0
        self.refused = 0

    def start(self) -> None:
        stale = sockpath.claim(self.path)
        if stale:
            log.info("%s", stale)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(sharing.socket_umask(self._group))
        try:
            sock.bind(str(self.path))
        except OSError as exc:
            sock.close()
            raise UsageError(f"fd socket {self.path}: {exc}") from None
        finally:
            os.umask(old_umask)
        sock.listen(64)
        sock.setblocking(False)
        sharing.share_socket(self.path, self._group)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="kvtier-fds", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        assert self._sock is not None
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        pending: dict[socket.socket, tuple[float, bytes]] = {}  # conn -> (deadline, bytes read)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(0.2):
                    conn = key.fileobj
                    if conn is self._sock:
                        self._accept(sel, pending)
                        continue
                    assert isinstance(conn, socket.socket)
                    if conn not in pending:  # closed to make room earlier in this batch
                        continue
                    try:
                        self._read(sel, pending, conn)
                    except Exception as exc:  # one connection's trouble ends it, not the thread
                        WARNINGS.warn("fd-socket", f"fd socket: closed a connection on {exc!r}")
                        if conn in pending:
                            self._drop(sel, pending, conn)
                now = time.monotonic()
                for conn in [c for c, (deadline, _) in pending.items() if deadline < now]:
                    self._drop(sel, pending, conn)
                if self._resume_at and now >= self._resume_at:
                    self._resume_at = 0.0
                    sel.register(self._sock, selectors.EVENT_READ)
        finally:
            for conn in list(pending):
                self._drop(sel, pending, conn)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector,
                pending: dict[socket.socket, tuple[float, bytes]]) -> None:
        assert self._sock is not None
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno in _NO_DESCRIPTORS:  # readable again at once: rest, do not spin
                WARNINGS.warn("fd-socket-descriptors",
                              f"fd socket: cannot accept ({exc.strerror}); pausing "
                              f"{ACCEPT_PAUSE_S:g} s")
                sel.unregister(self._sock)
                self._resume_at = time.monotonic() + ACCEPT_PAUSE_S
            else:
                log.debug("fd socket accept: %s", exc)
            return
        conn.setblocking(False)
        if len(pending) >= self.cap:  # the oldest waiting connection makes room
            self._drop(sel, pending, min(pending, key=lambda c: pending[c][0]))
        pending[conn] = (time.monotonic() + CONNECTION_TIMEOUT_S, b"")
        sel.register(conn, selectors.EVENT_READ)

    def _read(self, sel: selectors.BaseSelector,
              pending: dict[socket.socket, tuple[float, bytes]], conn: socket.socket) -> None:
        deadline, line = pending[conn]
        try:
            got = conn.recv(FD_MESSAGE_MAX - len(line))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.debug("fd socket connection: %s", exc)
            self._drop(sel, pending, conn)
            return
        line += got
        if got and not line.endswith(b"\n") and len(line) < FD_MESSAGE_MAX:
            pending[conn] = (deadline, line)
            return
        sel.unregister(conn)
        del pending[conn]
        try:
            conn.setblocking(True)
            conn.settimeout(CONNECTION_TIMEOUT_S)  # the reply is one small message
            self._answer(conn, line)
        except OSError as exc:
            log.debug("fd socket connection: %s", exc)
        finally:
            conn.close()

    @staticmethod
    def _drop(sel: selectors.BaseSelector,
              pending: dict[socket.socket, tuple[float, bytes]], conn: socket.socket) -> None:
        sel.unregister(conn)
        del pending[conn]
        conn.close()

    def _answer(self, conn: socket.socket, line: bytes) -> None:
        token = parse_fd_request(line)
        try:
            if token is None:
                raise KvtierError("expected 'KVTFD1 <token>\\n'")
            tenant = self._auth().authenticate((("authorization", f"Bearer {token}"),))
            fd, generation, size = self._pool.tenant_file(tenant.name)
        except KvtierError as exc:
            self.refused += 1
            conn.sendall(fd_reply(error=str(exc)))
            return
        try:
            socket.send_fds(conn, [fd_reply(tenant.name, generation, size)], [fd])
        finally:
            os.close(fd)
        self.served += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._sock is not None:  # only a socket this server bound is removed
            self._sock.close()
            self.path.unlink(missing_ok=True)
