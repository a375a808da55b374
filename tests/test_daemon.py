"""The daemon end to end: a real `kvtier serve` process, real gRPC over its Unix socket, real shared
memory and a real LMDB store."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier._version import __version__
from kvtier.client.sync_client import Client, KvtierRpcError, LayoutDecl
from kvtier.core.types import Tier
from tests.daemon_fixture import ROOT, DaemonProc

BLOCK = 65536
LAYOUT = LayoutDecl(fingerprint=b"test-layout-fp-01", block_bytes=BLOCK, block_tokens=16,
                    model_id="test-model-01")


def chain(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) + bytes(30) for i in range(n)]


def payloads(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(n)]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path_factory.mktemp("daemon"), ["--ssd-admit-after", "1"]).start()
    try:
        yield d
    finally:
        d.stop()


def wait_for(pred: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def test_socket_is_private(shared: DaemonProc) -> None:
    assert stat.S_IMODE(shared.socket.stat().st_mode) == 0o600


@pytest.mark.parametrize("store_streaming,load_streaming", [
    (False, False), (True, True), (False, True), (True, False),
])
def test_store_load_roundtrip_is_bit_exact(
    shared: DaemonProc, store_streaming: bool, load_streaming: bool
) -> None:
    tag = 10 + 2 * store_streaming + load_streaming
    keys, data = chain(tag, 6), payloads(6, tag)
    with Client(shared.socket, layout=LAYOUT, streaming=store_streaming) as w:
        assert w.uses_shm is not store_streaming
        assert w.store(keys, data) == (6, 0)
        assert w.store(keys, data) == (0, 6)  # already cached: nothing allocated again
    with Client(shared.socket, layout=LAYOUT, streaming=load_streaming) as r:
        assert r.lookup(keys + chain(99, 2)).hit_blocks == 6
        with r.load(keys + chain(99, 2)) as got:
            assert got.blocks == 6
            assert [bytes(v) for v in got.views] == data


def test_store_after_a_cached_parent_and_partial_hits(shared: DaemonProc) -> None:
    keys, data = chain(20, 8), payloads(8, 20)
    with Client(shared.socket, layout=LAYOUT) as kv:
        assert kv.store(keys[:4], data[:4]).stored == 4
        assert kv.store(keys[4:], data[4:], parent=keys[3]).stored == 4
        assert kv.lookup(keys).hit_blocks == 8
        with pytest.raises(KvtierRpcError) as exc:
            kv.store(chain(21, 2), data[:2], parent=chain(22, 1)[0])
        assert exc.value.code is grpc.StatusCode.FAILED_PRECONDITION
        with kv.load(keys[:3] + chain(23, 1) + keys[4:]) as got:
            assert got.blocks == 3


def test_abort_on_exception_frees_the_slots(shared: DaemonProc) -> None:
    keys = chain(30, 4)
    with Client(shared.socket, layout=LAYOUT) as kv:
        before = kv.stats().tiers[0].used_bytes
        with pytest.raises(RuntimeError), kv.store_into(keys) as tx:
            assert len(tx.slots) == 4
            raise RuntimeError("engine failed mid-copy")
        assert kv.stats().tiers[0].used_bytes == before
        assert kv.lookup(keys).hit_blocks == 0
        assert kv.stats().active_leases == 0


def test_events_stream_reports_stores(shared: DaemonProc) -> None:
    keys = chain(40, 3)
    with Client(shared.socket, layout=LAYOUT) as kv:
        seq0 = 0
        kv.store(keys, payloads(3, 40))
        events = kv.watch(since=seq0 + 1)
        got = []
        for ev in events:
            if ev.HasField("stored") and keys[0] in ev.stored.block_hashes:
                assert ev.stored.medium == 2  # TIER_DRAM comes first, SSD copies later
                got.append(ev)
                break
        assert got and list(got[0].stored.block_hashes) == keys
        assert got[0].stored.block_size == 16 and got[0].sequence > 0


def test_metrics_counters_move(shared: DaemonProc) -> None:
    def value(text: str, name: str) -> float:
        """Sum of the samples `name{labels}` (labels a subset, as written) in an exposition."""
        base, _, want = name.partition("{")
        pairs = set(want.rstrip("}").split(",")) - {""}
        total = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == base and pairs <= {f'{k}="{v}"' for k, v in s.labels.items()}:
                    total += s.value
        return total

    before = shared.metrics_text()
    keys = chain(50, 4)
    with Client(shared.socket, layout=LAYOUT) as kv:
        kv.store(keys, payloads(4, 50))
        kv.lookup(keys + chain(51, 1))
        with kv.load(keys) as got:
            assert got.blocks == 4
    after = shared.metrics_text()
    assert value(after, 'kvtier_lookups_total{result="hit"}') > value(
        before, 'kvtier_lookups_total{result="hit"}')
    assert value(after, 'kvtier_blocks_hit_total{tier="dram"}') >= value(
        before, 'kvtier_blocks_hit_total{tier="dram"}') + 4
    assert value(after, "kvtier_blocks_missed_total") >= value(
        before, "kvtier_blocks_missed_total") + 1
    moved = 'kvtier_moved_bytes_total{direction="from_client",tier="dram"}'
    assert value(after, moved) >= value(before, moved) + 4 * BLOCK
    assert value(after, 'kvtier_rpc_duration_seconds_count{method="Lookup"}') > 0
    assert 'kvtier_pool_capacity_bytes{tier="dram"} 1.6777216e+07' in after
    assert "kvtier_leases_active" in after


def test_client_sigkilled_mid_lease_loses_its_leases(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d", ["--lease-ttl-s", "1"]).start()
    try:
        script = textwrap.dedent(f"""
            import os, signal, sys
            sys.path.insert(0, {str(ROOT)!r})
            from kvtier.client.sync_client import Client, LayoutDecl
            lay = LayoutDecl({LAYOUT.fingerprint!r}, {BLOCK}, 16, model_id={LAYOUT.model_id!r})
            kv = Client({str(d.socket)!r}, layout=lay)
            keys = [bytes([1, i]) + bytes(30) for i in range(4)]
            kv.store(keys, [bytes({BLOCK})] * 4)
            cm = kv.load(keys); cm.__enter__()            # READ lease, never released
            tx = kv.store_into([bytes([2, i]) + bytes(30) for i in range(3)]); tx.__enter__()
            print("held", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == -9 and "held" in proc.stdout, proc.stderr
        with Client(d.socket, layout=LAYOUT) as kv:  # its session ended with its process
            # (or the 1 s TTL ran out): the deadline only fails a hang, on a loaded machine
            wait_for(lambda: kv.stats().active_leases == 0, timeout=15)
            s = kv.stats()
            assert s.tiers[0].used_bytes == s.tiers[0].blocks * BLOCK == 4 * BLOCK  # no leak
            assert kv.lookup([bytes([2, 0]) + bytes(30)]).hit_blocks == 0
            with kv.load([bytes([1, i]) + bytes(30) for i in range(4)]) as got:
                assert got.blocks == 4
        assert 'kvtier_leases_expired_total{kind="read"} 1.0' in d.metrics_text()
    finally:
        d.stop()


def test_restart_keeps_ssd_blocks_and_clients_reconnect(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d", ["--ssd-admit-after", "1"]).start()
    keys, data = chain(60, 5), payloads(5, 60)
    try:
        kv = Client(d.socket, layout=LAYOUT)
        kv.store(keys, data)
        wait_for(lambda: kv.stats().tiers[1].blocks == 5)
        old_generation = kv.stats().segment.generation
        assert d.stop() == 0
        d.start()
        assert kv.lookup(keys).tiers == [Tier.SSD] * 5  # same client object, re-registered
        with kv.load(keys) as got:
            assert got.tiers == [Tier.SSD] * 5
            assert [bytes(v) for v in got.views] == data
        assert kv.lookup(keys).tiers == [Tier.DRAM] * 5  # promoted
        assert kv.stats().segment.generation != old_generation
        kv.close()
        assert "SSD tier: 5 blocks indexed" in d.log()
    finally:
        d.stop()


def test_sigterm_drains_then_exits_cleanly(tmp_path: Path) -> None:
    # a grace period longer than the waits below on a loaded machine (with the fixture's 2 s,
    # a slow health check outlived it: the daemon ended our lease and exited under the test)
    d = DaemonProc(tmp_path / "d", ["--grace-s", "30"]).start()
    assert d.proc is not None
    with Client(d.socket, layout=LAYOUT) as kv:
        keys = chain(70, 2)
        kv.store(keys, payloads(2, 70))
        with kv.load(keys) as got:
            d.proc.send_signal(15)
            deadline = time.monotonic() + 10  # health says NOT_SERVING while draining: seen,
            while d._healthy():               # however long a loaded machine takes to say it
                assert time.monotonic() < deadline, "still SERVING 10 s after SIGTERM"
                time.sleep(0.02)
            assert d.proc.poll() is None  # and it waits for our lease
            with pytest.raises(KvtierRpcError) as exc:
                kv.store(chain(71, 1), payloads(1, 71))
            assert exc.value.code is grpc.StatusCode.UNAVAILABLE  # no new leases
            assert bytes(got.views[0]) == payloads(2, 70)[0]
        assert d.proc.wait(10) == 0  # our Release went through; then it exits
    assert not d.socket.exists()
    assert not (Path("/dev/shm") / _segment_name(d)).exists()
    assert "stopped (0 lease(s) ended at shutdown)" in d.log()


def _segment_name(d: DaemonProc) -> str:
    import hashlib

    return "kvtier-" + hashlib.sha256(str(d.socket).encode()).hexdigest()[:16]


def test_serve_runs_with_no_configuration(tmp_path: Path) -> None:
    import socket as so

    probe = so.socket()
    try:
        probe.bind(("127.0.0.1", 9464))
    except OSError:
        pytest.skip("the default metrics port 9464 is in use on this machine")
    finally:
        probe.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(HOME=str(tmp_path / "home"), XDG_RUNTIME_DIR=str(tmp_path / "xdg"),
               PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", "serve"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        sock = tmp_path / "xdg" / "kvtier" / "kvtier.sock"
        wait_for(sock.exists, timeout=30)
        time.sleep(0.5)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"serving on unix:{sock}" in out and "metrics http://127.0.0.1:9464/metrics" in out
    ssd = tmp_path / "home" / ".local" / "share" / "kvtier" / "ssd"
    assert ssd.is_dir()
    assert "Traceback" not in out
    # the default SSD tier reserves its slot file (up to 16 GiB): give the disk back now
    shutil.rmtree(ssd)


def test_second_daemon_on_the_same_socket_is_refused(shared: DaemonProc) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier", "serve", "--socket", str(shared.socket),
         "--data-dir", str(shared.workdir / "other"), "--metrics", ""],
        capture_output=True, text=True, timeout=60, env=shared.env,
    )
    assert proc.returncode == 2
    assert "another daemon is listening" in proc.stderr and "Traceback" not in proc.stderr
    assert shared.healthy()


def test_stats_command_text_and_json(shared: DaemonProc) -> None:
    """--json: plain numbers (not protobuf's 64-bit strings) and the table's tier names."""
    import json

    base = [sys.executable, "-m", "kvtier", "stats", "--socket", str(shared.socket)]
    out = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=60,
                         env=shared.env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    text = subprocess.run(base, capture_output=True, text=True, timeout=60, env=shared.env)
    assert text.returncode == 0 and "16 MiB" in text.stdout
    table_names = [line.split()[0] for line in text.stdout.splitlines()[2:4]]
    assert [t["tier"] for t in data["tiers"]] == table_names == ["dram", "ssd"]
    assert data["tiers"][0]["capacity_bytes"] == 16 << 20  # an int, not "16777216"
    for key in ("lookups", "blocks_hit", "active_leases", "tenant_dram_bytes"):
        assert type(data[key]) is int, (key, data[key])
    assert isinstance(data["uptime_seconds"], float) and data["version"] == __version__
    from kvtier.index.mrc import MIN_SAMPLES  # the figures once it has them: test_stats_top.py

    if data["mrc_sampled_blocks"] < MIN_SAMPLES:
        assert "estimated hit ratio (MRC): not enough lookups yet (" in text.stdout
    else:
        assert "estimated hit ratio (MRC): now " in text.stdout and "dram x2 " in text.stdout
    assert len(data["mrc"]) == 11 and data["mrc"][0]["scaled"] == "none"


def test_stats_command_without_a_daemon_exits_2(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier", "stats", "--socket", str(tmp_path / "none.sock")],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    assert "no kvtier daemon at" in out.stderr and "Traceback" not in out.stderr


def test_tcp_listener_serves_remote_style_clients(tmp_path: Path) -> None:
    import socket as so

    with so.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = DaemonProc(tmp_path / "d", ["--tcp", f"127.0.0.1:{port}"]).start()
    try:
        assert f"and tcp:127.0.0.1:{port}" in d.log()
        keys, data = chain(80, 3), payloads(3, 80)
        with Client(layout=LAYOUT, target=f"127.0.0.1:{port}", streaming=True) as kv:
            assert kv.store(keys, data).stored == 3
            with kv.load(keys) as got:
                assert [bytes(v) for v in got.views] == data
    finally:
        d.stop()


def test_lookup_returns_the_planners_cut(shared: DaemonProc) -> None:
    from kvtier.client.sync_client import ModelCost

    # Llama-3-8B-like cost: 8e9 active parameters, 32 layers, 4096-wide attention.
    lay = LayoutDecl(b"test-layout-planned", BLOCK, 16, model=ModelCost(8.0e9, 32, 4096),
                     model_id="test-model-planned")
    keys = chain(90, 8)
    with Client(shared.socket, layout=lay) as kv:
        kv.store(keys, payloads(8, 90))
        res = kv.lookup(keys + chain(91, 4), plan=True, prompt_tokens=12 * 16)
        assert res.hit_blocks == 8 and res.plan is not None
        assert 0 <= res.fetch_blocks <= 8 and res.plan.reason
        # 64 KiB DRAM blocks of 16 tokens against 16 tokens x 2 x 8e9 FLOPs of recompute each:
        # fetching wins by orders of magnitude at any plausible rate, so the whole prefix is cut.
        assert res.fetch_blocks == 8 and res.plan.predicted_recompute_seconds > 0
        kv.report_prefill(tokens=2048, seconds=0.5, context_tokens=0)
        assert kv.lookup(keys).plan is None  # no plan unless asked
    assert 'kvtier_plan_decisions_total{action="fetch_dram"} 8.0' in shared.metrics_text()


def test_renew_extends_a_lease(tmp_path: Path) -> None:
    """A renewed lease outlives its first TTL; an unrenewed control lease expires. No timing
    race: the renewed lease's first TTL (1 s) is shorter than the control's (3 s), and the renew
    gives it 300 s; so the first expiry seen is the control's, and only if the renew worked is
    the renewed lease still there to Release then (without it, that lease expired first)."""
    from kvtier._proto import kvtier_pb2 as pb
    from kvtier._proto import kvtier_pb2_grpc as pb_grpc

    d = DaemonProc(tmp_path / "d").start()
    try:
        with Client(d.socket, layout=LAYOUT) as kv, grpc.insecure_channel(
                f"unix:{d.socket}") as ch:
            kv.store(chain(95, 1), payloads(1, 95))
            kv.store(chain(96, 1), payloads(1, 96))
            stub = pb_grpc.KvTierStub(ch)  # type: ignore[no-untyped-call]
            got = stub.Acquire(pb.AcquireRequest(layout=LAYOUT.layout_id, keys=chain(95, 1)[0],
                                                 key_width=32, lease_ttl_ms=1000))
            renewed = stub.RenewLease(pb.RenewLeaseRequest(lease_id=got.lease_id,
                                                           lease_ttl_ms=300_000))
            stub.Acquire(pb.AcquireRequest(layout=LAYOUT.layout_id, keys=chain(96, 1)[0],
                                           key_width=32, lease_ttl_ms=3000))  # the control
            assert renewed.lease_ttl_ms == 300_000
            expired = 'kvtier_leases_expired_total{kind="read"}'
            wait_for(lambda: f"{expired} 1.0" in d.metrics_text(), timeout=120)  # hang check
            assert kv.stats().active_leases == 1
            stub.Release(pb.ReleaseRequest(lease_id=got.lease_id))  # still held: renewed
            assert kv.stats().active_leases == 0
            assert f"{expired} 1.0" in d.metrics_text()
    finally:
        d.stop()


def test_reflection_lists_the_services(shared: DaemonProc) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(f"unix:{shared.socket}") as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {"kvtier.v1.KvTier", "grpc.health.v1.Health"} <= services


def test_client_falls_back_to_streaming_when_the_segment_cannot_be_mapped(
    shared: DaemonProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvtier.client.shm

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError("not allowed to map the segment")

    monkeypatch.setattr(kvtier.client.shm.DramClient, "attach", refuse)
    keys, data = chain(85, 3), payloads(3, 85)
    with Client(shared.socket, layout=LAYOUT) as kv:
        assert not kv.uses_shm
        assert kv.store(keys, data).stored == 3
        with kv.load(keys) as got:
            assert [bytes(v) for v in got.views] == data


def test_sigterm_flushes_queued_write_backs(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d", ["--ssd-admit-after", "1"]).start()
    keys, data = chain(86, 6), payloads(6, 86)
    try:
        with Client(d.socket, layout=LAYOUT) as kv:
            assert kv.store(keys, data).stored == 6
        assert d.stop() == 0  # no waiting: whatever is still queued is flushed by the drain
        d.start()
        with Client(d.socket, layout=LAYOUT) as kv, kv.load(keys) as got:
            assert got.tiers == [Tier.SSD] * 6
            assert [bytes(v) for v in got.views] == data
    finally:
        d.stop()


def test_tcp_with_tls(tmp_path: Path) -> None:
    import socket as so

    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    with so.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = DaemonProc(tmp_path / "d", ["--tcp", f"0.0.0.0:{port}", "--tls-cert", str(cert),
                                    "--tls-key", str(key)]).start()
    try:
        assert "(TLS)" in d.log()
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with Client(layout=LAYOUT, target=f"localhost:{port}", credentials=creds,
                    streaming=True) as kv:
            assert kv.store(chain(87, 1), payloads(1, 87)).stored == 1
        with pytest.raises(KvtierRpcError) as exc, Client(
                layout=LAYOUT, target=f"localhost:{port}", timeout=3):  # plaintext: refused
            pass
        assert exc.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        d.stop()


def test_register_cuda_is_a_clean_no_without_cupy(shared: DaemonProc) -> None:
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy installed: covered by the GPU tests")
    with Client(shared.socket, layout=LAYOUT) as kv:
        assert kv.uses_shm and kv.register_cuda() is False
    with Client(shared.socket, layout=LAYOUT, streaming=True) as kv:
        assert kv.register_cuda() is False


def test_busy_metrics_port_is_a_one_line_error(tmp_path: Path) -> None:
    import socket as so

    with so.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "kvtier", "serve", "--socket", str(tmp_path / "s.sock"),
             "--data-dir", str(tmp_path / "d"), "--dram-bytes", "16MiB",
             "--metrics", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"kvtier serve: error: metrics address 127.0.0.1:{port}: [Errno 98] Address already in use"
    ]
    assert not (tmp_path / "s.sock").exists() and not (tmp_path / "d").exists()


@pytest.mark.parametrize("flags,message", [
    (["--data-dir", "/proc/no-such-dir/kvtier"], "cannot set up the storage tiers"),
    (["--dram-bytes", "100TiB"], "exceeds the free shared memory"),
])
def test_impossible_storage_is_a_one_line_error(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    args = ["--socket", str(tmp_path / "s.sock"), "--data-dir", str(tmp_path / "d"),
            "--metrics", "", *flags]
    proc = subprocess.run([sys.executable, "-m", "kvtier", "serve", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_replicas_report_hbm_holdings(shared: DaemonProc) -> None:
    keys = chain(96, 4)
    with Client(shared.socket, layout=LAYOUT) as kv:
        kv.store(keys, payloads(4, 96))
        assert kv.report_hbm("replica-a", added=keys[:2] + chain(97, 1)) == 2  # uncached: ignored
        assert kv.lookup(keys, replica="replica-a").tiers[:3] == [Tier.HBM, Tier.HBM, Tier.DRAM]
        assert Tier.HBM not in kv.lookup(keys, replica="replica-b").tiers
        assert Tier.HBM not in kv.lookup(keys).tiers
        kv.report_hbm("replica-a", removed=keys[1:2])
        assert kv.lookup(keys, replica="replica-a").tiers[:2] == [Tier.HBM, Tier.DRAM]
        kv.report_hbm("replica-a", reset=True)
        assert Tier.HBM not in kv.lookup(keys, replica="replica-a").tiers
        with kv.load(keys) as got:  # HBM-held blocks are still served from the daemon's copies
            assert got.blocks == 4


def test_a_load_that_outlives_its_lease_is_reported(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d", ["--lease-ttl-s", "1"]).start()
    try:
        with Client(d.socket, layout=LAYOUT) as kv:
            kv.store(chain(98, 1), payloads(1, 98))
            with pytest.raises(KvtierRpcError) as exc, kv.load(chain(98, 1)) as got:
                assert got.blocks == 1
                # the reaper ends the lease after its 1 s TTL (whenever a loaded machine lets it)
                wait_for(lambda: kv.stats().active_leases == 0, timeout=30)
            assert exc.value.code is grpc.StatusCode.NOT_FOUND
            assert kv.stats().active_leases == 0
            with kv.load(chain(98, 1)) as again:  # retrying works
                assert again.blocks == 1
    finally:
        d.stop()


def test_a_failed_start_leaves_no_segment_behind(tmp_path: Path) -> None:
    data = tmp_path / "d"
    data.mkdir()
    (data / "ssd").write_text("a file where the SSD store's directory goes")  # fails after shm
    sock = tmp_path / "s.sock"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier", "serve", "--socket", str(sock), "--data-dir", str(data),
         "--dram-bytes", "16MiB", "--metrics", ""],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "cannot set up the storage tiers" in proc.stderr
    segment = "kvtier-" + __import__("hashlib").sha256(str(sock).encode()).hexdigest()[:16]
    assert not (Path("/dev/shm") / segment).exists()


def test_a_request_larger_than_the_whole_pool_says_so(tmp_path: Path) -> None:
    """Defect: storing more blocks than the whole DRAM pool holds answered "DRAM pool full: 300
    slots wanted, 256 free, the rest pinned by leases or being written" on an empty, lease-free
    daemon. It names the pool's size and the largest request that can fit, and stores nothing."""
    d = DaemonProc(tmp_path / "d").start()  # 16 MiB of 64 KiB slots: 256 at most
    try:
        layout = LayoutDecl(fingerprint=b"whole-pool-fp-01", block_bytes=65536,
                            block_tokens=16, model_id="whole/pool")
        keys = [i.to_bytes(2, "big") * 16 for i in range(300)]
        with Client(d.socket, layout=layout) as kv:
            with pytest.raises(KvtierRpcError) as err:
                kv.store(keys, [np.zeros(65536, np.uint8)] * 300)
            assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details == (
                "300 blocks of 65536 bytes do not fit the DRAM pool at all: its 16 MiB hold at "
                "most 256 slots of 65536 bytes; store them in requests of at most 256 blocks (or "
                "give the daemon a larger dram_bytes)")
            assert "lease" not in err.value.details
            assert kv.lookup(keys).hit_blocks == 0 and kv.stats().active_leases == 0
            assert kv.store(keys[:256], [np.zeros(65536, np.uint8)] * 256).stored == 256
    finally:
        assert d.stop() == 0
