"""Tenants on the zero-copy path (issue 25): with a tokens file the daemon's DRAM pool has no name
to open, each tenant maps only the memory of its own pages (an fd handed over after its token is
checked), and the daemon is non-dumpable. Two tenants under one uid, a real daemon, real clients
and an attacker process with no more than a same-uid process has (capabilities dropped when the
tests run as root)."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.client.async_client import AsyncClient
from kvtier.client.mapping import fetch_fd
from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.core.segment import FD_MESSAGE_MAX, StaleSegment, fd_request, fd_socket_path
from kvtier.core.types import Tier
from kvtier.tiers.dram import peek_header
from tests.daemon_fixture import DaemonProc, wait_ssd_blocks
from tests.test_dram import _fake_cupy, _FakeRuntime

BLOCK = 65536
ALICE, BOB = "alice-secret-token", "bob-secret-token-2"
TOKENS = (f'[tenants.alice]\ntoken = "{ALICE}"\n\n[tenants.bob]\ntoken = "{BOB}"\n')
LAYOUT = LayoutDecl(fingerprint=b"iso-layout-fp-01", block_bytes=BLOCK, block_tokens=16,
                    model_id="iso-model")
MARK = b"BOB-SECRET-KV-"  # starts every 64-byte line of bob's blocks


def keys(tag: bytes, n: int) -> list[bytes]:
    return [tag + bytes([i]) * (32 - len(tag)) for i in range(n)]


def bob_block(i: int) -> bytes:
    line = MARK + bytes([i]) * (64 - len(MARK))
    return line * (BLOCK // 64)


def alice_block(i: int) -> bytes:
    return bytes([0xA0 + i]) * BLOCK


DROP_CAPS = textwrap.dedent("""
    import ctypes, ctypes.util, os, sys
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if os.geteuid() == 0:  # root: keep uid 0 but no capability, across exec too
        for cap in range(64):
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the last one)
        class Hdr(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
        class Data(ctypes.Structure):
            _fields_ = [("eff", ctypes.c_uint32), ("perm", ctypes.c_uint32),
                        ("inh", ctypes.c_uint32)]
        assert libc.capset(ctypes.byref(Hdr(0x20080522, 0)), (Data * 2)()) == 0
    os.execvp(sys.argv[1], sys.argv[1:])
""")
CAPLESS = [sys.executable, "-c", DROP_CAPS]
"""Runs a command as this user with no capabilities: what a same-uid process has (as root the
kernel would let any capable process read any other's fds, whatever this test checks)."""


def tenants_daemon(tmp: Path, *args: str) -> DaemonProc:
    tokens = tmp / "tokens.toml"
    tokens.write_text(TOKENS)
    return DaemonProc(tmp / "d", ["--tokens-file", str(tokens), *args], launcher=CAPLESS).start()


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, Client, Client]]:
    d = tenants_daemon(tmp_path_factory.mktemp("iso"))
    try:
        with Client(d.socket, layout=LAYOUT, token=ALICE) as a, \
                Client(d.socket, layout=LAYOUT, token=BOB) as b:
            assert b.store(keys(b"bob", 4), [bob_block(i) for i in range(4)]).stored == 4
            assert a.store(keys(b"alice", 4), [alice_block(i) for i in range(4)]).stored == 4
            yield d, a, b
    finally:
        d.stop()


def bob_intact(b: Client) -> bool:
    with b.load(keys(b"bob", 4)) as got:
        return got.blocks == 4 and all(bytes(v) == bob_block(i)
                                       for i, v in enumerate(got.views))


def test_a_tenant_stores_and_loads_zero_copy(two: tuple[DaemonProc, Client, Client]) -> None:
    _, a, _ = two
    assert a.uses_shm
    with a.load(keys(b"alice", 4)) as got:
        assert got.blocks == 4 and [bytes(v) for v in got.views] == [
            alice_block(i) for i in range(4)]
        buf = a.slot_buffer()
        assert buf is not None
        rows = buf.array()
        assert [bytes(rows[s][:BLOCK]) for s in got.slots] == [alice_block(i) for i in range(4)]


