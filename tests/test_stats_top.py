"""`kvtier stats` and `kvtier top` against a real daemon: by socket and by TCP, one line when
no daemon is there, 80-column output, and the MRC's "now": no number until the curve has
`MIN_SAMPLES` sampled blocks, then within its stated `ERROR` of the measured hit ratio."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier import Client, LayoutDecl, block_keys
from kvtier.index.mrc import ERROR, MIN_SAMPLES
from tests.daemon_fixture import ROOT, DaemonProc

LAYOUT = LayoutDecl(fingerprint=b"stats-test/v1", block_bytes=16384, block_tokens=16,
                    model_id="test/stats@1")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvtier(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(columns)}
    env.pop("KVTIER_SOCKET", None)
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True,
                          text=True, timeout=60, env=env)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, str]]:
    port = _port()
    d = DaemonProc(tmp_path_factory.mktemp("stats") / "d",
                   ["--dram-bytes", "64MiB", "--slot-bytes", "16KiB", "--ssd-bytes", "0",
                    "--tcp", f"127.0.0.1:{port}"]).start()
    try:
        yield d, f"127.0.0.1:{port}"
    finally:
        d.stop()


def _mrc_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("estimated hit ratio"))


def test_mrc_says_not_enough_then_agrees_with_the_measured_ratio(
        daemon: tuple[DaemonProc, str]) -> None:
    d, _ = daemon
    rng = random.Random(7)
    blocks = [np.full(LAYOUT.block_bytes, 1, dtype=np.uint8)] * 24
    with Client(d.socket, layout=LAYOUT) as kv:
        first = block_keys(list(range(4 * 16)), 16)  # docs/daemon.md's example: store, look up
        kv.store(first, blocks[:4])
        assert kv.lookup(first).hit_blocks == 4
        early = kvtier("stats", "--socket", str(d.socket))
        assert early.returncode == 0, early.stderr
        line = _mrc_line(early.stdout)
        assert re.fullmatch(rf"estimated hit ratio \(MRC\): not enough lookups yet \(\d+ of "
                            rf"{MIN_SAMPLES} sampled blocks\)", line), line
        # an engine's traffic: look a prompt up, store what missed; prompts share prefixes
        prompts = [[p % 7] * 16 * 6 + list(range(1000 * p, 1000 * p + 16 * rng.randint(4, 18)))
                   for p in range(1, 301)]
        for _ in range(900):
            tokens = rng.choice(prompts)
            keys = block_keys(tokens, 16)
            if kv.lookup(keys).hit_blocks < len(keys):
                kv.store(keys, blocks[: len(keys)])  # Allocate skips the cached ones
        stats = kv.stats()
    assert stats.mrc_sampled_blocks >= MIN_SAMPLES
    measured = stats.blocks_hit / (stats.blocks_hit + stats.blocks_missed)
    now = next(p.hit_ratio for p in stats.mrc if p.scaled == "none")
    assert 0.3 < measured < 0.95  # reuse, and misses: a ratio worth estimating
    assert abs(now - measured) <= ERROR, (now, measured)
    print(f"measured {measured:.4f}, MRC now {now:.4f}, {stats.mrc_sampled_blocks} samples")
    line = _mrc_line(kvtier("stats", "--socket", str(d.socket)).stdout)
    assert f"now {now:.1%} (+-3 pts)" in line, line


def test_stats_and_top_reach_a_tcp_daemon_at_80_columns(daemon: tuple[DaemonProc, str]) -> None:
    d, address = daemon
    by_tcp = kvtier("stats", "--tcp", address)
    assert by_tcp.returncode == 0, by_tcp.stderr
    lines = by_tcp.stdout.splitlines()
    assert lines[0].startswith("kvtier ") and f"on {address}," in lines[0]
    assert all(len(line) <= 80 for line in lines), lines
    assert "this tenant: DRAM" in by_tcp.stdout
    for source in (address, f"tcp://{address}", str(d.socket)):
        top = kvtier("top", "--once", "--interval", "0.3", source)
        assert top.returncode == 0, top.stderr
        out = top.stdout.splitlines()
        assert all(len(line) <= 80 for line in out), out
        text = top.stdout
        for label in ("daemon", "hit ratio", "fill", "MRC headroom", "problems"):
            assert re.search(rf"^{label}\s", text, flags=re.M), (label, text)
        assert source in text
    wide = kvtier("top", "--once", "--interval", "0.3", address, columns=200)
    assert wide.returncode == 0 and "MRC headroom" in wide.stdout.splitlines()[2]


def test_nothing_there_is_one_line(tmp_path: Path) -> None:
    port = _port()
    for args, where in ((["stats", "--tcp", f"127.0.0.1:{port}"], f"127.0.0.1:{port}"),
                        (["top", "--once", f"127.0.0.1:{port}"], f"127.0.0.1:{port}"),
                        (["top", "--once", str(tmp_path / "none.sock")],
                         str(tmp_path / "none.sock")),
                        (["top", str(tmp_path / "none.sock")], str(tmp_path / "none.sock"))):
        proc = kvtier(*args)
        assert proc.returncode == 2 and proc.stdout == "", (args, proc.stdout)
        assert proc.stderr.splitlines() == [
            f"kvtier {args[0]}: error: no kvtier daemon at {where} (start one: kvtier serve)"]
    both = kvtier("top", "--once", str(tmp_path / "a.sock"), str(tmp_path / "b.sock"))
    assert both.returncode == 2 and len(both.stderr.splitlines()) == 1
    assert "answers at any of" in both.stderr
    bad = kvtier("stats", "--socket", "x", "--tls-ca", "ca.pem")
    assert bad.returncode == 2 and "--tls-ca goes with a TCP daemon" in bad.stderr
