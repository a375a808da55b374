"""Pure parts of the vLLM connector: extra-config parsing, TP shards, the layout fingerprint."""

from __future__ import annotations

import pytest

from kvtier.integrations.vllm.layout import EngineKV, Shard, hash_width, kv_shard
from kvtier.integrations.vllm.settings import ConnectorSettings, SettingsError


def test_defaults_and_coercion() -> None:
    assert ConnectorSettings.from_extra(None) == ConnectorSettings()
    s = ConnectorSettings.from_extra({"socket": "/s", "timeout_s": 2, "use_plan": "false",
                                      "store": False, "retry_after_s": "0.5"})
    assert (s.socket, s.timeout_s, s.use_plan, s.store, s.retry_after_s) == (
        "/s", 2.0, False, False, 0.5)


@pytest.mark.parametrize(("extra", "needle"), [
    ({"sokcet": "/s"}, "unknown kv_connector_extra_config key(s) ['sokcet']"),
    ({"timeout_s": "soon"}, "['timeout_s'] must be a float"),
    ({"use_plan": 3}, "['use_plan'] must be a bool"),
    ({"socket": 5}, "['socket'] must be a str"),
    ({"timeout_s": 0}, "timeout_s and save_buffer_mib must be > 0"),
    ({"lease_ttl_s": -1}, "lease_ttl_s, prefill_report_s and pending_wait_s >= 0"),
    ({"save_buffer_mib": 0}, "save_buffer_mib must be > 0"),
    ({"async_lookup": "maybe"}, "['async_lookup'] must be a bool"),
])
def test_bad_extra_config_names_the_key(extra: dict[str, object], needle: str) -> None:
    with pytest.raises(SettingsError) as err:
        ConnectorSettings.from_extra(extra)
    assert needle in str(err.value)


@pytest.mark.parametrize(("tp", "heads", "replicated", "want"), [
    (1, 8, False, [(0, 1, True)]),
    (4, 8, False, [(0, 4, True), (1, 4, True), (2, 4, True), (3, 4, True)]),
    # TP 8 over 2 KV heads: ranks 0-3 hold head 0, ranks 4-7 head 1; the first of each stores
    (8, 2, False, [(0, 2, True)] + [(0, 2, False)] * 3 + [(1, 2, True)] + [(1, 2, False)] * 3),
    (4, 1, True, [(0, 1, True)] + [(0, 1, False)] * 3),  # MLA: every rank holds the whole cache
])
def test_kv_shards(tp: int, heads: int, replicated: bool,
                   want: list[tuple[int, int, bool]]) -> None:
    assert [tuple(kv_shard(tp, r, heads, replicated)) for r in range(tp)] == want


def test_bad_rank_is_refused() -> None:
    with pytest.raises(ValueError):
        kv_shard(2, 2, 8)


def kv(**over: object) -> EngineKV:
    base: dict[str, object] = dict(model_id="m@r", dtype="bfloat16", block_tokens=32,
                                   layer_names=("l0", "l1"), page_bytes=16384, kv_heads=2,
                                   head_size=64, backend="cpu", shard=Shard(0, 1, True))
    base.update(over)
    return EngineKV(**base)  # type: ignore[arg-type]


def test_fingerprint_covers_what_shapes_the_bytes() -> None:
    a = kv()
    assert 8 <= len(a.fingerprint()) <= 64 and a.block_bytes == 2 * 16384
    assert a.decl().block_bytes == a.block_bytes and a.decl().key_width == 32
    others = [kv(dtype="float16"), kv(block_tokens=64), kv(layer_names=("l0",)),
              kv(page_bytes=8192), kv(kv_heads=1), kv(head_size=128), kv(backend="cuda"),
              kv(shard=Shard(1, 2, True)), kv(key_width=16), kv(kv_cache="fp8/FP8_PER_TENSOR"),
              kv(kv_cache="fp8_per_token_head/FP8_PER_TOKEN_HEAD"), kv(hash_algo="sha256"),
              kv(pp=(1, 2)), kv(model_id="other@r")]
    prints = {o.fingerprint() for o in others if o.model_id == a.model_id}
    assert a.fingerprint() not in prints and len(prints) == len(others) - 1
    # the weights are named by the model id, which the layout id (the namespace) covers
    assert len({o.decl().layout_id for o in [a, *others]}) == len(others) + 1
    assert kv(shard=Shard(0, 1, False)).fingerprint() == a.fingerprint()  # same bytes, same blocks
    assert a.for_shard(Shard(1, 2, True)).fingerprint() == kv(shard=Shard(1, 2, True)).fingerprint()


