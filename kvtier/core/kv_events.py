"""vLLM's KV-event wire format, written from vLLM 0.32's `vllm.distributed.kv_events`, so
KV-aware routers (llm-d's kv-cache indexer, Dynamo's router) read kvtier's events as they read
vLLM's own.

A ZMQ message is three frames: topic (UTF-8), sequence (8-byte big-endian, per publisher, from 0),
payload (msgpack of an `EventBatch`: an array `[ts, events, data_parallel_rank]`; each event a map
tagged `type`: "BlockStored" | "BlockRemoved" | "AllBlocksCleared"). The replay socket answers a
request frame holding an 8-byte start sequence with every buffered message from it on, then
`END_SEQ` with empty topic and payload.

Media (`medium`): vLLM's names where vLLM has one: "GPU" (vLLM's own pool), "CPU" (kvtier's DRAM,
as vLLM's CPU offloader names it), "STORAGE" (kvtier's local SSD, vLLM's MEDIUM_STORAGE); the
shared remote tier is "REMOTE" with `locality` "REMOTE". kvtier's events set `ownership` to
"kvtier" (vLLM: "secondary offloading tier identifier").
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvtier.core.types import Tier

MEDIUM = ("GPU", "CPU", "STORAGE", "REMOTE")  # by Tier value: HBM, DRAM, SSD, REMOTE
LOCALITY = ("LOCAL", "LOCAL", "LOCAL", "REMOTE")
OWNERSHIP = "kvtier"
END_SEQ = (-1).to_bytes(8, "big", signed=True)

BlockHash = bytes | int


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


def stored(tier: Tier, hashes: list[BlockHash], parent: BlockHash | None,
           block_size: int) -> BlockStored:
    """kvtier's BlockStored for blocks now held in `tier` (no token ids: kvtier keeps hashes)."""
    return BlockStored(hashes, parent, [], block_size, None, MEDIUM[tier], None, None, None,
                       None, None, LOCALITY[tier], OWNERSHIP)


def removed(tier: Tier, hashes: list[BlockHash]) -> BlockRemoved:
    return BlockRemoved(hashes, MEDIUM[tier], None, LOCALITY[tier], OWNERSHIP)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode(payload: bytes) -> EventBatch:
    """Raises `msgspec.DecodeError` (a ValueError) on a payload that is not an EventBatch."""
    return _decoder.decode(payload)


def sequence(frame: bytes) -> int:
    """The sequence number of a message's second frame (-1: the replay's end marker)."""
    return int.from_bytes(frame, "big", signed=True)
