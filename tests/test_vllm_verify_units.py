"""Shadow verification in the connector without an engine: the comparison (`common/verify.py`:
numerical spread within the tolerance, wrong KV outside it, non-finite values, integer pages),
the regions a block is compared by (a state block's state tensors, never vLLM's padding; a chain
block's state pages skipped), the scheduler's sampling (a sampled hit answers 0 and its saves
carry what to compare), and the worker against a real daemon: a matching block is counted, a
wrong one is quarantined on the daemon and replaced by the recomputed KV."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtier.client.sync_client import Client
from kvtier.core.keys import block_keys
from tests.daemon_fixture import DaemonProc, daemon  # noqa: F401  (the fixture)

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.kv_cache_interface")

from kvtier.integrations.common.verify import (  # noqa: E402
    TOLERANCES,
    Region,
    check_block,
    region_error,
)
from kvtier.integrations.vllm.layout import EngineKV, Shard, state_parts  # noqa: E402
from kvtier.integrations.vllm.metadata import KvtierMetadata, SaveJob, VerifyRef  # noqa: E402
from kvtier.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvtier.integrations.vllm.settings import ConnectorSettings, SettingsError  # noqa: E402
from kvtier.integrations.vllm.worker import WorkerSide  # noqa: E402

BT, PAGE, BLOCKS = 32, 512, 16


def kv(**over: Any) -> EngineKV:
    base: dict[str, Any] = dict(model_id="m@verify", dtype="bfloat16", block_tokens=BT,
                                layer_names=("l0", "l1"), page_bytes=PAGE, kv_heads=1,
                                head_size=64, backend="cpu", shard=Shard(0, 1, True))
    base.update(over)
    return EngineKV(**base)


def bf16(values: Any) -> Any:
    return torch.as_tensor(values, dtype=torch.float32).to(torch.bfloat16).view(torch.uint8)


def test_numerical_spread_matches_and_wrong_kv_does_not() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, generator=g) * 0.5
    r = Region(0, "full", 0, 512, "bfloat16")
    assert region_error(bf16(x), bf16(x), r).rel_l2 == 0.0
    noisy = x * (1 + 1e-3 * torch.randn(256, generator=g))  # a few bf16 ulps, as a re-batch
    e = region_error(bf16(noisy), bf16(x), r)
    assert 0 < e.rel_l2 < TOLERANCES["full"].rel_l2 and e.rel_max < TOLERANCES["full"].rel_max
    other = torch.randn(256, generator=g) * 0.5  # another prompt's, another weights' KV
    e = region_error(bf16(other), bf16(x), r)
    assert e.rel_l2 > 20 * TOLERANCES["full"].rel_l2
    one = x.clone()
    one[17] = 40.0  # one element wrong (a flipped exponent bit): the worst element shows it
    e = region_error(bf16(one), bf16(x), r)
    assert e.rel_max > TOLERANCES["full"].rel_max


def test_non_finite_values_and_integer_pages() -> None:
    r = Region(0, "full", 0, 8, "bfloat16")
    a = bf16([1.0, 2.0, math.nan, 4.0])
    assert region_error(a, a.clone(), r).rel_l2 == 0.0  # the same NaN on both sides
    assert region_error(a, bf16([1.0, 2.0, 3.0, 4.0]), r).rel_l2 == math.inf
    assert region_error(bf16([1.0, math.inf, 3.0, 4.0]), bf16([1.0, 2.0, 3.0, 4.0]),
                        r).rel_max == math.inf
    ints = Region(0, "full", 0, 4, "uint8")
    raw = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert region_error(raw, raw.clone(), ints).rel_l2 == 0.0
    assert region_error(raw, raw + 1, ints).rel_l2 == math.inf  # no numerics known: exact


def test_a_state_block_compares_the_state_tensors_and_never_the_padding() -> None:
    shape = "3x8:bfloat16+2x4x4:float32"
    assert state_parts(shape) == [(0, 48, "bfloat16"), (48, 176, "float32")]
    k = kv(layer_names=("s0", "a1"), layer_groups=(0, 1), windows=(0, 0), hash_tokens=BT,
           states=(shape, ""))
    assert k.verify_regions() == [Region(1, "hybrid", PAGE, 2 * PAGE, "bfloat16")]
    assert k.verify_regions(state_block=True) == [
        Region(0, "state", 0, 48, "bfloat16"), Region(0, "state", 48, 176, "float32"),
        Region(1, "hybrid", PAGE, 2 * PAGE, "bfloat16")]
    g = torch.Generator().manual_seed(1)
    block = bf16(torch.randn(PAGE, generator=g))  # two pages of bf16
    other = block.clone()
    other[200:PAGE] = 7  # vLLM's padding after the state: never compared
    assert check_block(other, block, k.verify_regions(True)).ok
    other[10] ^= 0x40  # inside the state
    bad = check_block(other, block, k.verify_regions(True))
    assert not bad.ok and bad.first_bad is not None and bad.first_bad.region.kind == "state"
    swa = kv(layer_groups=(0, 1), windows=(0, 64), hash_tokens=BT)
    assert [r.kind for r in swa.verify_regions()] == ["full", "swa"]


def test_a_hybrid_models_attention_pages_take_their_spread_and_still_refuse_wrong_kv() -> None:
    """An attention page of a model with state layers: the right KV's spread measured there
    (bench.verify_fp: relative L2 up to 0.062, single elements up to 0.48 of the page's largest)
    matches under "hybrid" though not under "full"; other KV of the same scale never does."""
    g = torch.Generator().manual_seed(3)
    stored = torch.randn(2048, generator=g)
    computed = stored + 0.06 * torch.randn(2048, generator=g)
    computed[17] += 0.48 * float(stored.abs().max())
    a, b = bf16(computed), bf16(stored)
    n = a.numel()
    assert not check_block(a, b, [Region(0, "full", 0, n, "bfloat16")]).ok
    assert check_block(a, b, [Region(0, "hybrid", 0, n, "bfloat16")]).ok
    other = bf16(torch.randn(2048, generator=g))
    wrong = check_block(other, b, [Region(0, "hybrid", 0, n, "bfloat16")])
    assert not wrong.ok and wrong.first_bad is not None and wrong.first_bad.rel_l2 > 1.0


def test_verify_sample_is_checked_and_sampling_is_a_fixed_function_of_the_id() -> None:
    with pytest.raises(SettingsError, match="verify_sample within"):
        ConnectorSettings.from_extra({"verify_sample": 1.5})
    assert ConnectorSettings().verify_sample == 0.01

    def sched(rate: float) -> SchedulerSide:
        s = ConnectorSettings.from_extra({"socket": "/nonexistent/kvtier.sock",
                                          "verify_sample": rate})
        return SchedulerSide(s, kv(), 1, 1, False)

    ids = [f"req-{i}" for i in range(2000)]
    none, every, some = sched(0.0), sched(1.0), sched(0.1)
    assert not any(map(none.sampled, ids)) and all(map(every.sampled, ids))
    picked = [i for i in ids if some.sampled(i)]
    assert 150 < len(picked) < 250 and picked == [i for i in ids if some.sampled(i)]
    for s in (none, every, some):
        s.close()


class Req(SimpleNamespace):
    kv_transfer_params: dict[str, object] | None = None  # vLLM's Request has it (None: no hints)


def test_a_sampled_hit_is_computed_and_its_saves_carry_what_to_compare(
        daemon: DaemonProc) -> None:  # noqa: F811
    k = kv()
    toks = list(range(3, 3 + 5 * BT + 7))
    keys = block_keys(toks, BT)
    with Client(daemon.socket, layout=k.decl()) as c:
        c.store(keys[:3], [np.zeros(k.block_bytes, np.uint8)] * 3)
    s = ConnectorSettings.from_extra({"socket": str(daemon.socket), "async_lookup": False,
                                      "use_plan": False, "verify_sample": 1.0})
    sch = SchedulerSide(s, k, 1, 1, False)
    req = Req(request_id="r", num_computed_tokens=0, block_hashes=keys, num_tokens=len(toks),
              num_prompt_tokens=len(toks))
    assert sch.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
    sch.update_state_after_alloc(req, SimpleNamespace(blocks=()), 0)  # type: ignore[arg-type]
    ids = ([20, 21, 22, 23, 24, 25],)
    state = SimpleNamespace(get_block_ids=lambda r: ids)
    # chunked prefill: blocks 0-1 in the first step, 2-4 in the second
    first = sch._saves(SimpleNamespace(num_scheduled_tokens={"r": 2 * BT},  # type: ignore[arg-type]
                                       kv_connector_block_state=state))
    req.num_computed_tokens = 2 * BT
    second = sch._saves(SimpleNamespace(num_scheduled_tokens={"r": 3 * BT + 7},  # type: ignore[arg-type]
                                        kv_connector_block_state=state))
    assert first[0].verify == VerifyRef(keys[:2], 0)
    assert second[0].keys == keys[2:5] and second[0].verify == VerifyRef(keys[:3], 2)
    sch.close()
    plain = SchedulerSide(ConnectorSettings.from_extra(
        {"socket": str(daemon.socket), "async_lookup": False, "use_plan": False,
         "verify_sample": 0.0}), k, 1, 1, False)
    assert plain.get_num_new_matched_tokens(req, 0) == (3 * BT, False)  # type: ignore[arg-type]
    plain.close()


def caches(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {n: bf16(torch.randn(BLOCKS, PAGE // 2, generator=g) * 0.3).view(BLOCKS, PAGE)
            for n in ("l0", "l1")}


def test_the_worker_counts_a_match_and_quarantines_a_mismatch(
        daemon: DaemonProc, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    k = kv()
    s = ConnectorSettings.from_extra({"socket": str(daemon.socket), "async_save": False})
    keys = block_keys(list(range(3, 3 + 4 * BT)), BT)
    stored = caches(1)
    w1 = WorkerSide(s, k, 0)
    w1.register_kv_caches(stored)
    w1.wait_for_save(KvtierMetadata(saves=[SaveJob("r", [1, 2, 3, 4], keys, b"")]))
    w1.close()
    # the same blocks recomputed: block 2 (vLLM block 7) numerically close, block 3 wrong
    again = {n: c.clone() for n, c in stored.items()}
    for n, c in again.items():
        c[5:8] = stored[n][1:4]
        vals = c[7].view(torch.bfloat16).float()
        c[7] = (vals * 1.002).to(torch.bfloat16).view(torch.uint8)
        c[8] = caches(2)[n][8]
    w2 = WorkerSide(s, k, 0)
    w2.register_kv_caches(again)
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations.vllm"):
        w2.wait_for_save(KvtierMetadata(saves=[
            SaveJob("q", [5, 6, 7, 8], keys, b"", verify=VerifyRef(keys, 0))]))
    got = w2.stats.take()
    assert (got["verified_blocks"], got["verify_mismatched_blocks"]) == (4, 1)
    assert "kvtier verify: MISMATCH" in caplog.text and "block 3 of request q" in caplog.text
    assert "m@verify" in caplog.text
    with Client(daemon.socket, layout=k.decl()) as c:
        st = c.stats()
        assert (st.verify_verified_blocks, st.verify_mismatched_blocks,
                st.verify_quarantined_blocks) == (4, 1, 1)
        with c.load(keys) as held:  # the recomputed KV stored in the wrong block's place
            assert held.blocks == 4
            assert bytes(held.views[3][:PAGE]) == again["l0"][8].numpy().tobytes()
            assert bytes(held.views[2][:PAGE]) == stored["l0"][3].numpy().tobytes()
    w2.close()
