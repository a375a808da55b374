"""Byte-compatibility of kvtier.core.keys with vLLM 0.33's own block hashing (real vLLM code).

Skips cleanly where vLLM is not importable; it is installed in the dev venv and in CI.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvtier.core.keys import Extras, KeyScheme, MMItem

kcu = pytest.importorskip("vllm.v1.core.kv_cache_utils")
vhash = pytest.importorskip("vllm.utils.hashing")


@pytest.fixture(scope="module", params=["sha256_cbor", "xxh3_128"])
def pair(request: pytest.FixtureRequest) -> tuple[KeyScheme, Any]:
    """(our scheme, vLLM hash function) with vLLM's NONE_HASH initialised for that function."""
    fn = vhash.sha256_cbor if request.param == "sha256_cbor" else vhash.xxhash_cbor
    kcu.init_none_hash(fn)
    seed = kcu.get_none_hash_seed()  # random for xxhash unless PYTHONHASHSEED: we follow it
    scheme = KeyScheme.vllm(request.param, seed=seed)
    assert scheme.root == kcu.NONE_HASH
    return scheme, fn


def test_default_seed_matches_vllm_none_hash() -> None:
    kcu.init_none_hash(vhash.sha256_cbor)
    if kcu.get_none_hash_seed() != "vllm-none-hash":
        pytest.skip("PYTHONHASHSEED is set, vLLM uses it as the seed")
    assert KeyScheme.vllm().root == kcu.NONE_HASH


def _tokens(rng: random.Random, n: int) -> list[int]:
    # Mix all CBOR integer widths: <24, <256, <65536, <2**32, and beyond.
    pools = [(0, 23), (24, 255), (256, 65535), (65536, 2**32 - 1), (2**32, 2**40)]
    return [rng.randint(*rng.choice(pools)) for _ in range(n)]


def test_block_key_matches_hash_block_tokens(pair: tuple[KeyScheme, Any]) -> None:
    scheme, fn = pair
    rng = random.Random(7)
    parent = None
    for _ in range(20):
        toks = _tokens(rng, rng.choice([1, 16, 256]))
        extra = rng.choice([None, (("lora", "a", "/p"),), (("mm", "h1", 3), ("cache_salt", "s"))])
        ours = scheme.block_key(parent, toks, extra)
        assert ours == kcu.hash_block_tokens(fn, parent, toks, extra)
        parent = ours


@pytest.mark.parametrize("block_tokens", [1, 16, 256])
def test_block_keys_match_vllm_chain(pair: tuple[KeyScheme, Any], block_tokens: int) -> None:
    scheme, fn = pair
    rng = random.Random(block_tokens)
    toks = _tokens(rng, block_tokens * 6 - 1)  # 5 full blocks; the partial 6th is never keyed
    want, parent = [], None
    for i in range(5):
        parent = kcu.hash_block_tokens(fn, parent, toks[i * block_tokens:(i + 1) * block_tokens])
        want.append(parent)
    assert scheme.block_keys(toks, block_tokens) == want
    assert scheme.block_keys([-1, *toks[1:]], block_tokens)[0] == kcu.hash_block_tokens(
        fn, None, [-1, *toks[1 : block_tokens]])


def _vllm_request(toks: list[int], lora: bool, salt: str | None,
                  mm: list[tuple[str, int, int]]) -> Any:
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    feats = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                   mm_position=PlaceholderRange(offset=off, length=ln))
             for ident, off, ln in mm]
    return Request("r", toks, SamplingParams(max_tokens=1), None,
                   lora_request=LoRARequest("ad1", 1, "/lora/ad1") if lora else None,
                   cache_salt=salt, mm_features=feats or None)


@pytest.mark.parametrize(("lora", "salt", "mm"), [
    (False, None, []),
    (True, None, []),
    (False, "tenant-a", []),
    (True, "s", [("img0", 5, 20), ("img1", 40, 3), ("img2", 43, 30)]),
])
def test_request_block_hasher_with_extras(lora: bool, salt: str | None,
                                          mm: list[tuple[str, int, int]]) -> None:
    """vLLM's own per-request hasher (LoRA, cache_salt, multimodal placeholders) vs Extras."""
    kcu.init_none_hash(vhash.sha256_cbor)
    scheme = KeyScheme.vllm(seed=kcu.get_none_hash_seed())
    rng = random.Random(3)
    toks = [rng.randrange(150000) for _ in range(16 * 6 + 5)]
    req = _vllm_request(toks, lora, salt, mm)
    want = kcu.get_request_block_hasher(16, vhash.sha256_cbor)(req)
    extras = Extras(lora=("ad1", "/lora/ad1") if lora else None,
                    mm=tuple(MMItem(i, o, n) for i, o, n in mm), cache_salt=salt)
    assert len(want) == 6
    assert scheme.block_keys(toks, 16, extras=extras) == want
