"""Block keys: chained content hashes of full token blocks, compatible with vLLM's prefix cache.

    key_i = H(CBOR([key_{i-1}, [tok, ...], extra_keys_i]))        key_{-1} = the scheme's root

H is SHA-256 (mode ``sha256_cbor``, 32-byte keys) or XXH3-128 (mode ``xxh3_128``, 16-byte keys,
for trusted single-tenant setups only: it is not collision resistant), over *canonical* CBOR
(RFC 8949 §4.2: shortest integer forms). Only full blocks are keyed. Python's `hash()` is never
used, so keys are identical across processes, hosts and versions.

Compatibility contract with vLLM 0.33 (`vllm/v1/core/kv_cache_utils.py: hash_block_tokens`,
`init_none_hash`; `vllm/utils/hashing.py: sha256_cbor`, `xxhash_cbor`):

- ``KeyScheme.vllm()`` reproduces vLLM's block hashes byte for byte: the root is vLLM's
  ``NONE_HASH`` = H(CBOR("vllm-none-hash")) — the seed vLLM uses for cryptographic hashes when
  ``PYTHONHASHSEED`` is unset; if the engine sets ``PYTHONHASHSEED=X``, pass ``seed=X``
  (vLLM's xxhash modes use a random seed unless PYTHONHASHSEED is set, so only an explicit seed
  is reproducible). ``Extras`` yields vLLM's tagged extra keys in vLLM's order.
  Such keys carry **no namespace**: the engine's hash can be reused verbatim as a kvtier key only
  because the daemon keeps a separate index namespace per (model id, layout fingerprint) — the
  value of `root_seed` names that namespace.
- ``KeyScheme.namespaced(model_id, fingerprint)`` is kvtier's own chain: the root is
  `root_seed(model_id, fingerprint)` instead of NONE_HASH, so the namespace is inside every key
  and keys of different models/layouts cannot meet even in one index. Not vLLM-compatible.

Extra keys are typed and tagged — ``("lora", name, path)``, ``("mm", identifier, offset in
block)``, ``("cache_salt", salt)`` on the first block only, ``("prompt_embeds", digest)`` — so a
LoRA name can never collide with a salt or a multimodal hash.

A kvtier block may span several engine blocks; its key is the engine key of its last sub-block
(that key already covers the whole prefix): `span_keys`.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import cbor2
import numpy as np
import xxhash

from kvtier.core.errors import InvalidArgument

Mode = Literal["sha256_cbor", "xxh3_128"]
KEY_BYTES: dict[str, int] = {"sha256_cbor": 32, "xxh3_128": 16}
VLLM_NONE_HASH_SEED = "vllm-none-hash"
_ROOT_TAG = "kvtier-root/v1"

ExtraKeys = tuple[tuple[Any, ...], ...]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_DIGEST: dict[str, Callable[[bytes], bytes]] = {
    "sha256_cbor": _sha256,
    "xxh3_128": xxhash.xxh3_128_digest,
}


def _digest_fn(mode: str) -> Callable[[bytes], bytes]:
    try:
        return _DIGEST[mode]
    except KeyError:
        raise ValueError(f"unknown hash mode {mode!r} (known: sha256_cbor, xxh3_128)") from None


def cbor_hash(obj: Any, mode: Mode = "sha256_cbor") -> bytes:
    """H(canonical CBOR(obj)): vLLM's `sha256_cbor` (or `xxhash_cbor` for xxh3_128)."""
    return _digest_fn(mode)(cbor2.dumps(obj, canonical=True))


def vllm_none_hash(mode: Mode = "sha256_cbor", seed: str = VLLM_NONE_HASH_SEED) -> bytes:
    """vLLM's NONE_HASH for `seed` (the parent of every chain's first block in vLLM)."""
    return cbor_hash(seed, mode)


def root_seed(model_id: str, fingerprint: bytes, mode: Mode = "sha256_cbor") -> bytes:
    """The namespace of one model and KV layout (`KVLayout.fingerprint()` bytes)."""
    if not isinstance(model_id, str) or not model_id:
        raise ValueError("model_id must be a non-empty string")
    if not isinstance(fingerprint, bytes) or not fingerprint:
        raise ValueError("fingerprint must be non-empty bytes")
    return cbor_hash((_ROOT_TAG, model_id, fingerprint), mode)


MODEL_ID_BYTES = 256  # longest model id (UTF-8)
LAYOUT_ID_BYTES = 32