def test_hash_width() -> None:
    assert [hash_width(a) for a in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")] == [
        32, 32, 16, 16]


def test_vllm_page_lists_every_key_with_its_default() -> None:
    import dataclasses
    import json
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "vllm.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]*) \|", page, re.M))
    for f in dataclasses.fields(ConnectorSettings):
        assert f.name in rows, f"docs/vllm.md lacks key {f.name!r}"
        if not isinstance(f.default, str):  # str defaults are described ("" = ...)
            assert rows[f.name].startswith(f"`{json.dumps(f.default)}`"), (f.name, rows[f.name])


@pytest.mark.parametrize(("params", "want", "warning"), [
    (None, (0.0, True, False), ""),
    ({"do_remote_prefill": True}, (0.0, True, False), ""),  # another connector's: not ours
    ({"kvtier": {"pin_s": 600, "store": False, "prefetch": True}}, (600.0, False, True), ""),
    ({"kvtier": {"pin_s": 1.5}}, (1.5, True, False), ""),
    ({"kvtier": {"pin": 60, "store": False}}, (0.0, False, False), "unknown key(s) 'pin'"),
    ({"kvtier": {"pin_s": "600"}}, (0.0, True, False), "pin_s must be a number"),
    ({"kvtier": {"pin_s": -1, "prefetch": True}}, (0.0, True, True), "pin_s must be a number"),
    ({"kvtier": {"pin_s": float("inf")}}, (0.0, True, False), "pin_s must be a number"),
    ({"kvtier": {"pin_s": True}}, (0.0, True, False), "pin_s must be a number"),
    ({"kvtier": {"store": "no"}}, (0.0, True, False), "store must be true or false"),
    ({"kvtier": {"prefetch": 1}}, (0.0, True, False), "prefetch must be true or false"),
    ({"kvtier": [600]}, (0.0, True, False), "expected an object"),
])
def test_request_hints_are_read_or_ignored_with_one_warning(
        params: object, want: tuple[float, bool, bool], warning: str,
        caplog: pytest.LogCaptureFixture) -> None:
    from kvtier.integrations.common.hints import parse_hints

    with caplog.at_level("WARNING", logger="kvtier.integrations.common"):
        got = parse_hints(params, "request r7")
    assert (got.pin_s, got.store, got.prefetch) == want
    lines = [r.getMessage() for r in caplog.records]
    if warning:
        assert len(lines) == 1 and "request r7" in lines[0] and warning in lines[0], lines
    else:
        assert lines == []


@pytest.mark.parametrize(("kv_role", "extra", "want"), [
    ("kv_both", {}, (True, True, False, 0.0, True)),
    ("kv_producer", {}, (False, True, True, 0.0, True)),
    ("kv_consumer", {}, (True, False, False, 5.0, False)),
    ("kv_consumer", {"pending_wait_s": 0.5, "use_plan": True}, (True, False, False, 0.5, True)),
    ("kv_consumer", {"store": False}, (True, False, False, 5.0, False)),
    ("kv_both", {"store": False, "pending_wait_s": 9}, (True, False, False, 0.0, True)),
])
def test_roles(kv_role: str, extra: dict[str, object],
               want: tuple[bool, bool, bool, float, bool]) -> None:
    from kvtier.integrations.vllm.settings import role_of

    r = role_of(kv_role, ConnectorSettings.from_extra(extra), extra)
    assert (r.loads, r.stores, r.handoff, r.wait_s, r.use_plan) == want and r.name == kv_role


@pytest.mark.parametrize(("kv_role", "extra", "needle"), [
    ("kv_prodcer", {}, "kv_role must be one of ['kv_producer', 'kv_consumer', 'kv_both'], "
                       "got 'kv_prodcer'"),
    (None, {}, "got None"),
    ("kv_consumer", {"store": True}, "'kv_consumer' never stores"),
    ("kv_producer", {"store": False}, "'kv_producer' stores what it computes"),
    ("kv_consumer", {"pending_wait_s": -1}, "pending_wait_s >= 0"),
])
def test_wrong_roles_are_refused_with_one_line(kv_role: object, extra: dict[str, object],
                                                needle: str) -> None:
    from kvtier.integrations.vllm.settings import role_of

    with pytest.raises(SettingsError) as err:
        role_of(kv_role, ConnectorSettings.from_extra(extra), extra)
    assert needle in str(err.value) and "\n" not in str(err.value)
