"""The fd socket of a daemon with tenants: hands a client its tenant's DRAM memory as an fd
(SCM_RIGHTS) after checking its token, and makes the daemon non-dumpable.

An isolated pool (`kvtier.tiers.dram_regions`) has no name to open, so a client cannot map it by
itself: it connects to `<socket>.fds` (`kvtier.core.segment.fd_socket_path`, mode 0600 like the
gRPC socket, or 0660 with the socket group), sends `KVTFD1 <token>\\n` and gets one JSON line
naming its tenant, the pool's generation and size, with its tenant's file as ancillary data — the
memory of that tenant's pages only. A missing, malformed or unknown token gets an error line and
no fd. The token is checked by the same `Authenticator` as every RPC (a reload's new tokens apply
to the next request).

An fd the daemon holds is still reachable by a process of the same user through
`/proc/<daemon pid>/fd/N` or ptrace; `make_undumpable` (prctl PR_SET_DUMPABLE 0) closes both: the
kernel then refuses them to anyone without CAP_SYS_PTRACE. (It also stops core dumps of the
daemon.)

One thread serves the socket, a connection at a time, each with a 2 s deadline (a client that
sends nothing holds it no longer).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from kvtier.core.errors import KvtierError, UsageError
from kvtier.core.segment import FD_MESSAGE_MAX, fd_reply, fd_socket_path, parse_fd_request
from kvtier.daemon import sharing
from kvtier.daemon.auth import Authenticator
from kvtier.tiers.dram import DramPool

log = logging.getLogger(__name__)

PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3
CONNECTION_TIMEOUT_S = 2.0


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
        self.served = 0
        self.refused = 0

    def start(self) -> None:
        self.path.unlink(missing_ok=True)
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
        sock.settimeout(0.2)
        sharing.share_socket(self.path, self._group)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="kvtier-fds", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                raise
            with conn:
                try:
                    self._answer(conn)
                except OSError as exc:
                    log.debug("fd socket connection: %s", exc)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(CONNECTION_TIMEOUT_S)
        line = b""
        while not line.endswith(b"\n") and len(line) < FD_MESSAGE_MAX:
            got = conn.recv(FD_MESSAGE_MAX - len(line))
            if not got:
                break
            line += got
        token = parse_fd_request(line)
        try:
            if token is None:
                raise KvtierError("expected 'KVTFD1 <token>\\n'")
            tenant = self._auth().authenticate((("authorization", f"Bearer {token}"),))
            fd = self._pool.tenant_fd(tenant.name)
        except KvtierError as exc:
            self.refused += 1
            conn.sendall(fd_reply(error=str(exc)))
            return
        reply = fd_reply(tenant.name, self._pool.generation, self._pool.size)
        socket.send_fds(conn, [reply], [fd])
        self.served += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._sock is not None:
            self._sock.close()
        self.path.unlink(missing_ok=True)
