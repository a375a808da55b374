"""Daemon conventions on a real `kvtier serve` process: the socket path never costs a user a
file, bad socket paths are one line and exit 2, every stop signal cleans up (socket and shared
memory), SIGHUP reloads what can change live, readiness over sd_notify and HTTP, and the log is
in timestamp order."""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvtier._version import __version__
from kvtier.client.sync_client import Client, KvtierRpcError, LayoutDecl
from kvtier.core.paths import SOCKET_PATH_MAX
from kvtier.core.types import Tier
from kvtier.tiers import segment_owner
from tests.daemon_fixture import ROOT, DaemonProc, wait_for

BLOCK = 65536
LAYOUT = LayoutDecl(fingerprint=b"conventions-fp", block_bytes=BLOCK, block_tokens=16,
                    model_id="conventions-model@1")


def serve(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`kvtier serve ARGS` expected to fail at start."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVTIER_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "kvtier", "serve", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def refused_args(tmp: Path, sock: str) -> list[str]:
    return ["--socket", sock, "--data-dir", str(tmp / "data"), "--dram-bytes", "16MiB",
            "--slot-bytes", "64KiB", "--ssd-bytes", "64MiB", "--metrics", ""]


def one_line_exit_2(run: subprocess.CompletedProcess[str]) -> str:
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier serve: error: "), run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    return lines[0]


def keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) + bytes(30) for i in range(n)]


def blocks(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(n)]


