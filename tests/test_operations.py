"""The operators' control surface against real daemon processes: `kvtier evict|clear|pin|unpin|
pins|prefetch` and `kvtier.client.control.Control` over gRPC, on real shared memory and LMDB.

Evict removes a model's blocks from DRAM and SSD (gone after a restart too) and leaves every
other model's; a prefix takes the blocks under it and keeps what it shares; blocks a lease holds
go at its release. Pins survive floods until unpinned or expired; a tenant's token acts on its
own blocks only and its pins never pass its quota; prefetch brings SSD blocks back into DRAM and
holds nothing after. Each action is logged, counted in the metrics and published as KV events;
bad input is one line and exit code 2, and changes nothing. The remote tier's side:
tests/test_remote.py; in-process rules with a driven clock: tests/test_control.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvtier import Client, LayoutDecl, block_keys
from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier.client.control import Control
from kvtier.client.sync_client import KvtierRpcError
from kvtier.core.types import Tier
from tests.daemon_fixture import ROOT, DaemonProc

BLOCK, TOKENS = 64 << 10, 16
ARGS = ["--dram-bytes", "16MiB", "--slot-bytes", "64KiB", "--ssd-bytes", "64MiB",
        "--ssd-admit-after", "1", "--policy", "lru",  # 256 DRAM blocks; floods evict in order
        "--ssd-write-bytes-per-day", "1TiB", "--ssd-write-burst-bytes", "1GiB",
        "--writeback-queue-bytes", "8MiB"]
DRAM, SSD = Tier.DRAM, Tier.SSD


def layout(model: str) -> LayoutDecl:
    return LayoutDecl(fingerprint=b"ops-test-layout/1", block_bytes=BLOCK, block_tokens=TOKENS,
                      model_id=model)


def prompt(seed: int, blocks: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(1, 30000, blocks * TOKENS)]


def payload(i: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.full(BLOCK, i % 251, dtype=np.uint8)


def store(kv: Client, tokens: list[int]) -> list[bytes]:
    keys = block_keys(tokens, TOKENS)
    kv.store(keys, [payload(i) for i in range(len(keys))])
    return keys


def kvtier(d: DaemonProc, *args: str, token: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVTIER_TOKEN", None)
    if token:
        env["KVTIER_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "kvtier", *args, "--socket", str(d.socket)],
                          capture_output=True, text=True, timeout=120, env=env)


def ok_json(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def wait_for(what: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.05)


def flood(kv: Client, seed: int, blocks: int = 300) -> None:
    """More blocks than DRAM holds, in chains of 20 (each commit evicts the coldest)."""
    for i in range(blocks // 20):
        store(kv, prompt(seed * 1000 + i, 20))


class Events:
    """A WatchEvents stream (node-wide for an admin token) collected on a thread."""

    def __init__(self, d: DaemonProc) -> None:
        self.channel = grpc.insecure_channel(f"unix:{d.socket}")
        self.call = pb_grpc.KvTierStub(self.channel).WatchEvents(  # type: ignore[no-untyped-call]
            pb.WatchEventsRequest())
        self.got: list[pb.KvEvent] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for e in self.call:
                self.got.append(e)
        except grpc.RpcError:
            pass

    def removed(self, tier: int, layout_id: bytes) -> set[bytes]:
        return {k for e in list(self.got) if e.HasField("removed")
                and e.removed.medium == tier and e.removed.layout == layout_id
                for k in e.removed.block_hashes}

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()
        self.thread.join(10)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path_factory.mktemp("ops") / "d", ARGS).start()
    try:
        yield d
    finally:
        d.stop()


def test_evict_a_model_everywhere_and_keep_the_others(tmp_path: Path) -> None:
    """100 blocks of model a and 100 of model b (same prompts: same keys), in DRAM and on SSD:
    `kvtier evict --model a` removes a's from both tiers (and they stay gone after a restart),
    publishes BlockRemoved per tier, counts them; b's all still hit."""
    d = DaemonProc(tmp_path / "d", ARGS).start()
    try:
        events = Events(d)
        with Client(d.socket, layout=layout("ops/a")) as a, \
                Client(d.socket, layout=layout("ops/b")) as b:
            prompts = [prompt(i, 20) for i in range(5)]
            keys_a: list[bytes] = []
            for n, (kv, p) in enumerate([(a, p) for p in prompts] + [(b, p) for p in prompts]):
                keys = store(kv, p)
                keys_a += keys if kv is a else []
                # written back at once (admitted after 1 access), one prompt at a time
                wait_for(lambda n=n: b.stats().tiers[1].blocks == 20 * (n + 1))
            got = ok_json(kvtier(d, "evict", "--model", "ops/a", "--json"))
            assert (got["blocks"], got["dram_blocks"], got["ssd_blocks"]) == (100, 100, 100)
            assert (got["namespaces"], got["doomed_blocks"]) == (1, 0)
            assert all(a.lookup(block_keys(p, TOKENS)).hit_blocks == 0 for p in prompts)
            assert all(b.lookup(block_keys(p, TOKENS)).hit_blocks == 20 for p in prompts)
            s = b.stats()
            assert (s.tiers[0].blocks, s.tiers[1].blocks) == (100, 100)
            lid_a = layout("ops/a").layout_id
            wait_for(lambda: events.removed(pb.TIER_SSD, lid_a) == set(keys_a))
            assert events.removed(pb.TIER_DRAM, lid_a) == set(keys_a)
            assert events.removed(pb.TIER_DRAM, layout("ops/b").layout_id) == set()
        events.close()
        text = d.metrics_text()
        assert 'kvtier_evictions_total{reason="operator",tier="dram"} 100.0' in text
        assert 'kvtier_evictions_total{reason="operator",tier="ssd"} 100.0' in text
        assert 'kvtier_operator_actions_total{action="evict"} 1.0' in text
        assert "evict by default (own tenant, model 'ops/a'): 100 block(s) removed" in d.log()
        d.stop()
        d = DaemonProc(tmp_path / "d", ARGS).start()  # the SSD tier alone serves now
        with Client(d.socket, layout=layout("ops/a")) as a, \
                Client(d.socket, layout=layout("ops/b")) as b:
            assert all(a.lookup(block_keys(p, TOKENS)).hit_blocks == 0 for p in prompts)
            assert all(b.lookup(block_keys(p, TOKENS)).tiers == [SSD] * 20 for p in prompts)
    finally:
        d.stop()


