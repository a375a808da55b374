"""The remote tier's parts one at a time: reconnect backoff, the planner pricing the remote link,
the remote_* settings, and `RemoteStore` verification against a real redis-server (every flipped
bit of a stored value is caught; nothing damaged is ever copied out as good)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.core.costmodel import CostModel
from kvtier.core.errors import UsageError
from kvtier.core.planner import PlanRates, Prefix, Reason, plan
from kvtier.core.types import Tier
from kvtier.daemon import config
from kvtier.daemon.rates.book import Link, RateBook
from kvtier.tiers.backoff import Backoff
from tests.redis_fixture import RedisServer, needs_redis


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_backoff_one_outage_doubles_then_recovers() -> None:
    clock = Clock()
    b = Backoff(0.5, 4.0, clock)
    assert b.ready() and b.up
    assert b.failed() is True  # the outage starts: the one warning
    assert not b.ready() and b.retry_in() == 0.5
    assert b.failed() is False  # a request already in flight failing too: no second warning
    for delay in (2.0, 4.0, 4.0):
        clock.t += 100
        assert b.ready()
        assert b.failed() is False
        assert b.retry_in() == delay  # doubled, capped
    clock.t += 4.0
    assert b.ready() and b.succeeded() is True and b.up
    assert b.succeeded() is False and b.outages == 1
    assert b.failed() is True and b.retry_in() == 0.5  # a new outage starts from the first delay


R, D, S, H = Tier.REMOTE, Tier.DRAM, Tier.SSD, Tier.HBM
# 10-token blocks of 1e8 bytes; recompute 10 ms/block; h2d 5 ms/block; remote 1e10 B/s → 10 ms.
RATES = PlanRates(2e10, 1e-3, 1e9, 2e-3, 1e12, remote_bytes_per_s=1e10, remote_latency_s=3e-3)
LINEAR = CostModel("lin", 1e9, (), 1)


def test_planner_prices_remote_blocks_with_the_links_rates() -> None:
    p = Prefix.uniform([D, D, R, R], 10, int(1e8))
    got = plan(p, LINEAR, RATES)
    # T(2) = 1 + 2·5 + 2·10 = 31 ms; T(3) = 1 + 3 lat + 10 remote + 15 h2d + 10 = 39; T(4) = 47
    assert got.cut == 2 and got.reason is Reason.REMOTE_SLOWER_THAN_RECOMPUTE
    assert got.total_s == pytest.approx(0.031)
    fast = plan(p, LINEAR, RATES._replace(remote_bytes_per_s=1e12, remote_latency_s=0.0))
    # T(4) = 1 + 2·0.1 + 4·5 = 21.2 ms: fetching everything wins once the link is fast
    assert (fast.cut, fast.reason) == (4, Reason.FETCH_ALL)
    assert fast.blocks_by_tier == (0, 2, 0, 2)
    assert fast.fetch_s == pytest.approx(0.0212)


def test_measured_remote_rates_move_the_cut() -> None:
    book = RateBook()
    p = Prefix.uniform([R] * 4, 10, int(1e8))
    for _ in range(5):  # a slow link: 1e8 bytes in 1 s after 1 ms of latency
        book.observe_latency(Link.REMOTE_READ, 1e-3)
        book.observe_transfer(Link.REMOTE_READ, 1e8, 1.0 + 1e-3, includes_latency=True)
    rates = book.snapshot()._replace(prefill_flops_per_s=1e12)
    assert rates.remote_bytes_per_s == pytest.approx(1e8, rel=1e-6)
    assert plan(p, LINEAR, rates).cut == 0  # recompute: 10 ms a block beats 1 s
    for _ in range(40):  # the link gets fast: the median follows
        book.observe_transfer(Link.REMOTE_READ, 1e8, 1e-3 + 5e-3, includes_latency=True)
    assert plan(p, LINEAR, book.snapshot()._replace(prefill_flops_per_s=1e12)).cut == 4


def test_remote_settings_validate(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    cfg = config.load({}, env)
    assert cfg.remote_url == "" and cfg.remote_mode == "standalone"
    cfg = config.load({"remote_url": "rediss://cache:6380/1", "remote_tls_ca": "/ca.pem",
                       "remote_mode": "cluster"},
                      {**env, "KVTIER_REMOTE_PASSWORD": "s3cret"})
    assert cfg.remote_password == "s3cret" and cfg.remote_mode == "cluster"
    assert cfg.remote_queue_bytes % cfg.slot_bytes == 0
    from kvtier.tiers.remote import RemoteSpec

    kw = RemoteSpec(**config.remote_spec_args(
        {f: getattr(cfg, f) for f in cfg.__dataclass_fields__})).client_kwargs()
    assert kw["password"] == "s3cret" and kw["ssl_ca_certs"] == "/ca.pem"
    assert kw["socket_timeout"] == 0.25
    assert RemoteSpec("valkey://h:7000/2").redis_url() == "redis://h:7000/2"
    assert RemoteSpec("valkeys://h:7000/2").tls and RemoteSpec("unix:///run/r.sock").redis_url()
    for flags, message in [
        ({"remote_url": "http://x:1"},
         "remote_url (from flag --remote-url): expected redis://"),
        ({"remote_url": "redis://x:1", "remote_tls_ca": "/ca"}, "need a rediss://"),
        ({"remote_url": "rediss://x:1", "remote_tls_cert": "/c"}, "go together"),
        ({"remote_mode": "sharded"},
         "remote_mode (from flag --remote-mode): must be one of cluster, standalone"),
        ({"remote_url": "redis://x:1", "remote_timeout_s": "0"}, "remote_timeout_s"),
        ({"remote_admit_after": "0"},
         "remote_admit_after (from flag --remote-admit-after): must be >= 1"),
        ({"remote_queue_bytes": "1KiB"},
         "remote_queue_bytes (from flag --remote-queue-bytes): must hold one slot"),
        ({"remote_url": "redis://x:1", "remote_prefix": "a:b"}, "remote_prefix"),
    ]:
        with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
            config.load(flags, env)


def test_serve_help_and_print_config_mask_the_password(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin", "KVTIER_REMOTE_PASSWORD": "hunter2"}
    help_text = subprocess.run([sys.executable, "-m", "kvtier", "serve", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    for flag in ("--remote-url", "--remote-mode", "--remote-password", "--remote-tls-ca",
                 "--remote-timeout-s", "--remote-write-bytes-per-s", "--remote-queue-bytes"):
        assert flag in help_text
    out = subprocess.run([sys.executable, "-m", "kvtier", "serve", "--print-config",
                          "--remote-url", "redis://127.0.0.1:6379/0"],
                         capture_output=True, text=True, env=env, timeout=60).stdout
    assert "# remote_password is set (not printed" in out and "hunter2" not in out


@needs_redis
def test_every_flipped_bit_of_a_stored_value_is_caught(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    from kvtier.tiers.remote import RemoteSpec, RemoteStore

    server = RedisServer(tmp_path / "redis").start()
    store = RemoteStore(RemoteSpec(server.url))
    try:
        ns, key = "t/ns2:" + "00" * 32, b"k" * 32
        payload = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
        assert store.put_many([(ns, key, memoryview(payload.tobytes()))]) == ([True], 4096 + 64)
        out = bytearray(4096)
        assert store.get_into(ns, [key], [memoryview(out)]).sizes == [4096]
        assert out == payload.tobytes()
        r = server.client()
        good = r.get(store.key(ns, key))
        rng = np.random.default_rng(4)
        # every header bit, and 64 random payload bits
        bits = list(range(64 * 8)) + [int(b) for b in rng.integers(64 * 8, len(good) * 8, 64)]
        for bit in bits:
            bad = bytearray(good)
            bad[bit // 8] ^= 1 << (bit % 8)
            r.set(store.key(ns, key), bytes(bad))
            got = store.get_into(ns, [key], [memoryview(bytearray(4096))])
            assert got.sizes == [None] and len(got.corrupt) == 1, bit
            assert not r.exists(store.key(ns, key))  # deleted: not fetched again
        r.set(store.key(ns, key), good[:-1])  # truncated
        assert store.get_into(ns, [key], [memoryview(bytearray(4096))]).sizes == [None]
        r.set(store.key(ns, key), good)
        other = "u/ns2:" + "00" * 32  # the same value under another tenant's key
        r.set(store.key(other, key), good)
        assert store.get_into(other, [key], [memoryview(bytearray(4096))]).corrupt
        assert store.present(ns, [key, b"x" * 32]) == 1
        # a long chain is fetched in chunks: results stay in order, and the first damaged block
        # (here in the second chunk) ends the prefix
        keys = [bytes([i]) * 32 for i in range(20)]
        blobs = [np.full(4096, i, np.uint8).tobytes() for i in range(20)]
        store.put_many([(ns, k, memoryview(b)) for k, b in zip(keys, blobs, strict=True)])
        bad = bytearray(r.get(store.key(ns, keys[12])))
        bad[-1] ^= 1
        r.set(store.key(ns, keys[12]), bytes(bad))
        outs = [bytearray(4096) for _ in keys]
        got = store.get_into(ns, keys, [memoryview(o) for o in outs])
        assert got.sizes == [4096] * 12 + [None] * 8 and len(got.corrupt) == 1
        assert [bytes(o) for o in outs[:12]] == blobs[:12]
        assert store.present(ns, keys) == 12
    finally:
        store.close()
        server.stop()


def test_remote_page_config_example_loads(tmp_path: Path) -> None:
    section = (Path(__file__).resolve().parents[1] / "docs" / "remote.md").read_text()
    toml = section.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "kvtier.toml").write_text(toml)
    cfg = config.load({}, {"HOME": str(tmp_path)}, str(tmp_path / "kvtier.toml"))
    assert cfg.remote_url == "rediss://kv-cache.internal:6380/0"
    assert cfg.remote_write_bytes_per_s == 400_000_000 and cfg.remote_username == "kvtier"
    # every key the page's table names is a setting
    for key in ("remote_url", "remote_mode", "remote_username", "remote_password",
                "remote_tls_ca", "remote_tls_cert", "remote_tls_key", "remote_timeout_s",
                "remote_write_bytes_per_s", "remote_write_burst_bytes", "remote_queue_bytes",
                "remote_admit_after", "remote_prefix"):
        assert f"`{key}`" in section and hasattr(cfg, key)