# ---- the socket path ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "dir", "symlink"])
def test_socket_path_that_is_not_a_socket_is_refused_and_kept(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "notes.txt"
    if kind == "file":
        target.write_text("my notes\n")
    elif kind == "dir":
        target.mkdir()
    else:
        (tmp_path / "real.txt").write_text("my notes\n")
        target.symlink_to(tmp_path / "real.txt")
    line = one_line_exit_2(serve(*refused_args(tmp_path, str(target))))
    assert "not a socket" in line and str(target) in line
    if kind == "file":
        assert target.read_text() == "my notes\n"
    elif kind == "dir":
        assert target.is_dir()
    else:
        assert target.is_symlink() and (tmp_path / "real.txt").read_text() == "my notes\n"
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").glob("ssd*"))


def test_stale_socket_is_removed_and_logged(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d")
    d.socket.parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(d.socket))  # bound, never listening: a dead daemon's leftover
    stale.close()
    d.start()
    try:
        assert f"removed stale socket {d.socket} (nothing listened on it)" in d.log()
    finally:
        assert d.stop() == 0


def test_socket_under_proc_is_one_line(tmp_path: Path) -> None:
    line = one_line_exit_2(serve(*refused_args(tmp_path, "/proc/kvtier-test.sock")))
    assert "/proc/kvtier-test.sock" in line


def test_socket_directory_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("not a directory\n")
    line = one_line_exit_2(serve(*refused_args(tmp_path, str(tmp_path / "run" / "kvtier.sock"))))
    assert "cannot create its directory" in line
    assert (tmp_path / "run").read_text() == "not a directory\n"


def test_live_socket_is_refused(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d").start()
    try:
        line = one_line_exit_2(serve(*refused_args(tmp_path, str(d.socket))))
        assert f"another daemon is listening on {d.socket}" in line
        assert d.healthy()
    finally:
        assert d.stop() == 0


def test_socket_path_over_the_limit_names_the_limit(tmp_path: Path) -> None:
    long = tmp_path / ("s" * (SOCKET_PATH_MAX + 1 - len(str(tmp_path)))) / "kvtier.sock"
    line = one_line_exit_2(serve(*refused_args(tmp_path, str(long))))
    assert f"limited to {SOCKET_PATH_MAX} bytes" in line
    assert not long.parent.exists()


# ---- signals --------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGQUIT])
def test_stop_signals_leave_no_socket_and_no_segment(tmp_path: Path, sig: signal.Signals) -> None:
    d = DaemonProc(tmp_path / "d").start()
    assert d.proc is not None
    record = segment_owner.read_record(segment_owner.record_path(d.socket))
    assert record is not None and Path(record.path).exists()
    d.proc.send_signal(sig)
    assert d.proc.wait(30) == 0, d.log()
    assert not d.socket.exists()
    assert not Path(record.path).exists(), "shared-memory segment left behind"
    assert not segment_owner.record_path(d.socket).exists()
    assert f"{sig.name} received" in d.log() and "kvtier stopped" in d.log()


def test_sighup_does_not_kill_the_daemon(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d").start()
    try:
        assert d.proc is not None
        with Client(d.socket, layout=LAYOUT) as kv:
            kv.store(keys(1, 2), blocks(2, 1))
            d.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: "reloaded (SIGHUP)" in d.log())
            assert d.healthy()
            assert kv.lookup(keys(1, 2)).hit_blocks == 2
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2])
def test_usr_signals_are_logged_and_ignored(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGUSR1/2 would end the process by default, leaving the socket and the segment; kvtier
    gives them no job: one WARNING, the daemon keeps serving, and a later stop cleans up."""
    d = DaemonProc(tmp_path / "d").start()
    assert d.proc is not None
    record = segment_owner.read_record(segment_owner.record_path(d.socket))
    assert record is not None
    try:
        with Client(d.socket, layout=LAYOUT) as kv:
            kv.store(keys(4, 2), blocks(2, 4))
            d.proc.send_signal(sig)
            wait_for(lambda: f"{sig.name} ignored" in d.log())
            assert d.healthy()
            assert kv.lookup(keys(4, 2)).hit_blocks == 2
        line = next(ln for ln in d.log().splitlines() if f"{sig.name} ignored" in ln)
        assert "WARNING" in line and "SIGHUP" in line and "SIGTERM" in line
    finally:
        assert d.stop() == 0, d.log()
    assert not d.socket.exists()
    assert not Path(record.path).exists(), "shared-memory segment left behind"
    assert not segment_owner.record_path(d.socket).exists()


# ---- SIGHUP reload --------------------------------------------------------------------------


def tokens_toml(quota: str = "", **tenants: str) -> str:
    """A tokens file; `quota` (a size) is the first tenant's dram_quota."""
    return "".join(f'[tenants.{name}]\ntoken = "{token}"\n'
                   + (f'dram_quota = "{quota}"\n' if quota and i == 0 else "") + "\n"
                   for i, (name, token) in enumerate(tenants.items()))


def test_sighup_reloads_tenants_and_keeps_dram(tmp_path: Path) -> None:
    """alice's quota leaves half the pool to tenants added later: adding bob takes nothing
    from her (her blocks stay in DRAM); revoking her ends her calls."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(tokens_toml("8MiB", alice="alice-token-1"))
    d = DaemonProc(tmp_path / "d", ["--tokens-file", str(tokens)]).start()
    try:
        assert d.proc is not None
        data = blocks(3, 7)
        with Client(d.socket, layout=LAYOUT, token="alice-token-1") as kv:
            kv.store(keys(5, 3), data)
        with pytest.raises(KvtierRpcError, match="UNAUTHENTICATED"), \
                Client(d.socket, layout=LAYOUT, token="bob-token-22") as kv:
            kv.lookup(keys(5, 3))

        tokens.write_text(tokens_toml("8MiB", alice="alice-token-1", bob="bob-token-22"))
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "tenants added: bob" in d.log())
        assert "slice changed" not in d.log()
        with Client(d.socket, layout=LAYOUT, token="bob-token-22") as kv:
            kv.store(keys(6, 1), blocks(1, 8))
            assert kv.lookup(keys(6, 1)).hit_blocks == 1
        with Client(d.socket, layout=LAYOUT, token="alice-token-1") as kv:
            got = kv.lookup(keys(5, 3))
            assert got.hit_blocks == 3 and {t.name for t in got.tiers} == {"DRAM"}
            with kv.load(keys(5, 3)) as loaded:
                assert [bytes(v) for v in loaded.views] == data

        tokens.write_text(tokens_toml(bob="bob-token-22"))
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "tenants revoked: alice" in d.log())
        with pytest.raises(KvtierRpcError, match="UNAUTHENTICATED"), \
                Client(d.socket, layout=LAYOUT, token="alice-token-1") as kv:
            kv.lookup(keys(5, 3))
        with Client(d.socket, layout=LAYOUT, token="bob-token-22") as kv:
            assert kv.lookup(keys(6, 1)).hit_blocks == 1
    finally:
        assert d.stop() == 0


def test_sighup_adding_a_tokens_file_changes_no_authentication(tmp_path: Path) -> None:
    """Tenants on is restart-only: the reload names it and the daemon keeps serving as it was
    started (one shared segment, no tokens asked), never half-switched to enforcing tokens."""
    conf = tmp_path / "kvtier.toml"
    conf.write_text('log_level = "info"\n')
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(tokens_toml(alice="alice-token-1"))
    d = DaemonProc(tmp_path / "d", ["--config", str(conf)]).start()
    try:
        assert d.proc is not None
        with Client(d.socket, layout=LAYOUT) as kv:
            kv.store(keys(11, 2), blocks(2, 11))
        conf.write_text(f'log_level = "info"\ntokens_file = "{tokens}"\n')
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "cannot change while serving" in d.log())
        kept = next(ln for ln in d.log().splitlines() if "cannot change while serving" in ln)
        assert "tokens_file" in kept
        with Client(d.socket, layout=LAYOUT) as kv:  # still open: no token asked
            assert kv.lookup(keys(11, 2)).hit_blocks == 2
            kv.store(keys(12, 1), blocks(1, 12))
            assert kv.lookup(keys(12, 1)).hit_blocks == 1
    finally:
        assert d.stop() == 0, d.log()


def test_sighup_removing_the_tokens_file_keeps_enforcing_tokens(tmp_path: Path) -> None:
    """The other direction: a tokens file dropped from the config leaves the daemon refusing
    clients without a token until it restarts."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(tokens_toml(alice="alice-token-1"))
    conf = tmp_path / "kvtier.toml"
    conf.write_text(f'log_level = "info"\ntokens_file = "{tokens}"\n')
    d = DaemonProc(tmp_path / "d", ["--config", str(conf)]).start()
    try:
        assert d.proc is not None
        data = blocks(2, 13)
        with Client(d.socket, layout=LAYOUT, token="alice-token-1") as kv:
            kv.store(keys(13, 2), data)
        conf.write_text('log_level = "info"\n')
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "cannot change while serving" in d.log())
        with pytest.raises(KvtierRpcError, match="UNAUTHENTICATED"), \
                Client(d.socket, layout=LAYOUT) as kv:
            kv.lookup(keys(13, 2))
        with Client(d.socket, layout=LAYOUT, token="alice-token-1") as kv, \
                kv.load(keys(13, 2)) as loaded:
            assert [bytes(v) for v in loaded.views] == data
    finally:
        assert d.stop() == 0, d.log()