def test_evict_a_prompts_own_blocks_and_keep_the_shared_start(daemon: DaemonProc) -> None:
    system = prompt(100, 4)
    one, two = system + prompt(101, 3), system + prompt(102, 3)
    with Client(daemon.socket, layout=layout("ops/prefix")) as kv:
        store(kv, one)
        store(kv, two)
        tokens = ",".join(map(str, one))
        got = ok_json(kvtier(daemon, "evict", "--model", "ops/prefix", "--tokens", tokens,
                             "--block-tokens", str(TOKENS), "--from-token", str(len(system)),
                             "--json"))
        assert got["blocks"] == 3
        assert kv.lookup(block_keys(one, TOKENS)).hit_blocks == 4  # the shared start stays
        assert kv.lookup(block_keys(two, TOKENS)).hit_blocks == 7  # and the other branch
        # by hex keys, from the shared start on: everything under it
        hexed = block_keys(two, TOKENS)[0].hex()
        r = kvtier(daemon, "evict", "--model", "ops/prefix", "--keys", hexed)
        assert r.returncode == 0 and r.stdout.startswith("removed 7 block(s)"), r
        assert kv.lookup(block_keys(two, TOKENS)).hit_blocks == 0


def test_blocks_a_lease_holds_go_at_its_release(daemon: DaemonProc) -> None:
    p = prompt(200, 6)
    with Client(daemon.socket, layout=layout("ops/leased")) as kv, Control(daemon.socket) as ops:
        before = kv.stats().tiers[1].blocks
        keys = store(kv, p)
        wait_for(lambda: kv.stats().tiers[1].blocks == before + 6)  # no write-back holds any
        with kv.load(keys[:4]) as got:
            r = ops.evict(model_id="ops/leased")
            assert (r.blocks, r.doomed_blocks) == (2, 4)
            assert kv.lookup(keys).hit_blocks == 0  # found by no lookup from now on
            assert all(bytes(v) == payload(i).tobytes() for i, v in enumerate(got.views))
        assert kv.stats().active_leases == 0
        again = ops.evict(model_id="ops/leased")  # the release took the doomed blocks
        assert (again.blocks, again.doomed_blocks) == (0, 0)
        assert kv.store(keys, [payload(i) for i in range(6)]).stored == 6  # stores anew


