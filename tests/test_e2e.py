"""End to end: the reference engine served through a real daemon process returns exactly the logits
of full recompute (fp32, bit for bit) whatever kvtier does — DRAM hits, SSD hits after a restart,
hits after evictions and demotions, another engine process's blocks, a corrupted SSD block, the
daemon killed mid-request."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvtier._proto import kvtier_pb2 as pb  # noqa: E402
from kvtier.core.types import Tier  # noqa: E402
from kvtier.engine import Engine, Sequence, get_config  # noqa: E402
from kvtier.engine.kvtier_adapter import (  # noqa: E402
    KvtierEngine,
    LinkOptions,
    ServeResult,
    slot_window,
)
from tests.daemon_fixture import ROOT, DaemonProc  # noqa: E402

CFG = get_config("tiny")
B = CFG.block_tokens


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def kvd(tmp_path: Path) -> Iterator[DaemonProc]:
    """A daemon process on the fixture's small defaults."""
    d = DaemonProc(tmp_path / "d").start()
    try:
        yield d
    finally:
        d.stop()


def rand_tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    out: list[int] = torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()
    return out


class Checked:
    """A replica plus an independent reference engine (same weights) for full recompute.

    The planner is off unless asked for: its choice depends on measured rates (timing), and
    these tests assert which blocks are loaded. `test_planner_on_...` covers the planner.
    """

    def __init__(self, socket: Path, num_blocks: int = 256, **opts: Any) -> None:
        options = {"socket": socket, "timeout_s": 5.0, "use_plan": False, **opts}
        self.replica = KvtierEngine(Engine(CFG, num_blocks), LinkOptions(**options))
        self.reference = Engine(CFG, num_blocks)

    def serve(self, prompt: list[int], decode: int = 0) -> tuple[ServeResult, list[int]]:
        out = self.replica.serve(prompt)
        ref_seq = Sequence()
        ref = self.reference.prefill(ref_seq, prompt).logits
        assert torch.equal(out.logits, ref), describe_failure(out)
        reply: list[int] = []
        if decode:
            reply, steps = self.replica.engine.greedy(out.seq, out.logits, decode)
            ref_reply, ref_steps = self.reference.greedy(ref_seq, ref, decode)
            assert reply == ref_reply
            assert all(torch.equal(a, b) for a, b in zip(steps, ref_steps, strict=True))
        self.replica.engine.release(out.seq)
        self.reference.release(ref_seq)
        assert self.replica.engine.pool.num_free == self.replica.engine.pool.num_blocks
        return out, reply

    def close(self) -> None:
        self.replica.close()


def describe_failure(out: ServeResult) -> str:
    return f"logits differ from full recompute: {out._replace(logits=None, seq=None)}"


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def metric_sum(text: str, name: str, label: str) -> float:
    """Sum of the samples of `name` whose labels contain `label` (Prometheus text format)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def ssd_blocks(replica: KvtierEngine) -> int:
    client = replica.client()
    assert client is not None
    return int(next(t.blocks for t in client.stats().tiers if t.tier == pb.TIER_SSD))


def test_multi_turn_chat_and_shared_system_prompt_dram_hits(kvd: DaemonProc) -> None:
    c = Checked(kvd.socket)
    system = rand_tokens(3 * B, seed=1)
    # Multi-turn chat: each turn's prompt is the previous prompt + the reply + a new message.
    prompt = system + rand_tokens(10, seed=2)
    first, reply = c.serve(prompt, decode=6)
    assert first.loaded_blocks == 0 and first.stored_blocks == len(prompt) // B
    for turn in range(3):
        prompt = prompt + reply + rand_tokens(7 + turn, seed=10 + turn)
        out, reply = c.serve(prompt, decode=6)
        assert out.fallback == ""
        assert out.loaded_blocks >= 3 and set(out.loaded_tiers) == {Tier.DRAM}
        assert out.computed_tokens == len(prompt) - out.loaded_blocks * B
    # Other users with the same system prompt: its 3 blocks come from DRAM.
    for user in range(3):
        out, _ = c.serve(system + rand_tokens(5 + user, seed=20 + user))
        assert out.loaded_tiers == (Tier.DRAM,) * 3
    # A prompt that is exactly cached blocks still computes its last block for the logits.
    out, _ = c.serve(system)
    assert out.loaded_blocks == 2 and out.computed_tokens == B
    # A one-block prompt has nothing to look up but its block is stored for longer prompts.
    one = rand_tokens(B, seed=30)
    out, _ = c.serve(one)
    assert (out.hit_blocks, out.stored_blocks) == (0, 1)
    out, _ = c.serve(one + rand_tokens(3, seed=31))
    assert out.loaded_blocks == 1
    c.close()


def window_spy(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records, per copy, whether the slots were addressed in place (True) or staged (False)."""
    from kvtier.engine import kvtier_adapter

    seen: list[bool] = []
    real = kvtier_adapter.slot_window

    def spy(buffer: Any, slots: Any) -> Any:
        got = real(buffer, slots)
        seen.append(got is not None)
        return got

    monkeypatch.setattr(kvtier_adapter, "slot_window", spy)
    return seen


