"""Block keys (kvtier.core.keys): hand-built CBOR vectors, chaining, extras, namespaces."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys

import pytest
import xxhash

from kvtier.core.keys import (
    KEY_BYTES,
    VLLM_SHA256,
    Extras,
    KeyScheme,
    MMItem,
    block_keys,
    root_seed,
    span_keys,
    vllm_none_hash,
)


def test_none_hash_is_sha256_of_cbor_text() -> None:
    # CBOR text string of 14 bytes: major type 3 -> 0x60 | 14 = 0x6e, then the UTF-8 bytes.
    assert vllm_none_hash() == hashlib.sha256(b"\x6evllm-none-hash").digest()
    assert vllm_none_hash("xxh3_128", "s") == xxhash.xxh3_128_digest(b"\x61s")


def test_block_key_hand_encoded() -> None:
    root = VLLM_SHA256.root
    # CBOR([root, [1, 24, 256, 70000], null]), canonical:
    #   0x83 array(3) | 0x58 0x20 bytes(32) root | 0x84 array(4)
    #   1 -> 0x01; 24 -> 0x18 0x18; 256 -> 0x19 0x01 0x00; 70000 = 0x11170 -> 0x1a 00 01 11 70
    #   null -> 0xf6
    enc = (b"\x83\x58\x20" + root + b"\x84\x01\x18\x18\x19\x01\x00\x1a\x00\x01\x11\x70\xf6")
    want = hashlib.sha256(enc).digest()
    assert VLLM_SHA256.block_key(None, [1, 24, 256, 70000]) == want
    assert VLLM_SHA256.block_keys([1, 24, 256, 70000], 4) == [want]


def test_keys_chain_and_only_full_blocks() -> None:
    toks = list(range(100, 133))  # 33 tokens -> 2 full 16-token blocks
    keys = block_keys(toks, 16)
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)
    assert keys[0] == VLLM_SHA256.block_key(None, toks[:16])
    assert keys[1] == VLLM_SHA256.block_key(keys[0], toks[16:32])
    # Same second block after a different first block: different key (the chain covers it).
    other = block_keys([7] * 16 + toks[16:32], 16)
    assert other[1] != keys[1]
    assert block_keys(toks[:15], 16) == []


@pytest.mark.parametrize("mode", ["sha256_cbor", "xxh3_128"])
def test_fast_path_equals_reference_encoding(mode: str) -> None:
    rng = random.Random(11)
    scheme = KeyScheme.vllm(mode)  # type: ignore[arg-type]
    bounds = [(0, 23), (24, 255), (256, 65535), (65536, 2**32 - 1), (2**32, 2**62)]
    extras = Extras(lora=("l", "/p"), mm=(MMItem("a", 3, 40), MMItem("b", 50, 2)),
                    cache_salt="salt", embed_digests=(b"\x01" * 32, b"\x02" * 32))
    for block_tokens in (1, 3, 16, 64):
        toks = [rng.randint(*rng.choice(bounds)) for _ in range(block_tokens * 5 - 1)]
        for ex in (None, Extras(lora=("l", "/p")), extras):
            fast = scheme.block_keys(toks, block_tokens, extras=ex)
            slow, parent = [], None
            for i in range(4):
                s = i * block_tokens
                extra = ex.for_block(s, s + block_tokens, i) if ex else None
                parent = scheme.block_key(parent, toks[s:s + block_tokens], extra)
                slow.append(parent)
            assert fast == slow
            assert all(len(k) == KEY_BYTES[mode] for k in fast)


def test_extra_keys_are_tagged_and_placed() -> None:
    ex = Extras(lora=("x", "/a"), mm=(MMItem("img", 10, 20),), cache_salt="x")
    # Block [0,16): LoRA, image starting at offset 10 in the block, salt (first block only).
    assert ex.for_block(0, 16, 0) == (("lora", "x", "/a"), ("mm", "img", 10), ("cache_salt", "x"))
    # Block [16,32): image continues (offset 10 - 16 = -6), no salt.
    assert ex.for_block(16, 32, 1) == (("lora", "x", "/a"), ("mm", "img", -6))
    # Block [32,48): image ended at 30.
    assert ex.for_block(32, 48, 2) == (("lora", "x", "/a"),)
    assert Extras().for_block(0, 16, 0) is None
    # Same string as a LoRA name and as a salt: different tags, different keys.
    toks = list(range(16))
    k_lora = block_keys(toks, 16, extras=Extras(lora=("x", "")))
    k_salt = block_keys(toks, 16, extras=Extras(cache_salt="x"))
    assert k_lora != k_salt != block_keys(toks, 16)


def test_namespaced_scheme_separates_models_and_layouts() -> None:
    toks = list(range(32))
    a = KeyScheme.namespaced("llama-3-8b", b"layout-A").block_keys(toks, 16)
    b = KeyScheme.namespaced("llama-3-8b", b"layout-B").block_keys(toks, 16)
    c = KeyScheme.namespaced("mistral-7b", b"layout-A").block_keys(toks, 16)
    assert len({a[0], b[0], c[0], block_keys(toks, 16)[0]}) == 4
    assert root_seed("m", b"f") == root_seed("m", b"f")
    assert len(root_seed("m", b"f", "xxh3_128")) == 16


def test_keys_are_stable_across_processes() -> None:
    code = ("from kvtier.core.keys import KeyScheme as K;"
            "print(K.namespaced('m', b'fp', 'xxh3_128').block_keys(list(range(40)), 16)[1].hex())")
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout.strip())
    want = KeyScheme.namespaced("m", b"fp", "xxh3_128").block_keys(list(range(40)), 16)[1]
    assert outs == {want.hex()}


def test_span_keys_take_last_sub_block() -> None:
    engine = block_keys(list(range(16 * 7)), 16)  # 7 engine blocks
    assert span_keys(engine, 2) == [engine[1], engine[3], engine[5]]  # the 7th is a partial span
    assert span_keys(engine, 1) == engine
    with pytest.raises(ValueError):
        span_keys(engine, 0)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        block_keys([1, 2], 0)
    with pytest.raises(ValueError, match="unknown hash mode"):
        KeyScheme.vllm("md5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="root must be 16 bytes"):
        KeyScheme("xxh3_128", b"\x00" * 32)
    with pytest.raises(ValueError):
        root_seed("", b"f")
    with pytest.raises(ValueError):
        root_seed("m", b"")