def check_model_id(model_id: str) -> None:
    """Raises `InvalidArgument` unless `model_id` is 1..256 UTF-8 bytes of printable text."""
    if not isinstance(model_id, str) or not model_id:
        raise InvalidArgument("model_id is required: the model whose KV the blocks hold")
    if len(model_id.encode()) > MODEL_ID_BYTES:
        raise InvalidArgument(f"model_id must be at most {MODEL_ID_BYTES} bytes (UTF-8)")
    if not model_id.isprintable():
        raise InvalidArgument("model_id must be printable text (no control characters)")


def layout_id(model_id: str, fingerprint: bytes) -> bytes:
    """The 32-byte id of (model id, layout fingerprint): `root_seed` in sha256_cbor mode."""
    return root_seed(model_id, fingerprint, "sha256_cbor")


@dataclass(frozen=True, slots=True)
class MMItem:
    """One multimodal input: its content hash and its token range [offset, offset + length)."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Extras:
    """Request-level inputs besides tokens that change the KV (vLLM's extra hash keys).

    `mm` sorted by offset and non-overlapping; `embed_digests[i]` is the digest of block i's
    prompt embeddings (vLLM: sha256 of the block's embedding tensor bytes), if any.
    """

    lora: tuple[str, str] | None = None
    mm: tuple[MMItem, ...] = ()
    cache_salt: str | None = None
    embed_digests: tuple[bytes, ...] = ()

    def for_block(self, start: int, end: int, block_index: int) -> ExtraKeys | None:
        """Tagged extra keys of the block covering tokens [start, end), or None (vLLM order)."""
        keys: list[tuple[Any, ...]] = []
        if self.lora is not None:
            keys.append(("lora", self.lora[0], self.lora[1]))
        for it in self.mm:
            if it.offset >= end:
                break
            if it.offset + it.length > start:
                keys.append(("mm", it.identifier, it.offset - start))
        if start == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        if block_index < len(self.embed_digests):
            keys.append(("prompt_embeds", self.embed_digests[block_index]))
        return tuple(keys) if keys else None

    @property
    def per_block(self) -> bool:
        """True when blocks get different extra keys (multimodal, salt, embeddings)."""
        return bool(self.mm or self.cache_salt or self.embed_digests)


def _head(major: int, n: int) -> bytes:
    """CBOR initial bytes for major type `major` with argument `n` (shortest form)."""
    if n < 24:
        return bytes([major << 5 | n])
    for info, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes([major << 5 | info]) + n.to_bytes(width, "big")
    raise ValueError(f"CBOR argument {n} too large")


def _as_int_array(tokens: Sequence[int]) -> np.ndarray[Any, np.dtype[np.int64]] | None:
    """int64 array of the tokens, or None when they are not all machine-size integers (bool
    counts as int here, unlike CBOR; token ids are never bools)."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64) if tokens.dtype.kind in "iu" else None
    try:
        return np.frombuffer(array.array("q", tokens), dtype=np.int64)
    except (TypeError, OverflowError):
        return None


_CHUNK_TOKENS = 4096
_VECTOR_MAX_BLOCK = 64
"""Above this block size one cbor2 call per block is as fast as the vectorised encoder (the
per-call overhead it saves is amortised over many tokens): bench/hashing.py."""
_WIDTH = np.array([1, 2, 3, 5, 9], dtype=np.int64)
_INFO = np.array([0, 0x18, 0x19, 0x1A, 0x1B], dtype=np.uint8)


def _keep(cols: int) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Row c: which of `cols` bytes (initial byte + big-endian value) a width class keeps."""
    keep = np.arange(cols)[None, :] >= (cols + 1 - _WIDTH)[:, None]
    keep[:, 0] = True
    return keep


_KEEP = {5: _keep(5), 9: _keep(9)}


def _encode_tokens(
    tokens: np.ndarray[Any, np.dtype[np.uint64]], block_tokens: int,
) -> tuple[bytes, list[int]]:
    """Canonical CBOR encodings of non-negative integer `tokens`, concatenated, and the byte
    offset where each block's tokens end. Vectorised: row i of an (n, cols) byte matrix holds
    token i's initial byte and its big-endian value bytes; a per-width-class mask keeps the
    initial byte and the last width-1 bytes, and flattening in row order concatenates the items.
    """
    n = len(tokens)
    wide = bool(tokens.max() >= 1 << 32)
    cls = ((tokens >= 24).view(np.uint8) + (tokens >= 1 << 8).view(np.uint8)
           + (tokens >= 1 << 16).view(np.uint8) + (tokens >= 1 << 32).view(np.uint8))
    cols = 9 if wide else 5
    rows = np.empty((n, cols), dtype=np.uint8)
    rows[:, 0] = np.where(cls == 0, tokens.astype(np.uint8), _INFO[cls])
    value = tokens.astype(">u8" if wide else ">u4")
    rows[:, 1:] = value.view(np.uint8).reshape(n, cols - 1)
    ends = np.cumsum(_WIDTH[cls])[block_tokens - 1 :: block_tokens]
    return rows[_KEEP[cols][cls]].tobytes(), ends.tolist()


@dataclass(frozen=True, slots=True)
class KeyScheme:
    """How keys are made: the hash `mode` and the `root` (parent of a chain's first block)."""

    mode: Mode
    root: bytes

    def __post_init__(self) -> None:
        _digest_fn(self.mode)
        if len(self.root) != KEY_BYTES[self.mode]:
            raise ValueError(f"root must be {KEY_BYTES[self.mode]} bytes for {self.mode}")

    @classmethod
    def vllm(cls, mode: Mode = "sha256_cbor", seed: str = VLLM_NONE_HASH_SEED) -> KeyScheme:
        """Byte-identical to vLLM's block hashes (see the module docstring)."""
        return cls(mode, vllm_none_hash(mode, seed))

    @classmethod
    def namespaced(cls, model_id: str, fingerprint: bytes,
                   mode: Mode = "sha256_cbor") -> KeyScheme:
        """kvtier's own chain: the namespace seed replaces NONE_HASH."""
        return cls(mode, root_seed(model_id, fingerprint, mode))

    @property
    def key_bytes(self) -> int:
        return KEY_BYTES[self.mode]

    def block_key(self, parent: bytes | None, tokens: Sequence[int],
                  extra: ExtraKeys | None = None) -> bytes:
        """Key of one full block (`parent` None or empty = first block of a chain)."""
        return cbor_hash((parent or self.root, tuple(tokens), extra), self.mode)

    def block_keys(self, token_ids: Sequence[int], block_tokens: int, *,
                   extras: Extras | None = None) -> list[bytes]:
        """Keys of every full block of a token sequence starting at position 0."""
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        n_blocks = len(token_ids) // block_tokens
        if n_blocks == 0:
            return []
        if block_tokens > _VECTOR_MAX_BLOCK:
            return self._block_keys_slow(token_ids, block_tokens, extras, n_blocks)
        toks = _as_int_array(token_ids[: n_blocks * block_tokens])
        if toks is None or toks.min() < 0:
            return self._block_keys_slow(token_ids, block_tokens, extras, n_blocks)
        utoks = toks.astype(np.uint64)
        digest = _digest_fn(self.mode)
        lead = b"\x83" + _head(2, self.key_bytes)
        arr = _head(4, block_tokens)
        per_block = extras is not None and extras.per_block
        tail = cbor2.dumps(extras.for_block(0, block_tokens, 0) if extras else None,
                           canonical=True)
        parent = self.root
        keys: list[bytes] = []
        step = max(1, _CHUNK_TOKENS // block_tokens)  # small arrays stay in cache
        for first in range(0, n_blocks, step):
            last = min(n_blocks, first + step)
            enc, ends = _encode_tokens(
                utoks[first * block_tokens : last * block_tokens], block_tokens)
            lo = 0
            for i, hi in enumerate(ends, first):
                if per_block:
                    assert extras is not None
                    start = i * block_tokens
                    tail = cbor2.dumps(extras.for_block(start, start + block_tokens, i),
                                       canonical=True)
                parent = digest(b"".join((lead, parent, arr, enc[lo:hi], tail)))
                keys.append(parent)
                lo = hi
        return keys

    def _block_keys_slow(self, token_ids: Sequence[int], block_tokens: int,
                         extras: Extras | None, n_blocks: int) -> list[bytes]:
        keys: list[bytes] = []
        parent: bytes | None = None
        for i in range(n_blocks):
            start = i * block_tokens
            extra = extras.for_block(start, start + block_tokens, i) if extras else None
            parent = self.block_key(parent, token_ids[start:start + block_tokens], extra)
            keys.append(parent)
        return keys


VLLM_SHA256 = KeyScheme.vllm()
"""The default scheme: vLLM-compatible sha256_cbor with the default NONE_HASH seed."""


def block_keys(token_ids: Sequence[int], block_tokens: int, *,
               scheme: KeyScheme = VLLM_SHA256, extras: Extras | None = None) -> list[bytes]:
    """Keys of every full block of `token_ids` under `scheme` (default: vLLM sha256_cbor)."""
    return scheme.block_keys(token_ids, block_tokens, extras=extras)


def span_keys(engine_keys: Sequence[bytes], sub_blocks: int) -> list[bytes]:
    """Keys of kvtier blocks spanning `sub_blocks` engine blocks each: the engine key of each
    full span's last sub-block. A trailing partial span has no key."""
    if sub_blocks <= 0:
        raise ValueError(f"sub_blocks must be > 0, got {sub_blocks}")
    return list(engine_keys[sub_blocks - 1 :: sub_blocks])