def test_a_pinned_prefix_survives_floods_until_unpinned(daemon: DaemonProc) -> None:
    keep, other = prompt(300, 30), prompt(301, 30)
    with Client(daemon.socket, layout=layout("ops/pin")) as kv:
        store(kv, keep)
        store(kv, other)
        pinned = ok_json(kvtier(daemon, "pin", "--model", "ops/pin", "--tokens",
                                ",".join(map(str, keep)), "--block-tokens", str(TOKENS),
                                "--ttl", "600", "--json"))
        assert (pinned["pinned"], pinned["new_pins"]) == (30, 30)
        assert daemon.metric_sum("kvtier_pinned_blocks") == 30
        listed = ok_json(kvtier(daemon, "pins", "--json"))["namespaces"]
        assert [(n["model_id"], n["blocks"]) for n in listed] == [("ops/pin", 30)]
        assert 590 < listed[0]["first_expiry_seconds"] <= 600
        for seed in (1, 2):
            flood(kv, seed)
            keys = block_keys(keep, TOKENS)
            assert kv.lookup(keys).tiers == [DRAM] * 30  # in DRAM: never demoted either
        # the control: the unpinned prompt of the same age was flooded out of DRAM
        assert DRAM not in kv.lookup(block_keys(other, TOKENS)).tiers
        r = kvtier(daemon, "unpin", "--model", "ops/pin")
        assert (r.returncode, r.stdout.strip()) == (0, "unpinned 30 block(s)")
        flood(kv, 3)
        assert DRAM not in kv.lookup(block_keys(keep, TOKENS)).tiers
        assert kvtier(daemon, "pins").stdout.strip() == "no pins"


def test_a_pin_ends_at_its_ttl(daemon: DaemonProc) -> None:
    with Client(daemon.socket, layout=layout("ops/ttl")) as kv, Control(daemon.socket) as ops:
        keys = store(kv, prompt(400, 4))
        assert ops.pin(keys, 0.5, model_id="ops/ttl").pinned == 4
        wait_for(lambda: not ops.pins(model_id="ops/ttl"))  # the reaper ends it
        assert ops.unpin(keys, model_id="ops/ttl") == 0


def test_prefetch_brings_ssd_blocks_back_into_dram(tmp_path: Path) -> None:
    p = prompt(500, 12)
    daemon = DaemonProc(tmp_path / "d", [*ARGS, "--ssd-bytes", "256MiB"]).start()
    try:
        prefetch(daemon, p)
    finally:
        daemon.stop()


def prefetch(daemon: DaemonProc, p: list[int]) -> None:
    with Client(daemon.socket, layout=layout("ops/prefetch")) as kv:
        keys = store(kv, p)  # written back at once (admitted after 1 access)
        wait_for(lambda: kv.stats().tiers[1].blocks == 12)
        flood(kv, 5)  # the oldest DRAM blocks: demoted (the SSD tier holds all of them)
        assert kv.lookup(keys).tiers == [SSD] * 12
        got = ok_json(kvtier(daemon, "prefetch", "--model", "ops/prefetch", "--keys",
                             ",".join(k.hex() for k in keys), "--json"))
        assert (got["from_ssd"], got["in_dram"], got["missing"]) == (12, 0, 0)
        assert kv.lookup(keys).tiers == [DRAM] * 12
        assert kv.stats().active_leases == 0
        r = kvtier(daemon, "prefetch", "--model", "ops/prefetch", "--tokens",
                   ",".join(map(str, p + prompt(501, 2))), "--block-tokens", str(TOKENS))
        assert r.returncode == 0 and "12 already there, 2 not cached" in r.stdout, r


