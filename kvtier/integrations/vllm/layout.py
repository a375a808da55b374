"""The kvtier layout of a vLLM engine's KV: one kvtier block = one vLLM block of every attention
layer, the layers' pages back to back in `layer_names` order.

    slot: | layer 0 page (page_bytes) | layer 1 page | ... | layer L-1 page |

Hybrid models (vLLM's hybrid KV cache manager, several KV cache groups, or one sliding-window
group): the layers are taken group after group (vLLM's group order), and one kvtier block still
holds one block of every layer, full-attention and sliding-window alike, keyed by vLLM's block
hash at the block's end. So every group's pages for a block boundary live and die together in the
daemon (no group can be evicted without the others; one Lookup answers for all groups), and a hit
of n blocks is servable by every group: the full groups load all n blocks, a sliding group only
the last `window_blocks(g)` of them (vLLM drops the others). The groups (kind, window, state
shape) are in the fingerprint.

Mamba / linear-attention state groups (vLLM's `MambaSpec`, Qwen3-Next's Gated DeltaNet; `states`):
vLLM keeps a state only at some block boundaries (`mamba_cache_mode` "align": the ends of prefill
chunks, offered to connectors as `boundary_state_offloads`), so a state is not part of the chain
block of its boundary. It goes in a second block of the same layout under `state_key(key)`: the
whole block at that boundary (every attention layer's page and every state layer's state), a
sibling of the chain block (same parent), so `keys[:c - 1] + [state_key(keys[c - 1])]` is a chain
the daemon finds only when the attention KV of the prefix and the state at its end are both held
(a state never outlives its prefix: leaf first), and a hit cut at c restores every layer exactly
as it was after c blocks. A state layer's page is vLLM's whole (padded) page of that block; the
chain blocks' state pages are not meaningful and never loaded.

A page is one block of one layer in vLLM's standardized per-layer view `kv[block]` ([B, H, N, C],
blocks at dim 0), in its logical element order whatever the physical layout (LBHNC, ...): the
fingerprint names everything that shapes those bytes (the slot format's version, dtype, KV cache
dtype and quantization mode, block size, layers, heads on this rank, head size, page bytes, the
platform — cpu, cuda — whose backends define [H, N, C], the TP shard, the pipeline stage, the
hash algorithm and key width, the groups), so engines whose pages differ never share blocks;
the weights are named by the model id beside it (docs/vllm.md "Verification": the manifest).

Tensor parallel: with `kv_heads` KV heads over TP size t, rank r holds heads of shard
r * min(t, kv_heads) // t of min(t, kv_heads) shards; beyond kv_heads ranks (and for MLA, whose
latent cache every rank holds whole) shards are replicated, so the blocks of a shard are stored
once, by its first rank (`saves`), and loaded by all of its ranks. Pure; no vLLM import.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvtier.client.decl import LayoutDecl, ModelCost
from kvtier.integrations.common.verify import Region

FORMAT = "kvtier-vllm-v2"
"""The slot format's version: the first part of every fingerprint (v2: the KV cache dtype and
quantization, the hash algorithm and the pipeline stage joined the fingerprint)."""
STATE_KEY_TAG = b"kvtier-state\0"


class Shard(NamedTuple):
    number: int
    of: int
    saves: bool
    """This rank is the first of its shard: it stores the shard's blocks."""


