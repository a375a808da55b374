"""A fork server for engine children: a process that imported the engine's libraries once (vLLM
and torch: ~10 s of CPU here, three quarters of an in-process vLLM engine's start) and forks one
child per engine from then on, so each engine starts without importing them again.

    server = ForkServer(["tests.support.vllm_engine:preload"], env)   # started at once
    child = server.spawn("tests.support.vllm_engine:serve_json", spec, env, cwd, stderr_path)
    child.stdin.write(...); child.stdout.readline(); child.poll(); child.wait(60); child.kill()
    server.close()                # kills the children left, removes its socket

A child is a fresh process as far as an engine goes: it reads its model, makes its caches and
connects to its daemon itself; it gets its own session (its pid is its process group: `killpg`
ends it and whatever it started), its own environment, working directory, stdin/stdout pipes
and stderr file, and `tempfile` forgets the server's temp dir. Only what the server imported
before the fork is shared (copy-on-write), so the server must import nothing that reads the
per-engine environment at import time (the caller starts it with the environment its engines
share). The server dies with its parent (PR_SET_PDEATHSIG) and its children with it.

`Forked` is the handle of one child, the part of `subprocess.Popen` the engine launchers use:
its exit status comes from the server, which reaps it, over the child's own connection.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def _call(target: str, arg: str) -> None:
    module, _, name = target.partition(":")
    getattr(importlib.import_module(module), name)(arg)


class Forked:
    """A child of the fork server (see the module docstring)."""

    def __init__(self, pid: int, conn: socket.socket, stdin: IO[str], stdout: IO[str]) -> None:
        self.pid = pid
        self.args = ["<forked>", str(pid)]
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._conn = conn

    def poll(self) -> int | None:
        return self.wait(0.0, raising=False)

    def wait(self, timeout: float | None = None, raising: bool = True) -> int | None:
        if self.returncode is None:
            ready = select.select([self._conn], [], [], timeout)[0]
            if not ready:
                if raising:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                return None
            raw = self._conn.recv(64)
            self.returncode = int(raw.decode() or -9)  # the server gone too: killed with it
            self._conn.close()
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class ForkServer:
    def __init__(self, preload: Sequence[str], env: dict[str, str]) -> None:
        """Starts the server: `python -m tests.support.fork_server` running each `module:function`
        of `preload`, in environment `env` (its temp dir made here)."""
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-forks-"))
        self.path = self.dir / "s"
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.fork_server", str(self.path), *preload],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, cwd=root,
            env={**env, "TMPDIR": str(self.dir)})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.close()
            raise RuntimeError(f"fork server did not start: {line!r}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, target: str, arg: str, env: dict[str, str], cwd: Path, stderr: Path
              ) -> Forked:
        """A child running `target` ("module:function") with `arg`, in `env` and `cwd`, its
        stderr appended to file `stderr`."""
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err = os.open(stderr, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(str(self.path))
            request = json.dumps({"target": target, "arg": arg, "env": env, "cwd": str(cwd)})
            socket.send_fds(conn, [request.encode()], [in_r, out_w, err])
            reply = conn.recv(64)  # the child's pid (a message: SOCK_SEQPACKET)
            if not reply:
                raise RuntimeError("fork server closed the connection")
        except BaseException:
            conn.close()
            os.close(in_w)
            os.close(out_r)
            raise
        finally:
            for fd in (in_r, out_w, err):
                os.close(fd)
        return Forked(int(reply), conn, os.fdopen(in_w, "w"), os.fdopen(out_r, "r"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- the server process ----------------------------------------------------------------------

def _child(listener: socket.socket, conn: socket.socket, fds: list[int], request: dict[str, Any]
           ) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        listener.close()
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        _die_with_parent(signal.SIGKILL)
        for fd, target in zip(fds, (0, 1, 2), strict=True):
            os.dup2(fd, target)
            os.close(fd)
        conn.close()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None
        _call(request["target"], request["arg"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        with contextlib.suppress(Exception):
            atexit._run_exitfuncs()  # what a normal interpreter exit runs (the engine's own)
        os._exit(code)


def _serve(path: str, preload: Sequence[str]) -> None:
    parent = os.getppid()
    _die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the line above
        return
    for target in preload:
        _call(target, "")
    children: dict[int, socket.socket] = {}
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    try:
        while not stop[0]:
            with contextlib.suppress(InterruptedError):
                if select.select([listener], [], [], 0.2)[0]:
                    conn, _ = listener.accept()
                    msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
                    pid = os.fork()
                    if pid == 0:
                        _child(listener, conn, fds, json.loads(msg))
                    for fd in fds:
                        os.close(fd)
                    conn.sendall(b"%d" % pid)
                    children[pid] = conn
            while children:  # reap: the exit status goes to the child's connection
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                done = children.pop(pid, None)
                if done is not None:
                    with contextlib.suppress(OSError):
                        done.sendall(b"%d" % os.waitstatus_to_exitcode(status))
                    done.close()
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        listener.close()


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2:])