TOKENS_FILE = """\
[tenants.alice]
token = "alice-token-0001"
dram_quota = "2MiB"
[tenants.bob]
token = "bob-token-000001"
[tenants.ops]
token = "ops-token-000001"
admin = true
"""
ALICE, BOB, OPS = "alice-token-0001", "bob-token-000001", "ops-token-000001"


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[DaemonProc]:
    (tmp_path / "tokens.toml").write_text(TOKENS_FILE)
    d = DaemonProc(tmp_path / "d", [*ARGS, "--tokens-file", str(tmp_path / "tokens.toml")])
    d.start()
    try:
        yield d
    finally:
        d.stop()


def test_a_tenants_token_acts_on_its_own_blocks_only(tenants: DaemonProc) -> None:
    d = tenants
    p = prompt(600, 8)
    keys = block_keys(p, TOKENS)
    with Client(d.socket, layout=layout("ops/t"), token=ALICE) as a, \
            Client(d.socket, layout=layout("ops/t"), token=BOB) as b:
        store(a, p)
        store(b, p)
        for args in (["evict", "--model", "ops/t", "--tenant", "bob"],
                     ["clear", "--all-tenants"], ["unpin", "--tenant", "bob"]):
            r = kvtier(d, *args, token=ALICE)
            assert r.returncode == 2 and "PERMISSION_DENIED" in r.stderr, r
        assert kvtier(d, "clear", token="no-such-token").returncode == 2
        assert b.lookup(keys).hit_blocks == 8
        got = ok_json(kvtier(d, "evict", "--model", "ops/t", "--json", token=ALICE))
        assert got["blocks"] == 8
        assert (a.lookup(keys).hit_blocks, b.lookup(keys).hit_blocks) == (0, 8)
        store(a, p)
        got = ok_json(kvtier(d, "clear", "--tenant", "bob", "--json", token=OPS))
        assert got["blocks"] == 8 and (a.lookup(keys).hit_blocks, b.lookup(keys).hit_blocks) \
            == (8, 0)
        store(b, p)
        got = ok_json(kvtier(d, "evict", "--model", "ops/t", "--all-tenants", "--json",
                             token=OPS))
        assert (got["blocks"], got["namespaces"]) == (16, 2)
        assert (a.lookup(keys).hit_blocks, b.lookup(keys).hit_blocks) == (0, 0)


def test_pins_never_pass_the_tenants_quota(tenants: DaemonProc) -> None:
    """alice may hold 2 MiB (32 blocks) of DRAM: pins of 24 blocks fit, 16 more are refused
    whole (her SSD-only blocks count too: a pinned block can come back to DRAM)."""
    d = tenants
    first, second = prompt(700, 24), prompt(701, 16)
    with Client(d.socket, layout=layout("ops/q"), token=ALICE) as a, \
            Control(d.socket, token=ALICE) as ops:
        k1 = store(a, first)
        wait_for(lambda: a.stats().tiers[1].blocks == 24)  # written back: no longer held
        k2 = store(a, second)  # 8 of the first leave her DRAM (2 MiB) for SSD
        wait_for(lambda: a.stats().tiers[1].blocks == 40)
        assert ops.pin(k1, 60, model_id="ops/q").pinned == 24
        with pytest.raises(KvtierRpcError) as refused:
            ops.pin(k2, 60, model_id="ops/q")
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "over the 2097152 it may hold" in refused.value.details
        assert [p.blocks for p in ops.pins()] == [24]
        assert ops.pin(k2[:8], 60, model_id="ops/q").pinned == 8  # 32 blocks: the quota