def kv_shard(tp_size: int, rank: int, total_kv_heads: int, replicated: bool = False) -> Shard:
    """Which copy of the KV rank `rank` of `tp_size` holds (see the module docstring)."""
    if tp_size < 1 or not 0 <= rank < tp_size or total_kv_heads < 1:
        raise ValueError(f"bad TP rank {rank} of {tp_size} with {total_kv_heads} KV heads")
    shards = 1 if replicated else min(tp_size, total_kv_heads)
    index = rank * shards // tp_size
    first = -(-index * tp_size // shards)  # the lowest rank r with r * shards // tp == index
    return Shard(index, shards, rank == first)


@dataclass(frozen=True, slots=True)
class EngineKV:
    """What shapes one vLLM block's bytes on one rank."""

    model_id: str
    dtype: str
    block_tokens: int
    layer_names: tuple[str, ...]
    page_bytes: int
    kv_heads: int
    """KV heads on this rank (vLLM's spec)."""
    head_size: int
    backend: str
    """The platform whose attention backends define the page's [H, N, C] view ("cpu", "cuda";
    "mla-" prefixed for MLA), part of the fingerprint."""
    shard: Shard
    cost: ModelCost | None = None
    key_width: int = 32
    """Bytes of vLLM's block hashes: 32 (sha256, sha256_cbor) or 16 (xxhash, xxhash_cbor)."""
    layer_groups: tuple[int, ...] = ()
    """The KV cache group of each layer (empty: one group, every layer)."""
    windows: tuple[int, ...] = (0,)
    """Each group's sliding window in tokens (0: full attention)."""
    hash_tokens: int = 0
    """Tokens per vLLM block hash (`KVCacheConfig.hash_block_size`); 0: `block_tokens`."""
    states: tuple[str, ...] = ()
    """Per group, its recurrent state's shape ("" for an attention group; empty: none)."""
    kv_cache: str = "auto"
    """vLLM's KV cache dtype setting and, when quantized, its quantization mode (scale layout):
    "auto", "fp8", "fp8_per_token_head/PER_TOKEN_HEAD_FP8", ..."""
    hash_algo: str = "sha256_cbor"
    """vLLM's prefix-caching hash (`prefix_caching_hash_algo`): the keys' meaning."""
    pp: tuple[int, int] = (0, 1)
    """Pipeline stage and stage count."""

    @property
    def stateful(self) -> bool:
        """Some group keeps a recurrent state (loads end on a state block: `state_key`)."""
        return any(self.states)

    def is_state(self, group: int) -> bool:
        return bool(self.states) and bool(self.states[group])

    def state_key(self, key: bytes) -> bytes:
        """The key of the state block at the boundary whose chain block is `key`."""
        return hashlib.sha256(STATE_KEY_TAG + key).digest()[:len(key)]

    @property
    def block_bytes(self) -> int:
        return self.page_bytes * len(self.layer_names)

    @property
    def hybrid(self) -> bool:
        """Several groups or a sliding window: loads are per group and asynchronous (vLLM takes
        load failures per request only then; a block-level rewind cannot rebuild a window)."""
        return len(self.windows) > 1 or any(self.windows) or self.stateful

    def group_of(self, layer: int) -> int:
        return self.layer_groups[layer] if self.layer_groups else 0

    def window_blocks(self, group: int) -> int:
        """Blocks before a hit point that `group` needs: all (0) for full attention, else
        ceil(window / block) + 1 (a superset of what vLLM's sliding-window manager keeps)."""
        w = self.windows[group]
        return 0 if w == 0 else -(-w // self.block_tokens) + 1

    def hash_step(self) -> int:
        """vLLM block hashes per kvtier block (the key is the last one's)."""
        return max(1, self.block_tokens // (self.hash_tokens or self.block_tokens))

    def group_bytes(self) -> list[int]:
        """Each group's bytes in one block (per-group accounting from the layout)."""
        out = [0] * len(self.windows)
        for i in range(len(self.layer_names)):
            out[self.group_of(i)] += self.page_bytes
        return out

    def layer_offset(self, i: int) -> int:
        return i * self.page_bytes

    def describe(self) -> str:
        """Everything the fingerprint covers, readable (the layer names by digest)."""
        layers = hashlib.sha256("\0".join(self.layer_names).encode()).hexdigest()[:16]
        return (f"{FORMAT}/{self.dtype}/bt{self.block_tokens}/L{len(self.layer_names)}:{layers}"
                f"/kvh{self.kv_heads}/hd{self.head_size}/page{self.page_bytes}/{self.backend}"
                f"/shard{self.shard.number}of{self.shard.of}/key{self.key_width}"
                f"/kv:{self.kv_cache}/hash:{self.hash_algo}/pp{self.pp[0]}of{self.pp[1]}"
                + (self._describe_groups() if self.hybrid else ""))

    def _describe_groups(self) -> str:
        kinds = ",".join(f"state({self.states[g]})" if self.is_state(g) else f"swa{w}" if w
                         else "full" for g, w in enumerate(self.windows))
        layers = ",".join(str(self.group_of(i)) for i in range(len(self.layer_names)))
        return f"/groups[{kinds}]/layer-groups[{layers}]/hash{self.hash_tokens}"

    def fingerprint(self) -> bytes:
        """The daemon's layout fingerprint (8..64 bytes): a digest of `describe()`."""
        return f"{FORMAT}:".encode() + hashlib.sha256(self.describe().encode()).digest()[:24]

    def group_names(self) -> list[str]:
        """Each group's name in the daemon's per-group accounting: "<index>:<kind>" (full,
        swa<window>, state)."""
        return [f"{g}:" + ("state" if self.is_state(g) else f"swa{w}" if w else "full")
                for g, w in enumerate(self.windows)]

    def decl(self) -> LayoutDecl:
        """What the daemon is told; hybrid layouts declare their groups' bytes per block."""
        groups = tuple(zip(self.group_names(), self.group_bytes(), strict=True))
        return LayoutDecl(self.fingerprint(), self.block_bytes, self.block_tokens,
                          self.key_width, model=self.cost, model_id=self.model_id,
                          groups=groups if self.hybrid else ())

    def verify_regions(self, state_block: bool = False) -> list[Region]:
        """What shadow verification compares in one block (`common/verify.py`): each attention
        layer's page as its dtype; in a state block (`state_key`) also each state layer's state
        tensors (`state_parts`; vLLM's padding after them is never compared). A chain block's
        state pages are not meaningful and are skipped. In a model with state layers, every
        attention page is of kind "hybrid" (its own tolerance)."""
        out = []
        for i in range(len(self.layer_names)):
            g, base = self.group_of(i), self.layer_offset(i)
            if not self.is_state(g):
                kind = "hybrid" if self.stateful else "swa" if self.windows[g] else "full"
                out.append(Region(i, kind, base, base + self.page_bytes, self.dtype))
            elif state_block:
                out += [Region(i, "state", base + a, base + b, dt)
                        for a, b, dt in state_parts(self.states[g])]
        return out

    def for_shard(self, shard: Shard) -> EngineKV:
        return EngineKV(self.model_id, self.dtype, self.block_tokens, self.layer_names,
                        self.page_bytes, self.kv_heads, self.head_size, self.backend, shard,
                        self.cost, self.key_width, self.layer_groups, self.windows,
                        self.hash_tokens, self.states, self.kv_cache, self.hash_algo, self.pp)


class Unsupported(ValueError):
    """The engine's KV cannot be kept by kvtier (the connector then runs as a no-op)."""


def default_model_id(model_config: Any, load_config: Any, seed: Any) -> str:
    """Whose KV the engine computes, following its weights (`integrations/common/identity.py`),
    from vLLM's `ModelConfig` (model, revision, dtype, quantization) and `LoadConfig`."""
    from kvtier.integrations.common import identity

    quant = getattr(model_config, "quantization", None)
    return identity.model_id(
        str(model_config.model), load_format=str(getattr(load_config, "load_format", "")),
        seed=seed, revision=getattr(model_config, "revision", None),
        dtype=str(getattr(model_config, "dtype", "")), quantization=str(quant) if quant else None,
        where="kv_connector_extra_config")


def model_cost(hf_config: Any) -> ModelCost | None:
    """The planner's cost parameters from the model's Hugging Face config, if it parses."""
    from kvtier.core.hfconfig import spec_from_config

    try:
        spec = spec_from_config(hf_config.to_dict())
    except Exception:
        return None
    return ModelCost(active_params=float(spec.active_params), num_layers=spec.num_layers,
                     attn_dim=spec.d_attn)


def engine_kv(vllm_config: Any, kv_cache_config: Any, rank: int, model_id: str) -> EngineKV:
    """The layout of this engine's KV on TP rank `rank`, from vLLM's KV cache config (the same
    on the scheduler and on every worker). Raises `Unsupported` for what kvtier cannot hold:
    Mamba / linear-attention state without vLLM's "align" checkpoints (or with TP > 1),
    chunked-local attention, groups of unequal block size, unequal pages."""
    groups = [kv_cache_config.kv_cache_groups[g] for g in _transfer_groups(kv_cache_config)]
    if not groups:
        raise Unsupported("no KV cache group takes part in KV transfer")
    specs = [g.kv_cache_spec for g in groups]
    kinds = [_kind(spec) for spec in specs]
    windows = tuple(w for w, _ in kinds)
    states = tuple(st for _, st in kinds)
    attention = [s for s, (_, st) in zip(specs, kinds, strict=True) if not st]
    if not attention:
        raise Unsupported("no attention KV cache group (state-only models are not supported)")
    spec = attention[0]
    for s in attention:
        for attr in ("num_kv_heads", "head_size", "dtype", "page_size_bytes"):
            if not hasattr(s, attr):
                raise Unsupported(f"KV cache spec {type(s).__name__} has no {attr}")
        shape = (s.block_size, s.num_kv_heads, s.head_size, s.dtype, s.page_size_bytes)
        if shape != (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype,
                     spec.page_size_bytes):
            raise Unsupported(f"KV cache groups of different shapes ({type(s).__name__} "
                              f"{shape} vs {type(spec).__name__})")
    for s, (_, st) in zip(specs, kinds, strict=True):
        if st and (s.block_size, s.page_size_bytes) != (spec.block_size, spec.page_size_bytes):
            raise Unsupported(f"a state group's block ({s.block_size} tokens, "
                              f"{s.page_size_bytes}-byte pages) differs from the attention "
                              f"groups' ({spec.block_size}, {spec.page_size_bytes})")
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    if int(getattr(pc, "pipeline_parallel_size", 1)) > 1:
        raise Unsupported("pipeline parallelism is not supported (each stage holds other "
                          "layers; the scheduler side looks up one layout per TP shard)")
    if any(states) and int(pc.tensor_parallel_size) > 1:
        raise Unsupported("Mamba / linear-attention state with tensor parallelism is not "
                          "supported (the state is sharded by vLLM's own rules)")
    is_mla = bool(getattr(mc, "use_mla", False))
    total_heads = int(mc.get_total_num_kv_heads())
    shard = kv_shard(int(pc.tensor_parallel_size), rank, max(total_heads, 1), replicated=is_mla)
    from vllm.platforms import current_platform

    names = tuple(n for g in groups for n in g.layer_names)
    layer_groups = tuple(i for i, g in enumerate(groups) for _ in g.layer_names)
    hybrid = len(groups) > 1 or any(windows) or any(states)
    hash_tokens = int(getattr(kv_cache_config, "hash_block_size", None) or spec.block_size)
    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    kv_cache = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    mode = getattr(spec, "kv_quant_mode", None)
    if mode is not None and getattr(mode, "name", "NONE") != "NONE":
        kv_cache += f"/{mode.name}"
    if int(spec.block_size) % hash_tokens:
        raise Unsupported(f"block size {spec.block_size} is not a multiple of vLLM's hash "
                          f"block size {hash_tokens}")
    return EngineKV(
        model_id=model_id,
        dtype=str(spec.dtype).removeprefix("torch."),
        block_tokens=int(spec.block_size),
        layer_names=names,
        page_bytes=int(spec.page_size_bytes),
        kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        backend=("mla-" if is_mla else "") + str(current_platform.device_type),
        shard=shard,
        cost=model_cost(mc.hf_config),
        key_width=hash_width(algo),
        layer_groups=layer_groups if hybrid else (),
        windows=windows,
        hash_tokens=hash_tokens if hybrid else 0,
        states=states if any(states) else (),
        kv_cache=kv_cache,
        hash_algo=algo,
    )


def _transfer_groups(kv_cache_config: Any) -> list[int]:
    ids = getattr(kv_cache_config, "transfer_group_ids", None)
    return list(ids) if ids is not None else list(range(len(kv_cache_config.kv_cache_groups)))


def _kind(spec: Any) -> tuple[int, str]:
    """A group's (sliding window in tokens, 0: full attention; state shape, "": attention);
    `Unsupported` for the rest."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    if isinstance(spec, MambaSpec):
        mode = str(getattr(spec, "mamba_cache_mode", "none"))
        if mode != "align":
            raise Unsupported(
                f"Mamba / linear-attention state groups in mamba_cache_mode {mode!r}: vLLM keeps "
                "no state checkpoints at block boundaries (prefix caching off, or mode 'none'), "
                "so no state could be restored; the connector stores nothing")
        return 0, state_shape(spec.shapes, spec.dtypes)
    if isinstance(spec, SlidingWindowSpec):
        return int(spec.sliding_window), ""
    if isinstance(spec, ChunkedLocalAttentionSpec):
        raise Unsupported("chunked local attention is not supported")
    if isinstance(spec, FullAttentionSpec):
        return 0, ""  # a windowed layer under a full spec (hybrid manager off) keeps every block
    raise Unsupported(f"KV cache spec {type(spec).__name__} is not supported")


def state_shape(shapes: Any, dtypes: Any) -> str:
    """A state group's shape for the fingerprint: each state tensor's dims and dtype."""
    return "+".join("x".join(str(int(d)) for d in shape) + ":" + str(dt).removeprefix("torch.")
                    for shape, dt in zip(shapes, dtypes, strict=True))


def state_parts(shape: str) -> list[tuple[int, int, str]]:
    """The byte ranges and dtypes of a state page's tensors, from `state_shape`'s text: vLLM
    packs them back to back in that order (`MambaBase.bind_kv_cache`)."""
    import torch

    out, at = [], 0
    for part in shape.split("+"):
        dims, dt = part.split(":")
        n = 1
        for d in dims.split("x"):
            n *= int(d)
        size = n * getattr(torch, dt).itemsize
        out.append((at, at + size, dt))
        at += size
    return out


def hash_width(algo: str) -> int:
    """Digest bytes of vLLM's prefix-caching hash `algo`."""
    return 16 if algo.startswith("xxhash") else 32