def test_shared_memory_slots_are_copied_in_place(kvd: DaemonProc,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    seen = window_spy(monkeypatch)
    c = Checked(kvd.socket)
    system = rand_tokens(4 * B, seed=33)
    first, _ = c.serve(system + rand_tokens(3, seed=34))  # store: gather into slots
    out, _ = c.serve(system + rand_tokens(5, seed=35))  # load: scatter from slots
    assert first.stored_blocks == 4 and out.loaded_blocks == 4
    assert seen and all(seen)  # no staging copy on the shared-memory path
    c.close()


def test_a_tenant_engine_copies_in_place_through_its_own_mapping(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a tokens file the engine maps its tenant's memory (handed over by fd, issue 25) and
    still copies slots in place, bit-exact."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tenants.a]\ntoken = "engine-a-token"\n\n'
                      '[tenants.b]\ntoken = "engine-b-token"\n')
    d = DaemonProc(tmp_path / "d", ["--tokens-file", str(tokens)]).start()
    try:
        seen = window_spy(monkeypatch)
        c = Checked(d.socket, token="engine-a-token")
        system = rand_tokens(4 * B, seed=36)
        first, _ = c.serve(system + rand_tokens(3, seed=37))
        out, _ = c.serve(system + rand_tokens(5, seed=38))
        assert first.stored_blocks == 4 and out.loaded_blocks == 4
        client = c.replica.client()
        assert client is not None and client.uses_shm
        assert client._segment is not None and client._segment.info.by_fd
        assert seen and all(seen)
        c.close()
    finally:
        d.stop()


def test_bf16_engine_through_kvtier_is_bit_exact(kvd: DaemonProc) -> None:
    cfg = CFG.with_dtype("bfloat16")
    replica = KvtierEngine(Engine(cfg, 64), LinkOptions(socket=kvd.socket, use_plan=False))
    reference = Engine(cfg, 64)
    system = rand_tokens(3 * B, seed=36)
    for i, extra in enumerate((5, 9, 14)):
        prompt = system + rand_tokens(extra, seed=37 + i)
        out = replica.serve(prompt)
        assert out.loaded_blocks == (3 if i else 0)
        assert torch.equal(out.logits, reference.prefill(Sequence(), prompt).logits)
        replica.engine.release(out.seq)
    replica.close()


def test_planner_on_serves_its_cut_and_stays_exact(kvd: DaemonProc) -> None:
    c = Checked(kvd.socket, use_plan=True)
    system = rand_tokens(6 * B, seed=38)
    for i in range(4):  # the first requests teach the daemon this engine's prefill rate
        out, _ = c.serve(system + rand_tokens(20 + i, seed=39 + i))
        assert out.plan_reason and out.fallback == ""
        assert out.loaded_blocks == out.planned_blocks <= out.hit_blocks
        assert out.computed_tokens == len(system) + 20 + i - out.loaded_blocks * B
    assert out.hit_blocks == 6
    c.close()


def test_streaming_path_without_shared_memory(kvd: DaemonProc,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    seen = window_spy(monkeypatch)
    c = Checked(kvd.socket, streaming=True)
    assert c.replica.client() is not None and not c.replica.client().uses_shm  # type: ignore[union-attr]
    system = rand_tokens(4 * B, seed=30)
    c.serve(system + rand_tokens(3, seed=31))
    out, _ = c.serve(system + rand_tokens(9, seed=32))
    assert out.loaded_tiers == (Tier.DRAM,) * 4 and out.fallback == ""
    assert seen == [False]  # the streamed blocks went through a staging array
    c.close()


def test_ssd_hits_after_daemon_restart(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d", ["--ssd-admit-after", "1"]).start()
    try:
        c = Checked(d.socket)
        doc = rand_tokens(5 * B, seed=40)
        first, _ = c.serve(doc + rand_tokens(4, seed=41))
        wait_for(lambda: ssd_blocks(c.replica) >= first.stored_blocks)
        assert d.stop() == 0
        d.start()
        out, _ = c.serve(doc + rand_tokens(11, seed=42))
        assert out.loaded_tiers == (Tier.SSD,) * 5 and out.fallback == ""
        out, _ = c.serve(doc + rand_tokens(2, seed=43))
        assert out.loaded_tiers == (Tier.DRAM,) * 5  # promoted by the first SSD hit
        c.close()
    finally:
        d.stop()


def test_hits_after_evictions_and_demotions(tmp_path: Path) -> None:
    # 16 DRAM slots of 16 KiB; a tiny block is 8 KiB (2·2 layers·16 tokens·2 heads·16 dims·4 B).
    d = DaemonProc(tmp_path / "d", ["--dram-bytes", "256KiB", "--slot-bytes", "16KiB",
                                    "--ssd-admit-after", "1"]).start()
    try:
        c = Checked(d.socket)
        docs = [rand_tokens(4 * B, seed=50 + i) for i in range(8)]  # 32 blocks > 16 slots
        for i, doc in enumerate(docs):
            c.serve(doc + rand_tokens(3, seed=60 + i))
        assert metric_sum(d.metrics_text(), "kvtier_evictions_total", 'tier="dram"') > 0
        seen: set[Tier] = set()
        for i, doc in enumerate(docs):
            out, _ = c.serve(doc + rand_tokens(5, seed=70 + i))
            seen.update(out.loaded_tiers)
            assert out.fallback == ""
        assert Tier.SSD in seen, "no block was served from SSD after demotion"
        c.close()
    finally:
        d.stop()


CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
from kvtier.engine import Engine, get_config
from kvtier.engine.kvtier_adapter import KvtierEngine, LinkOptions, describe
socket, prompts, out_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
replica = KvtierEngine(Engine(get_config("tiny"), 256),
                       LinkOptions(socket=socket, use_plan=False))
results = []
for p in prompts:
    r = replica.serve(p)
    results.append({**describe(r), "logits": r.logits.tolist()})
    replica.engine.release(r.seq)
json.dump(results, open(out_path, "w"))
"""


def run_child(socket: Path, prompts: list[list[int]], out: Path) -> list[dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", CHILD, str(socket), json.dumps(prompts), str(out)],
                   check=True, env=env, timeout=120)
    result: list[dict[str, object]] = json.loads(out.read_text())
    return result


def test_two_engine_processes_share_one_daemon(kvd: DaemonProc, tmp_path: Path) -> None:
    system = rand_tokens(4 * B, seed=80)
    # Process 1 computes and stores the system prompt's blocks.
    run_child(kvd.socket, [system + rand_tokens(6, seed=81)], tmp_path / "a.json")
    # This process hits them.
    c = Checked(kvd.socket)
    mine = system + rand_tokens(20, seed=82)
    out, _ = c.serve(mine)
    assert out.loaded_tiers == (Tier.DRAM,) * 4 and out.stored_blocks == 1
    # Process 2 hits this process's 5th block too; its logits equal our full recompute.
    prompt = mine + rand_tokens(9, seed=83)
    got = run_child(kvd.socket, [prompt], tmp_path / "b.json")[0]
    assert got["loaded_blocks"] == 5
    ref = c.reference.prefill(Sequence(), prompt).logits
    assert torch.equal(torch.tensor(got["logits"], dtype=torch.float32), ref)
    c.close()


def block_payload(engine: Engine, block: int) -> bytes:
    """A pool block in the slot layout [K_0 | V_0 | K_1 | V_1 ...] (see kvtier.gpu.transfer)."""
    parts = []
    for k, v in zip(engine.pool.k, engine.pool.v, strict=True):
        parts += [k[block].numpy().tobytes(), v[block].numpy().tobytes()]
    return b"".join(parts)


def test_corrupted_ssd_block_is_detected_and_recomputed(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d", ["--ssd-admit-after", "1"]).start()
    try:
        c = Checked(d.socket)
        doc = rand_tokens(5 * B, seed=90)
        out = c.replica.serve(doc + rand_tokens(3, seed=91))
        victim = block_payload(c.replica.engine, out.seq.block_table[2])
        c.replica.engine.release(out.seq)
        wait_for(lambda: ssd_blocks(c.replica) >= 5)
        assert d.stop() == 0
        # the payload lives in the SSD slot file (or an LMDB value): find it wherever it is
        (data_file,) = [f for f in d.data_dir.rglob("*") if f.is_file()
                        and victim in f.read_bytes()]
        raw = data_file.read_bytes()
        off = raw.find(victim)
        assert off >= 0 and raw.find(victim, off + 1) < 0
        with open(data_file, "r+b") as f:  # flip one bit in the middle of block 2's payload
            f.seek(off + len(victim) // 2)
            byte = f.read(1)[0]
            f.seek(off + len(victim) // 2)
            f.write(bytes([byte ^ 0x10]))
        d.start()
        out2, _ = c.serve(doc + rand_tokens(8, seed=92))
        assert out2.loaded_tiers == (Tier.SSD,) * 2  # blocks 0-1; block 2 failed verification
        assert out2.computed_tokens == 3 * B + 8
        assert "kvtier_checksum_failures_total 1.0" in d.metrics_text()
        c.close()
    finally:
        d.stop()


@pytest.mark.parametrize("stage", ["lookup_done", "acquired", "prefilled"])
def test_daemon_killed_mid_request_recomputes_correctly(
        tmp_path: Path, stage: str, caplog: pytest.LogCaptureFixture) -> None:
    d = DaemonProc(tmp_path / "d").start()
    try:
        c = Checked(d.socket, timeout_s=2.0, retry_after_s=30.0)
        system = rand_tokens(4 * B, seed=100)
        c.serve(system + rand_tokens(2, seed=101))

        def kill(name: str) -> None:
            if name == stage:
                d.kill()

        c.replica.on_stage = kill
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            out, _ = c.serve(system + rand_tokens(7, seed=102), decode=4)
        assert caplog.text.count("kvtier unavailable") == 1  # the outage's one warning
        caplog.clear()
        if stage == "prefilled":  # loaded fine; the report and store fail after the answer
            assert out.loaded_blocks == 4 and out.stored_blocks == 0 and out.fallback == ""
        else:
            assert out.fallback and out.loaded_blocks == 0 and out.computed_tokens == 4 * B + 7
        # The next request does not try the dead daemon again (retry_after_s 30 s: no second
        # "unavailable" warning, which any attempt would log) and is still right.
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            out, _ = c.serve(system + rand_tokens(5, seed=103))
        assert out.hit_blocks == 0 and "kvtier unavailable" not in caplog.text
        assert out.fallback.startswith("kvtier unavailable")
        c.close()
    finally:
        d.kill()


def test_slot_window_addresses_slots_in_place() -> None:
    import numpy as np

    from kvtier.client.sync_client import SlotBuffer

    seg = np.zeros(4096 + 10 * 8192, dtype=np.uint8)
    buf = SlotBuffer(seg, data_offset=4096, slot_count=10, slot_bytes=5000, slot_stride=8192,
                     generation=1)
    win = slot_window(buf, [7, 2, 4])
    assert win is not None
    arr, rows = win
    # slots 2..7 -> 6 rows of 5000 B every 8192 B; slot 7 is row 5, slot 2 row 0, slot 4 row 2.
    assert rows == [5, 0, 2] and arr.shape == (6, 5000) and arr.strides == (8192, 1)
    arr[5, :3] = 9
    assert seg[4096 + 7 * 8192 : 4096 + 7 * 8192 + 4].tolist() == [9, 9, 9, 0]
    assert slot_window(None, [1]) is None and slot_window(buf, []) is None
