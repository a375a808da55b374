"""`group`: an engine running as another user, in the daemon's group, uses the socket and maps
the DRAM segment (zero copy); a user outside the group can do neither. A real daemon (root)
and real client processes as two other users; the test creates its group and users and removes
them (it needs root and useradd/groupadd, as CI has; elsewhere it is skipped)."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_fixture import ROOT, DaemonProc

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("groupadd") or not shutil.which("useradd"),
    reason="needs root with groupadd/useradd (creates a test group and users)")

CLIENT = """
import numpy as np
from kvtier import Client, LayoutDecl, block_keys
layout = LayoutDecl(fingerprint=b"group-test/v1", block_bytes=4096, block_tokens=16,
                    model_id="test/group@1")
keys = block_keys(list(range(64)), 16)
blocks = [np.full(4096, i, dtype=np.uint8) for i in range(4)]
with Client(SOCKET, layout=layout) as kv:
    print(kv.store(keys, blocks).stored)
    with kv.load(keys) as got:
        print(len(got.slots), all((v == b).all() for v, b in zip(got.views, blocks)))
"""


@pytest.fixture
def accounts() -> Iterator[tuple[str, str, str]]:
    """(group, member, outsider): a fresh group, a user in it and a user not in it."""
    tag = secrets.token_hex(3)
    group, member, outsider = f"kvtg{tag}", f"kvtm{tag}", f"kvto{tag}"
    made: list[list[str]] = []
    try:
        subprocess.run(["groupadd", group], check=True)
        made.append(["groupdel", group])
        for user, extra in ((member, ["-G", group]), (outsider, [])):
            subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", *extra, user],
                           check=True)
            made.insert(0, ["userdel", user])
        yield group, member, outsider
    finally:
        for cmd in made:
            subprocess.run(cmd, check=False)


def _python_for_others(workdir: Path) -> tuple[list[str], dict[str, str]]:
    """An interpreter and environment another user can run kvtier's client with: this one if
    they can read it, else the system's of the same version; kvtier copied where they can read
    it, the venv's site-packages beside."""
    code = workdir / "code"
    shutil.copytree(ROOT / "kvtier", code / "kvtier",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for d, _, files in os.walk(workdir):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    site = sysconfig.get_paths()["purelib"]
    env = {"PYTHONPATH": f"{code}:{site}", "HOME": str(workdir), "PATH": "/usr/bin:/bin",
           "PYTHONDONTWRITEBYTECODE": "1"}
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for exe in (os.path.realpath(sys.executable), f"/usr/bin/python{version}"):
        try:
            probe = subprocess.run([exe, "-c", "import numpy, grpc, kvtier.client"], env=env,
                                   user="nobody", capture_output=True, timeout=60, check=False)
        except PermissionError:
            continue
        if probe.returncode == 0:
            return [exe], env
    pytest.skip(f"no interpreter with kvtier's dependencies that another user can read ({site})")


def _gid(path: Path) -> int:
    """`path`'s group, or -1 once it is gone (another daemon's segment, removed meanwhile)."""
    try:
        return path.stat().st_gid
    except FileNotFoundError:
        return -1


def test_group_members_share_the_pool_and_others_cannot(accounts: tuple[str, str, str]) -> None:
    group, member, outsider = accounts
    gid = int(subprocess.run(["getent", "group", group], capture_output=True, text=True,
                             check=True).stdout.split(":")[2])
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-group-"))  # not under pytest's 0700 dirs
    try:
        python, env = _python_for_others(workdir)
        daemon = DaemonProc(workdir / "d", ["--group", group])
        os.makedirs(workdir / "d", exist_ok=True)
        os.chmod(workdir / "d", 0o711)
        daemon.start()
        try:
            for sock in (daemon.socket, f"{daemon.socket}.lookup"):  # gRPC's, the lookup socket
                st = os.stat(sock)
                assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid
            run_dir = os.stat(daemon.socket.parent)
            assert stat.S_IMODE(run_dir.st_mode) == 0o750 and run_dir.st_gid == gid
            segments = [p for p in Path("/dev/shm").glob("kvtier-*") if _gid(p) == gid]
            assert len(segments) == 1 and stat.S_IMODE(segments[0].stat().st_mode) == 0o660
            script = CLIENT.replace("SOCKET", repr(str(daemon.socket)))
            ok = subprocess.run([*python, "-c", script], env=env, user=member,
                                extra_groups=[group], capture_output=True, text=True,
                                timeout=120, check=False)
            assert ok.returncode == 0, ok.stderr
            assert ok.stdout.split() == ["4", "4", "True"]  # 4 slots: the mapped segment
            probe = ("import os, socket, sys\n"
                     "s = socket.socket(socket.AF_UNIX)\n"
                     "try: s.connect(sys.argv[1])\nexcept PermissionError: print('socket denied')\n"
                     "try: os.open(sys.argv[2], os.O_RDWR)\n"
                     "except PermissionError: print('segment denied')\n"
                     "s = socket.socket(socket.AF_UNIX)\n"
                     "try: s.connect(sys.argv[3])\n"
                     "except PermissionError: print('lookups denied')\n")
            denied = subprocess.run([*python, "-c", probe, str(daemon.socket), str(segments[0]),
                                     f"{daemon.socket}.lookup"],
                                    env=env, user=outsider, capture_output=True, text=True,
                                    timeout=60, check=False)
            assert denied.stdout.split("\n")[:3] == ["socket denied", "segment denied",
                                                    "lookups denied"], denied
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_group_that_cannot_reach_the_socket_is_refused(tmp_path: Path,
                                                          accounts: tuple[str, str, str]) -> None:
    group = accounts[0]
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier", "serve", "--group", group, "--socket",
         str(private / "kvtier.sock"), "--data-dir", str(tmp_path / "data"), "--ssd-bytes", "0",
         "--dram-bytes", "16MiB", "--metrics", ""],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
        check=False)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].endswith(
        f"group {group!r} cannot enter {private} (mode 0700), so its members could not reach "
        "the socket: put the socket in a directory of the group (e.g. /run/kvtier, "
        "RuntimeDirectoryMode=0750 under systemd)")
    assert not (private / "kvtier.sock").exists()


def test_no_group_keeps_the_socket_private(tmp_path: Path) -> None:
    daemon = DaemonProc(tmp_path / "d").start()
    try:
        assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(f"{daemon.socket}.lookup").st_mode) == 0o600
    finally:
        daemon.stop()