def test_sighup_adding_a_tenant_to_a_full_pool_divides_it_again(tmp_path: Path) -> None:
    """alice holds the whole pool (no quota): a tenant added takes half of it; her region
    moves (one WARNING names her), her blocks leave DRAM and come back from SSD, bob stores."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(tokens_toml(alice="alice-token-1"))
    d = DaemonProc(tmp_path / "d", ["--tokens-file", str(tokens), "--ssd-admit-after",
                                    "1"]).start()
    try:
        assert d.proc is not None
        data = blocks(3, 7)
        with Client(d.socket, layout=LAYOUT, token="alice-token-1") as kv:
            kv.store(keys(5, 3), data)
            wait_for(lambda: kv.stats().tiers[1].blocks == 3)  # on SSD too
        tokens.write_text(tokens_toml(alice="alice-token-1", bob="bob-token-22"))
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "tenants added: bob" in d.log())
        warned = [ln for ln in d.log().splitlines() if "slice changed" in ln]
        assert len(warned) == 1 and "WARNING" in warned[0] and "alice" in warned[0]
        with Client(d.socket, layout=LAYOUT, token="alice-token-1") as kv, \
                kv.load(keys(5, 3)) as loaded:
            assert [bytes(v) for v in loaded.views] == data
            assert set(loaded.tiers) == {Tier.SSD}
        with Client(d.socket, layout=LAYOUT, token="bob-token-22") as kv:
            kv.store(keys(6, 1), blocks(1, 8))
            assert kv.lookup(keys(6, 1)).hit_blocks == 1
    finally:
        assert d.stop() == 0, d.log()


def test_sighup_bad_tokens_file_changes_nothing(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(tokens_toml(alice="alice-token-1"))
    d = DaemonProc(tmp_path / "d", ["--tokens-file", str(tokens)]).start()
    try:
        assert d.proc is not None
        tokens.write_text("[tenants.alice]\ntoken = 'short'\n")
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload (SIGHUP) refused, nothing changed" in d.log())
        with Client(d.socket, layout=LAYOUT, token="alice-token-1") as kv:
            assert kv.lookup(keys(5, 1)).hit_blocks == 0
    finally:
        assert d.stop() == 0


def test_sighup_applies_live_settings_and_names_the_rest(tmp_path: Path) -> None:
    conf = tmp_path / "kvtier.toml"
    conf.write_text('log_level = "info"\nssd_write_bytes_per_day = "1GiB"\n'
                    "max_blocks_per_request = 4096\n")
    d = DaemonProc(tmp_path / "d", ["--config", str(conf)]).start()
    try:
        assert d.proc is not None
        assert "DEBUG" not in d.log()
        conf.write_text('log_level = "debug"\nssd_write_bytes_per_day = "2GiB"\n'
                        "max_blocks_per_request = 100\n")
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "cannot change while serving" in d.log())
        log = d.log()
        reloaded = next(ln for ln in log.splitlines() if "reloaded (SIGHUP)" in ln)
        assert "log_level 'info' -> 'debug'" in reloaded
        assert "ssd_write_bytes_per_day 1 GiB -> 2 GiB" in reloaded
        kept = next(ln for ln in log.splitlines() if "cannot change while serving" in ln)
        assert "max_blocks_per_request" in kept and "WARNING" in kept
        budget = d.metrics_text()
        rate = float(re.search(r"^kvtier_ssd_write_budget_bytes_per_second (\S+)$", budget,
                               re.M)[1])  # type: ignore[index]
        assert rate == pytest.approx(2 * 2**30 / 86400)
        with Client(d.socket, layout=LAYOUT) as kv:  # the running limit is kept
            kv.store(keys(9, 200), blocks(200, 9)[:200])
        wait_for(lambda: " DEBUG " in d.log())
    finally:
        assert d.stop() == 0


# ---- readiness ------------------------------------------------------------------------------


def http(d: DaemonProc, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_http_probes_and_404(tmp_path: Path) -> None:
    # a grace period longer than the probes below take on a loaded machine (with the fixture's
    # 2 s, the daemon could end the lease and exit before /readyz was asked)
    d = DaemonProc(tmp_path / "d", ["--grace-s", "30"]).start()
    try:
        assert http(d, "/healthz") == (200, "ok\n")
        assert http(d, "/readyz") == (200, "ready\n")
        code, body = http(d, "/metrics")
        assert code == 200 and "kvtier_build_info" in body
        code, body = http(d, "/")
        assert code == 404 and "kvtier_build_info" not in body
        assert http(d, "/metricsx")[0] == 404
        with Client(d.socket, layout=LAYOUT) as kv:
            kv.store(keys(3, 1), blocks(1, 3))
            with kv.load(keys(3, 1)):  # a lease: the drain waits for it (grace 30 s)
                assert d.proc is not None
                d.proc.send_signal(signal.SIGTERM)
                wait_for(lambda: "draining" in d.log())
                code, body = http(d, "/readyz")
                assert code == 503 and "draining" in body
                assert http(d, "/healthz")[0] == 200
        assert d.proc.wait(30) == 0
    finally:
        d.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_readyz_is_503_while_starting(tmp_path: Path) -> None:
    """The metrics endpoint answers from before the tiers open. The data dir's calibration file
    is a FIFO here, so opening the tiers blocks on reading it, as a start does on a data dir on
    a stalled network mount: no test hook, the real start path, held for as long as the test
    likes. /readyz says 503 "starting" all that time and 200 once the file arrives and the daemon
    serves; /healthz is 200 throughout."""
    port = free_port()
    d = DaemonProc(tmp_path / "d", ["--metrics", f"127.0.0.1:{port}"])
    d.data_dir.mkdir(parents=True)
    fifo = d.data_dir / "calibration.json"
    os.mkfifo(fifo)
    d.metrics_port = port
    log = open(d.log_path, "ab")  # noqa: SIM115 (owned by the child)
    d.proc = subprocess.Popen([sys.executable, "-m", "kvtier", "serve", *d.args], stdout=log,
                              stderr=subprocess.STDOUT, env=d.env, cwd=d.workdir)
    log.close()
    try:
        def answered() -> bool:
            assert d.proc is not None and d.proc.poll() is None, d.log()
            try:
                return http(d, "/healthz")[0] == 200
            except OSError:
                return False

        wait_for(answered, timeout=30)
        for _ in range(3):  # and it stays so: the start is held on the FIFO
            code, body = http(d, "/readyz")
            assert (code, body) == (503, "not ready: starting: the storage tiers are not open "
                                         "yet\n")
            assert not d.socket.exists()
            time.sleep(0.2)
        with open(fifo, "w") as w:  # the file arrives: a valid, empty calibration
            w.write('{"version": 1, "links": {}}')
        wait_for(lambda: http(d, "/readyz") == (200, "ready\n"), timeout=30)
        assert d.healthy()
    finally:
        try:  # a start still held on the FIFO is let go, so the stop below drains and cleans up
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            pass  # no reader any more: the daemon read it
        else:
            os.write(fd, b'{"version": 1, "links": {}}')
            os.close(fd)
        d.stop()
        fifo.unlink()


def test_sd_notify_ready_reloading_stopping(tmp_path: Path) -> None:
    addr = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(addr))
    listener.settimeout(30)
    d = DaemonProc(tmp_path / "d", env={"NOTIFY_SOCKET": str(addr)})
    try:
        d.start()
        assert d.proc is not None
        ready = listener.recv(4096).decode()
        assert ready.splitlines()[0] == "READY=1"
        assert d.healthy()
        d.proc.send_signal(signal.SIGHUP)
        assert listener.recv(4096) == b"RELOADING=1"
        assert listener.recv(4096) == b"READY=1"
        d.proc.send_signal(signal.SIGTERM)
        assert listener.recv(4096) == b"STOPPING=1"
    finally:
        listener.close()
        if d.proc is not None:
            d.stop()


# ---- the log --------------------------------------------------------------------------------


def test_log_is_in_timestamp_order(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d")
    d.socket.parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(d.socket))  # a held line (the stale socket removed) follows the first line
    stale.close()
    d.start()
    assert d.stop() == 0
    lines = d.log().splitlines()
    assert lines[0].split(": ", 1)[1].startswith(f"kvtier {__version__} serving on")
    assert any("removed stale socket" in ln for ln in lines[1:])
    stamps = [datetime.datetime.strptime(ln[:23], "%Y-%m-%d %H:%M:%S,%f") for ln in lines
              if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", ln)]
    assert len(stamps) >= 3 and stamps == sorted(stamps), lines


def test_systemd_unit_waits_for_ready_and_reloads_with_sighup() -> None:
    import configparser

    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(ROOT / "deploy" / "kvtier.service")
    service = unit["Service"]
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["KillSignal"] == "SIGTERM" and int(service["TimeoutStartSec"]) >= 300
