"""What the scheduler-side connector hands the workers each step (pickled with the step).

    LoadJob   fill `block_ids` (vLLM blocks, in key order) from the slots leased to each rank;
              `failed` are blocks the scheduler promised but could not pin: the workers report
              them through `get_block_ids_with_load_errors`, so vLLM recomputes them.
    SaveJob   store vLLM blocks `block_ids` under `keys` (a chain after `parent`), computed by
              the end of this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(slots=True)
class RankLease:
    lease_id: str
    slots: tuple[int, ...]
    """Slot of keys[i] for i < len(slots) (the pinned prefix)."""
    segment: bytes
    """The daemon's SegmentInfo (serialized) the slots index."""


@dataclass(slots=True)
class LoadJob:
    req_id: str
    block_ids: list[int]
    leases: list[RankLease]
    """One per TP rank (index = rank)."""
    failed: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SaveJob:
    req_id: str
    block_ids: list[int]
    keys: list[bytes]
    parent: bytes


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