def test_there_is_no_file_to_open(two: tuple[DaemonProc, Client, Client]) -> None:
    _, a, _ = two
    buf = a.slot_buffer()
    seg = a._segment
    assert buf is not None and seg is not None and seg.info.by_fd
    assert not os.path.exists(os.path.join("/dev/shm", seg.info.name))
    for name in os.listdir("/dev/shm"):  # nor any other file with this pool's header
        header = peek_header(os.path.join("/dev/shm", name))
        assert header is None or header.generation != buf.generation


def test_its_own_mapping_holds_none_of_the_other_tenants_bytes(
        two: tuple[DaemonProc, Client, Client]) -> None:
    _, a, b = two
    buf = a.slot_buffer()
    assert buf is not None and bob_intact(b)
    whole = buf.segment  # every byte alice's process can reach in its mapping of the pool
    assert whole.size == a._segment.info.size  # type: ignore[union-attr]
    assert bytes(whole).find(MARK) == -1
    # Writing every byte of it (every offset a guess could name) leaves bob's blocks as they were.
    saved = whole.copy()
    whole[buf.data_offset:] = 0x5A
    try:
        assert bob_intact(b)
    finally:
        whole[:] = saved


def test_the_handed_fd_cannot_be_shrunk_or_grown(two: tuple[DaemonProc, Client, Client]) -> None:
    d, a, _ = two
    fd = fetch_fd(fd_socket_path(str(d.socket)), ALICE)
    try:
        size = os.fstat(fd).st_size
        assert size == a._segment.info.size  # type: ignore[union-attr]
        for new in (0, size // 2, size * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, new)
    finally:
        os.close(fd)


def test_a_wrong_token_gets_no_fd(two: tuple[DaemonProc, Client, Client]) -> None:
    d, _, _ = two
    path = fd_socket_path(str(d.socket))
    with pytest.raises(StaleSegment, match="unknown token"):
        fetch_fd(path, "not-anyones-token")
    for request in (fd_request("not-anyones-token"), b"GIVE ME THE POOL\n", b"KVTFD1 \n"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(request)
            line, fds, _, _ = socket.recv_fds(s, FD_MESSAGE_MAX, 4)
        assert fds == [] and b'"error"' in line



def test_silent_clients_on_the_fd_socket_hold_no_one_up(
        two: tuple[DaemonProc, Client, Client]) -> None:
    """Connections that send nothing (or half a request) do not delay another client's attach:
    the fd socket serves connections side by side, each with its own deadline."""
    d, _, _ = two
    path = fd_socket_path(str(d.socket))
    idle = []
    try:
        for request in (b"", b"KVTFD1 half-a-tok") * 8:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            s.sendall(request)
            idle.append(s)
        fd = fetch_fd(path, ALICE)
        os.close(fd)
        # served while the silent ones are still held, each until its 2 s deadline: none of
        # them is closed yet (a daemon that served them one by one answered only after they
        # were; a wall-time bound here failed when a loaded machine was slow)
        ready, _, _ = select.select(idle, [], [], 0)
        assert ready == []
    finally:
        for s in idle:
            s.close()


def test_many_fd_requests_leave_the_daemon_no_more_fds(
        two: tuple[DaemonProc, Client, Client]) -> None:
    """Review: fds handed out, refused requests, clients that send fds of their own, hang up
    half-way or never read the reply — the daemon's own descriptors come back to where they
    were (each handed fd is the tenant's file, sent, never a dup the daemon keeps)."""
    d, _, _ = two
    assert d.proc is not None
    fds = Path(f"/proc/{d.proc.pid}/fd")
    try:
        before = len(os.listdir(fds))
    except PermissionError:
        pytest.skip("the daemon is non-dumpable and this process may not read its fds")
    path = fd_socket_path(str(d.socket))
    for _ in range(100):
        os.close(fetch_fd(path, ALICE))
    unread = []
    for i in range(100):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        if i % 3 == 0:  # a request that comes with fds of the client's own
            r, w = os.pipe()
            socket.send_fds(s, [fd_request(BOB)], [r, w])
            os.close(r)
            os.close(w)
        elif i % 3 == 1:
            s.sendall(b"KVTFD1 not-a-token\n")
        else:
            s.sendall(fd_request(BOB)[:5])  # hangs up half-way
            s.close()
            continue
        unread.append(s)  # its reply (and fd) never read
    deadline = time.monotonic() + 10
    while len(os.listdir(fds)) > before:
        assert time.monotonic() < deadline, f"{len(os.listdir(fds))} fds, {before} before"
        time.sleep(0.05)
    for s in unread:
        s.close()
    assert len(os.listdir(fds)) <= before


def test_a_file_at_the_fd_socket_path_is_refused_and_kept(tmp_path: Path) -> None:
    """The fd socket's path is claimed as the gRPC socket's: a user's file there is never
    removed; the daemon refuses to start with one line naming it."""
    d = DaemonProc(tmp_path / "d", ["--tokens-file", str(tmp_path / "tokens.toml")],
                   launcher=CAPLESS)
    (tmp_path / "tokens.toml").write_text(TOKENS)
    squatter = Path(fd_socket_path(str(d.socket)))
    squatter.parent.mkdir(parents=True, exist_ok=True)
    squatter.write_text("a user's notes\n")
    with pytest.raises(RuntimeError, match="not a socket"):
        d.start()
    assert squatter.read_text() == "a user's notes\n"


ATTACKER = textwrap.dedent("""
    import ctypes, ctypes.util, errno, json, os, sys
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    daemon, control = int(sys.argv[1]), int(sys.argv[2])
    out = {}
    def attempt(name, fn):
        try:
            fn()
            out[name] = "ok"
        except OSError as exc:
            out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
    def open_fds(pid):
        for n in os.listdir(f"/proc/{pid}/fd"):
            os.close(os.open(f"/proc/{pid}/fd/{n}", os.O_RDONLY))
    def read(path):
        with open(path, "rb") as f:
            f.read(1)
    def ptrace(pid):
        libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        if libc.ptrace(16, pid, None, None) != 0:  # PTRACE_ATTACH
            raise OSError(ctypes.get_errno(), "ptrace")
        os.waitpid(pid, 0)
        libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
    for who, pid in (("daemon", daemon), ("control", control)):
        attempt(who + " fds", lambda: open_fds(pid))
        attempt(who + " maps", lambda: read(f"/proc/{pid}/maps"))
        attempt(who + " mem", lambda: read(f"/proc/{pid}/mem"))
        attempt(who + " ptrace", lambda: ptrace(pid))
    print(json.dumps(out))
""")


def test_a_same_uid_process_cannot_take_the_daemons_fds(
        two: tuple[DaemonProc, Client, Client]) -> None:
    d, _, b = two
    assert d.proc is not None
    control = subprocess.Popen([*CAPLESS, "sleep", "60"])  # dumpable, same user, no caps
    try:
        # until it has dropped its capabilities and exec'd, the probe may not read it either
        deadline = time.monotonic() + 120  # a hang check: the VM stalls for up to minutes
        while Path(f"/proc/{control.pid}/comm").read_text().strip() != "sleep":
            assert time.monotonic() < deadline, "the control process never exec'd sleep"
            time.sleep(0.01)
        run = subprocess.run([*CAPLESS, sys.executable, "-c", ATTACKER, str(d.proc.pid),
                              str(control.pid)],
                             capture_output=True, text=True, timeout=30)
    finally:
        control.kill()
        control.wait()
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["control fds"] == "ok" and got["control maps"] == "ok"  # the probe can do it...
    for what in ("fds", "maps", "mem"):  # ...except to the daemon
        assert got[f"daemon {what}"] in ("EACCES", "EPERM"), got
    if got["control ptrace"] == "ok":  # ptrace allowed here (no seccomp or Yama rule against)
        assert got["daemon ptrace"] == "EPERM", got
    assert bob_intact(b)


def test_register_cuda_on_the_tenant_mapping(two: tuple[DaemonProc, Client, Client],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _, a, _ = two
    rt = _FakeRuntime()
    _fake_cupy(monkeypatch, rt)
    buf = a.slot_buffer()
    assert buf is not None and a.register_cuda()
    assert rt.registered == {buf.segment.ctypes.data: (buf.segment.size, 3)}


def test_restart_reattaches_to_the_new_pool(tmp_path: Path) -> None:
    d = tenants_daemon(tmp_path)
    try:
        with Client(d.socket, layout=LAYOUT, token=ALICE, lease_ttl_s=5) as a:
            assert a.store(keys(b"alice", 2), [alice_block(i) for i in range(2)]).stored == 2
            old = a.slot_buffer()
            assert old is not None
            d.stop()
            d.start()
            assert a.store(keys(b"again", 2), [alice_block(i) for i in range(2)]).stored == 2
            new = a.slot_buffer()
            assert a.uses_shm and new is not None and new.generation != old.generation
            with a.load(keys(b"again", 2)) as got:
                assert [bytes(v) for v in got.views] == [alice_block(0), alice_block(1)]
    finally:
        d.stop()
    assert not Path(fd_socket_path(str(d.socket))).exists()


def test_single_tenant_keeps_the_named_segment(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d").start()
    try:
        with Client(d.socket, layout=LAYOUT) as kv:
            assert kv.store(keys(b"one", 2), [alice_block(i) for i in range(2)]).stored == 2
            seg = kv._segment
            assert kv.uses_shm and seg is not None and not seg.info.by_fd
            header = peek_header(os.path.join(seg.info.shm_dir, seg.info.name))
            assert header is not None and header.generation == seg.info.generation
        assert not Path(fd_socket_path(str(d.socket))).exists()
    finally:
        d.stop()


def test_store_and_load_views_are_the_tenants_blocks(
        two: tuple[DaemonProc, Client, Client]) -> None:
    _, a, b = two
    with a.load(keys(b"bob", 4)) as got:  # bob's keys are not alice's blocks
        assert got.blocks == 0
    with b.load(keys(b"bob", 4)) as got:
        assert np.array_equal(got.views[0], np.frombuffer(bob_block(0), np.uint8))


def test_the_async_client_maps_its_tenants_memory(two: tuple[DaemonProc, Client, Client]) -> None:
    d, _, b = two

    async def main() -> None:
        async with await AsyncClient.connect(d.socket, layout=LAYOUT, token=BOB) as kv:
            data = [bob_block(7), bob_block(8)]
            assert (await kv.store(keys(b"bob-async", 2), data)).stored == 2
            assert kv.uses_shm and kv._segment is not None and kv._segment.info.by_fd
            async with kv.load(keys(b"bob", 4)) as got:  # the sync client's blocks, same tenant
                assert got.blocks == 4 and bytes(got.views[3]) == bob_block(3)

    asyncio.run(main())
    assert bob_intact(b)


def test_a_block_size_equal_to_another_tenants_class_id_gets_a_slot_it_fits(
        tmp_path: Path) -> None:
    """A tenant's class id is its stride plus a tag (bob's first class: 65,536 + 1). A block
    size equal to that id must still be read as a size: alice's 65,537-byte blocks get slots of
    at least 65,537 bytes, not 65,536-byte ones where each block's last byte is the next one's
    first (found by review; before, alice's blocks came back corrupted, or her streamed ones
    failed with INTERNAL, depending on whether bob had stored first)."""
    d = tenants_daemon(tmp_path)
    odd = LayoutDecl(fingerprint=b"iso-layout-odd01", block_bytes=BLOCK + 1, block_tokens=16,
                     model_id="iso-model")
    blocks = [bytes([0xA0 + i]) * BLOCK + bytes([0x10 + i]) for i in range(3)]
    try:
        with Client(d.socket, layout=LAYOUT, token=BOB) as b:  # bob's tag: 1
            assert b.store(keys(b"bob", 4), [bob_block(i) for i in range(4)]).stored == 4
            for streaming in (False, True):
                tag = b"alice-s" if streaming else b"alice-z"
                with Client(d.socket, layout=odd, token=ALICE, streaming=streaming) as a:
                    assert a.store(keys(tag, 3), blocks).stored == 3
                    with a.load(keys(tag, 3)) as got:
                        assert got.blocks == 3
                        assert [bytes(v) for v in got.views] == blocks
            assert bob_intact(b)
    finally:
        d.stop()


def test_an_fd_fetched_before_a_token_rotation_sees_none_of_the_blocks_stored_after(
        tmp_path: Path) -> None:
    d = tenants_daemon(tmp_path)
    tokens = tmp_path / "tokens.toml"
    new = "alice-rotated-token-3"
    try:
        assert d.proc is not None
        with Client(d.socket, layout=LAYOUT, token=ALICE) as a:
            assert a.store(keys(b"before", 1), [alice_block(0)]).stored == 1
        old = fetch_fd(fd_socket_path(str(d.socket)), ALICE)  # what a leaked token got
        leaked = mmap.mmap(old, os.fstat(old).st_size)
        os.close(old)
        tokens.write_text(TOKENS.replace(ALICE, new))
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "tenants changed: alice" not in d.log():
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.02)
        secret = b"ALICE-AFTER-ROTATION" * (BLOCK // 20) + b"\0" * (BLOCK % 20)
        with Client(d.socket, layout=LAYOUT, token=new) as a:
            assert a.store(keys(b"after", 1), [secret]).stored == 1
            assert bytes(leaked).find(b"ALICE-AFTER-ROTATION") == -1
        leaked.close()
    finally:
        d.stop()


def _reload(d: DaemonProc, tokens: str, line: str) -> None:
    assert d.proc is not None
    (d.workdir.parent / "tokens.toml").write_text(tokens)
    seen = d.log().count(line)
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while d.log().count(line) == seen:
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.02)


def _leaked(d: DaemonProc, token: str) -> mmap.mmap:
    fd = fetch_fd(fd_socket_path(str(d.socket)), token)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


SECRET = b"ALICE-AFTER-REKEYING" * (BLOCK // 20) + b"\0" * (BLOCK % 20)


def _new_token_works_zero_copy(d: DaemonProc, token: str, old_generation: int) -> None:
    """A client with the new token stores and loads zero-copy in its tenant's fresh file."""
    with Client(d.socket, layout=LAYOUT, token=token) as c:
        assert c.store(keys(b"after", 2), [SECRET, SECRET]).stored == 2
        assert c.uses_shm
        with c.load(keys(b"after", 2)) as got:
            assert got.blocks == 2 and [bytes(v) for v in got.views] == [SECRET, SECRET]
            buf = c.slot_buffer()
            assert buf is not None and buf.generation != old_generation
            rows = buf.array()
            assert [bytes(rows[s][:BLOCK]) for s in got.slots] == [SECRET, SECRET]


def test_a_rotated_token_gets_a_fresh_file_and_its_blocks_leave_the_old_one(
        tmp_path: Path) -> None:
    """A SIGHUP that changes alice's token: her old file is closed to new blocks (an fd fetched
    before sees none stored after, its header says closed), a client with the new token maps
    a fresh file (another generation) and stores and loads zero-copy; a block leased at the
    rotation is not served from the old file and leaves DRAM at its release, to come back
    from SSD into the new file."""
    d = tenants_daemon(tmp_path, "--ssd-admit-after", "1")  # SSD copies from the commit
    new = "alice-rotated-token-4"
    try:
        with Client(d.socket, layout=LAYOUT, token=ALICE) as a:
            assert a.store(keys(b"before", 1), [alice_block(0)]).stored == 1
            assert a.store(keys(b"pinned", 1), [alice_block(1)]).stored == 1
            lease = a.acquire(keys(b"pinned", 1))  # held across the rotation (a stays open)
            assert lease.blocks == 1
            buf = a.slot_buffer()
            assert buf is not None
            old_generation = buf.generation
            leaked = _leaked(d, ALICE)
            _reload(d, TOKENS.replace(ALICE, new), "tenants changed: alice")
            assert leaked[12] == 2  # the old file's header state: closed (STATE_CLOSED)
            _new_token_works_zero_copy(d, new, old_generation)
            assert leaked.find(b"ALICE-AFTER-REKEYING") == -1
            with Client(d.socket, layout=LAYOUT, token=new) as c:
                with c.load(keys(b"pinned", 1)) as got:  # leased in the old file: not served
                    assert got.blocks == 0
                c.release(lease.lease_id)  # the same tenant: its new token ends the old lease
                assert wait_ssd_blocks(c, 4) == 4  # before, pinned, after x2
                for tag, block in ((b"before", alice_block(0)), (b"pinned", alice_block(1))):
                    with c.load(keys(tag, 1)) as got:  # from SSD, into the new file
                        assert got.blocks == 1 and bytes(got.views[0]) == block
                        assert got.tiers == [Tier.SSD]
        with pytest.raises(StaleSegment, match="unknown token"):
            fetch_fd(fd_socket_path(str(d.socket)), ALICE)
        assert leaked.find(b"ALICE-AFTER-REKEYING") == -1
        leaked.close()
    finally:
        d.stop()


def test_a_revoked_tenant_that_comes_back_gets_a_fresh_file(tmp_path: Path) -> None:
    """Alice removed from the tokens file (SIGHUP), then back with another token: an fd her
    old token fetched sees none of the blocks she stores after; bob is untouched."""
    d = tenants_daemon(tmp_path)
    try:
        with Client(d.socket, layout=LAYOUT, token=ALICE) as a, \
                Client(d.socket, layout=LAYOUT, token=BOB) as b:
            assert a.store(keys(b"before", 1), [alice_block(0)]).stored == 1
            assert b.store(keys(b"bob", 4), [bob_block(i) for i in range(4)]).stored == 4
            buf = a.slot_buffer()
            assert buf is not None
            old_generation = buf.generation
            leaked = _leaked(d, ALICE)
            _reload(d, f'[tenants.bob]\ntoken = "{BOB}"\n', "tenants revoked: alice")
            assert leaked[12] == 2
            with pytest.raises(StaleSegment, match="unknown token"):
                fetch_fd(fd_socket_path(str(d.socket)), ALICE)
            back = "alice-is-back-token-5"
            _reload(d, TOKENS.replace(ALICE, back), "tenants added: alice")
            _new_token_works_zero_copy(d, back, old_generation)
            assert leaked.find(b"ALICE-AFTER-REKEYING") == -1
            assert bob_intact(b)
        leaked.close()
    finally:
        d.stop()


def _many_tenants(n: int) -> str:
    return "".join(f'[tenants.t{i:03d}]\ntoken = "token-of-tenant-{i:03d}"\n\n' for i in range(n))


def test_more_tenants_than_the_isolated_pool_serves_are_refused_at_start_and_reload(
        tmp_path: Path) -> None:
    """An isolated pool tags each tenant's classes with 1..255 (below the 256 B stride unit).
    Before (found by review), a tokens file of 256 tenants started, and the 256th tenant to
    store got an internal error on every store; now the start is refused with one line (exit
    2), and so is a reload to 256 (the running tenants kept), counting a tenant that stored and
    left the file, and a fresh tag for a token that changed."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(_many_tenants(256))
    d = DaemonProc(tmp_path / "d", ["--tokens-file", str(tokens)], launcher=CAPLESS)
    with pytest.raises(RuntimeError, match="daemon exited 2") as exc:
        d.start()
    assert "256 tenants, more than the 255 an isolated DRAM pool serves" in str(exc.value)
    tokens.write_text(_many_tenants(255))
    d.start()
    try:
        assert d.proc is not None
        with Client(d.socket, layout=LAYOUT, token="token-of-tenant-254") as kv:
            assert kv.store(keys(b"t254", 1), [alice_block(0)]).stored == 1
        tokens.write_text(_many_tenants(256))
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reload (SIGHUP) refused" not in d.log():
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.02)
        assert "256 tenants, more than the 255" in d.log()
        with Client(d.socket, layout=LAYOUT, token="token-of-tenant-254") as kv, \
                kv.load(keys(b"t254", 1)) as got:
            assert got.blocks == 1
        # 255 in the file, but t254 (dropped from it) has a tag its blocks keep: 256 in all
        tokens.write_text(_many_tenants(254) + '[tenants.newcomer]\ntoken = "token-new"\n')
        d.proc.send_signal(signal.SIGHUP)
        while "with the tenants that stored since the start" not in d.log():
            assert time.monotonic() < deadline + 10, d.log()
            time.sleep(0.02)
        assert "256 tenants, more than the 255" in d.log().rsplit("reload (SIGHUP) refused")[-1]
        with Client(d.socket, layout=LAYOUT, token="token-of-tenant-254") as kv:
            assert kv.lookup(keys(b"t254", 1)).hit_blocks == 1  # the running tenants kept
        # the same 255 tenants, t254's token changed: a fresh tag for it, 256 in all
        tokens.write_text(_many_tenants(255).replace("token-of-tenant-254", "t254-rotated"))
        seen = d.log().count("reload (SIGHUP) refused")
        d.proc.send_signal(signal.SIGHUP)
        while d.log().count("reload (SIGHUP) refused") == seen:
            assert time.monotonic() < deadline + 20, d.log()
            time.sleep(0.02)
        assert "256 tenants, more than the 255" in d.log().rsplit("reload (SIGHUP) refused")[-1]
        with Client(d.socket, layout=LAYOUT, token="token-of-tenant-254") as kv, \
                kv.load(keys(b"t254", 1)) as got:  # its token, file and block as they were
            assert got.blocks == 1 and bytes(got.views[0]) == alice_block(0) and kv.uses_shm
    finally:
        d.stop()
