"""A tiny service manager for tests: systemd's notify socket and file-descriptor store, nothing
else. It runs one service (the daemon), keeps the fds it hands over with `FDSTORE=1` (SCM_RIGHTS
on a real datagram socket, deduplicated by inode as systemd does, removed by `FDSTOREREMOVE=1`)
and passes them to the next start of the service as systemd does: fds 3.. with `LISTEN_FDS`,
`LISTEN_FDNAMES` and `LISTEN_PID` set by the forked child before it execs. Like a unit with
`NotifyAccess=main` it takes messages from the service's main process only (SCM_CREDENTIALS).

    python -m tests.fd_holder NOTIFY_SOCKET FDSTORE_MAX LOG -- COMMAND...

(the service's stdout and stderr go to LOG).

Commands on stdin, one per line, each answered by one JSON line on stdout:
`start` ({"pid"}), `term` / `kill` (signal, wait: {"code"}), `fds` ({"names": {name: count}}),
`ready` (waits for READY=1 of the current start: {"ready"}), `exit` (kills the service, closes
every stored fd, ends). The test side is `FdHolder`.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Holder:
    def __init__(self, notify: str, fdstore: int, log: str, command: list[str]) -> None:
        self.notify = notify
        self.fdstore = fdstore
        self.log = log
        self.command = command
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(notify)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.store: list[tuple[str, int]] = []  # (name, fd), in the order received
        self.pid = 0
        self.ready = False

    def receive(self) -> None:
        fds = array.array("i")
        msg, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(253 * fds.itemsize)
                                           + socket.CMSG_SPACE(12))
        got: list[int] = []
        sender = -1
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(data[: len(data) - len(data) % a.itemsize])
                got.extend(a)
            elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                sender = struct.unpack("iII", data[:12])[0]
        fields = dict(line.split("=", 1) for line in msg.decode().splitlines() if "=" in line)
        if sender != self.pid or not self.pid:  # NotifyAccess=main
            for fd in got:
                os.close(fd)
            return
        if fields.get("READY") == "1":
            self.ready = True
        name = fields.get("FDNAME", "stored")
        if fields.get("FDSTOREREMOVE") == "1":
            for n, fd in [x for x in self.store if x[0] == name]:
                os.close(fd)
                self.store.remove((n, fd))
        if fields.get("FDSTORE") == "1":
            for fd in got:
                st = os.fstat(fd)
                if any((os.fstat(f).st_dev, os.fstat(f).st_ino) == (st.st_dev, st.st_ino)
                       for _, f in self.store) or len(self.store) >= self.fdstore:
                    os.close(fd)  # already stored (systemd keeps one copy), or no room
                else:
                    self.store.append((name, fd))
            return
        for fd in got:
            os.close(fd)

    def start(self) -> int:
        self.ready = False
        names = ":".join(n for n, _ in self.store)
        fds = [fd for _, fd in self.store]
        pid = os.fork()
        if pid == 0:  # the child: fds at 3.., the variables, exec (as systemd does)
            try:
                out = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                os.dup2(out, 1)
                os.dup2(out, 2)
                # copies above the targets first, so that no target overwrites a source
                dups = [fcntl.fcntl(fd, fcntl.F_DUPFD, 3 + len(fds)) for fd in fds]
                for i, fd in enumerate(dups):
                    os.dup2(fd, 3 + i, inheritable=True)
                os.closerange(3 + len(dups), 4096)
                env = dict(os.environ, NOTIFY_SOCKET=self.notify, FDSTORE=str(self.fdstore))
                if fds:
                    env.update(LISTEN_FDS=str(len(fds)), LISTEN_FDNAMES=names,
                               LISTEN_PID=str(os.getpid()))
                os.execvpe(self.command[0], self.command, env)
            finally:
                os._exit(127)
        self.pid = pid
        return pid

    def stop(self, sig: int) -> int:
        if not self.pid:
            return -1
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)
        while True:  # keep taking messages while the service drains
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                break
            self.poll(0.05)
        self.pid = 0
        return os.waitstatus_to_exitcode(status)

    def poll(self, timeout: float) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.sock, selectors.EVENT_READ)
            for _ in sel.select(timeout):
                self.receive()

    def close(self) -> None:
        if self.pid:
            self.stop(signal.SIGKILL)
        for _, fd in self.store:
            os.close(fd)
        self.store.clear()
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.notify)


def main(argv: Sequence[str]) -> int:
    notify, fdstore, log, sep, *command = argv
    assert sep == "--" and command
    h = Holder(notify, int(fdstore), log, list(command))
    sel = selectors.DefaultSelector()
    sel.register(h.sock, selectors.EVENT_READ, "sock")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")

    def reply(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    try:
        while True:
            for key, _ in sel.select(0.1):
                if key.data == "sock":
                    h.receive()
                    continue
                cmd = sys.stdin.readline().strip()
                if cmd in ("", "exit"):
                    return 0
                if cmd == "start":
                    reply({"pid": h.start()})
                elif cmd in ("term", "kill"):
                    reply({"code": h.stop(signal.SIGTERM if cmd == "term" else signal.SIGKILL)})
                elif cmd == "fds":
                    names: dict[str, int] = {}
                    for n, _ in h.store:
                        names[n] = names.get(n, 0) + 1
                    reply({"names": names})
                elif cmd == "ready":
                    deadline = time.monotonic() + 120
                    while not h.ready and time.monotonic() < deadline and h.pid and \
                            os.waitpid(h.pid, os.WNOHANG)[0] == 0:
                        h.poll(0.05)
                    reply({"ready": h.ready})
            if h.pid and os.waitpid(h.pid, os.WNOHANG)[0]:
                h.pid = 0  # it exited on its own (a failed start)
    finally:
        h.close()


class FdHolder:
    """The test side: runs `python -m tests.fd_holder` for a daemon command line."""

    def __init__(self, workdir: Path, command: Sequence[str], env: dict[str, str],
                 log: Path, fdstore: int = 64) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.notify = str(workdir / "notify.sock")
        root = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fd_holder", self.notify, str(fdstore), str(log),
             "--", *command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=env, cwd=root)

    def _ask(self, cmd: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fd holder exited {self.proc.poll()}")
        return dict(json.loads(line))

    def start(self) -> int:
        return int(self._ask("start")["pid"])

    def wait_ready(self) -> bool:
        return bool(self._ask("ready")["ready"])

    def term(self) -> int:
        return int(self._ask("term")["code"])

    def kill(self) -> int:
        return int(self._ask("kill")["code"])

    def stored(self) -> dict[str, int]:
        return dict(self._ask("fds")["names"])

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