@pytest.mark.parametrize("args,message", [
    (["evict"], "name what to evict"),
    (["evict", "--model", "m", "--keys", "abc"], "not a hex block key"),
    (["evict", "--model", "m", "--keys", "ab" * 20], "16 or 32 bytes"),
    (["evict", "--model", "m", "--tokens", "1,2"], "needs --block-tokens"),
    (["evict", "--model", "m", "--tokens", "1,x", "--block-tokens", "16"], "integers"),
    (["evict", "--model", "m", "--tokens", "1,2", "--block-tokens", "16"], "no full block"),
    (["evict", "--layout", "abcd"], "32 bytes"),
    (["evict", "--model", "m", "--keys", "00" * 32, "--tokens", "1"], "one way"),
    (["pin", "--model", "m", "--keys", "00" * 32, "--ttl", "0"], "--ttl must be a positive"),
    (["pin", "--model", "m", "--ttl", "5"], "name the prefix"),
    (["pin", "--model", "nobody", "--keys", "00" * 32, "--ttl", "5"], "NOT_FOUND"),
    (["pin", "--model", "ops/bad", "--keys", "00" * 32, "--ttl", "1e9"], "INVALID_ARGUMENT"),
    (["prefetch", "--model", "m"], "name the prefix"),
    (["clear", "--tenant", "x", "--all-tenants"], "not both"),
    (["clear", "--tenant", "nobody"], "NOT_FOUND"),
    (["evict", "--model", "m", "--tokens-file", "/nonexistent.json", "--block-tokens", "16"],
     "No such file"),
])
def test_bad_input_is_one_line_and_exit_2(daemon: DaemonProc, args: list[str],
                                          message: str) -> None:
    with Client(daemon.socket, layout=layout("ops/bad")) as kv:
        keys = store(kv, prompt(800, 3))
        before = kv.stats()
        r = kvtier(daemon, *args)
        assert r.returncode == 2, r
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith(f"kvtier {args[0]}: error: ")
        assert kv.lookup(keys).hit_blocks == 3 and kv.stats().tiers[0] == before.tiers[0]
        assert daemon.healthy()


def test_bad_requests_over_grpc_change_nothing(daemon: DaemonProc) -> None:
    with Client(daemon.socket, layout=layout("ops/grpc")) as kv:
        keys = store(kv, prompt(900, 3))
        stub = pb_grpc.KvTierStub(kv._channel)  # type: ignore[no-untyped-call]
        lid = kv.layout.layout_id
        for method, request, code in [
            (stub.Evict, pb.EvictRequest(), "INVALID_ARGUMENT"),
            (stub.Evict, pb.EvictRequest(scope=pb.Selector(layout=lid), keys=b"x" * 33,
                                         key_width=32), "INVALID_ARGUMENT"),
            (stub.Evict, pb.EvictRequest(scope=pb.Selector(layout=lid), keys=b"x" * 32,
                                         key_width=32, clear=True), "INVALID_ARGUMENT"),
            (stub.Pin, pb.PinRequest(scope=pb.Selector(layout=lid), keys=b"".join(keys),
                                     key_width=32, ttl_seconds=-1), "INVALID_ARGUMENT"),
            (stub.Pin, pb.PinRequest(scope=pb.Selector(layout=lid), keys=b"".join(keys),
                                     key_width=16, ttl_seconds=5), "INVALID_ARGUMENT"),
            (stub.Prefetch, pb.PrefetchRequest(scope=pb.Selector(layout=b"\x00" * 32),
                                               keys=b"".join(keys), key_width=32),
             "NOT_FOUND"),
            (stub.Unpin, pb.UnpinRequest(scope=pb.Selector(tenant="nobody")), "NOT_FOUND"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                method(request, timeout=10)
            assert err.value.code().name == code, (request, err.value.details())
        assert kv.lookup(keys).hit_blocks == 3 and not Control(daemon.socket).pins()
