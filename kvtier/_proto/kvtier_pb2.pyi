from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_NONE: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_SSD: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]
TIER_NONE: Tier
TIER_HBM: Tier
TIER_DRAM: Tier
TIER_SSD: Tier
TIER_REMOTE: Tier

class SegmentInfo(_message.Message):
    __slots__ = ("name", "size", "generation", "slot_bytes", "slot_stride", "slot_count", "data_offset", "shm_dir", "format_version", "page_bytes", "page_count", "pool_slot_bytes", "pool_slot_stride", "pool_slot_count", "by_fd")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_DIR_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_COUNT_FIELD_NUMBER: _ClassVar[int]
    POOL_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_SLOT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    POOL_SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    BY_FD_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    generation: int
    slot_bytes: int
    slot_stride: int
    slot_count: int
    data_offset: int
    shm_dir: str
    format_version: int
    page_bytes: int
    page_count: int
    pool_slot_bytes: int
    pool_slot_stride: int
    pool_slot_count: int
    by_fd: bool
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., generation: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., slot_stride: _Optional[int] = ..., slot_count: _Optional[int] = ..., data_offset: _Optional[int] = ..., shm_dir: _Optional[str] = ..., format_version: _Optional[int] = ..., page_bytes: _Optional[int] = ..., page_count: _Optional[int] = ..., pool_slot_bytes: _Optional[int] = ..., pool_slot_stride: _Optional[int] = ..., pool_slot_count: _Optional[int] = ..., by_fd: _Optional[bool] = ...) -> None: ...

class ModelCost(_message.Message):
    __slots__ = ("active_params", "num_layers", "attn_dim", "sliding_window")
    ACTIVE_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ATTN_DIM_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    active_params: float
    num_layers: int
    attn_dim: int
    sliding_window: int
    def __init__(self, active_params: _Optional[float] = ..., num_layers: _Optional[int] = ..., attn_dim: _Optional[int] = ..., sliding_window: _Optional[int] = ...) -> None: ...

class RegisterLayoutRequest(_message.Message):
    __slots__ = ("layout", "block_bytes", "block_tokens", "key_width", "model", "model_id", "groups", "protocol_version")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    layout: bytes
    block_bytes: int
    block_tokens: int
    key_width: int
    model: ModelCost
    model_id: str
    groups: _containers.RepeatedCompositeFieldContainer[LayoutGroup]
    protocol_version: int
    def __init__(self, layout: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., block_tokens: _Optional[int] = ..., key_width: _Optional[int] = ..., model: _Optional[_Union[ModelCost, _Mapping]] = ..., model_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[LayoutGroup, _Mapping]]] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class LayoutGroup(_message.Message):
    __slots__ = ("name", "block_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    block_bytes: int
    def __init__(self, name: _Optional[str] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class GroupStats(_message.Message):
    __slots__ = ("model_id", "group", "dram_bytes", "ssd_bytes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    DRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    group: str
    dram_bytes: int
    ssd_bytes: int
    def __init__(self, model_id: _Optional[str] = ..., group: _Optional[str] = ..., dram_bytes: _Optional[int] = ..., ssd_bytes: _Optional[int] = ...) -> None: ...

class RegisterLayoutResponse(_message.Message):
    __slots__ = ("segment", "max_blocks_per_request", "default_lease_ttl_ms", "tenant", "layout_id", "protocol_version")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    segment: SegmentInfo
    max_blocks_per_request: int
    default_lease_ttl_ms: int
    tenant: str
    layout_id: bytes
    protocol_version: int
    def __init__(self, segment: _Optional[_Union[SegmentInfo, _Mapping]] = ..., max_blocks_per_request: _Optional[int] = ..., default_lease_ttl_ms: _Optional[int] = ..., tenant: _Optional[str] = ..., layout_id: _Optional[bytes] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("fetch_blocks", "predicted_fetch_seconds", "predicted_recompute_seconds", "reason", "promote_in_background")
    FETCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FETCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_RECOMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_IN_BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    fetch_blocks: int
    predicted_fetch_seconds: float
    predicted_recompute_seconds: float
    reason: str
    promote_in_background: bool
    def __init__(self, fetch_blocks: _Optional[int] = ..., predicted_fetch_seconds: _Optional[float] = ..., predicted_recompute_seconds: _Optional[float] = ..., reason: _Optional[str] = ..., promote_in_background: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("layout", "keys", "key_width", "start_token", "want_plan", "prompt_tokens", "replica", "wait_pending_ms")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    WANT_PLAN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    WAIT_PENDING_MS_FIELD_NUMBER: _ClassVar[int]
    layout: bytes
    keys: bytes
    key_width: int
    start_token: int
    want_plan: bool
    prompt_tokens: int
    replica: str
    wait_pending_ms: int
    def __init__(self, layout: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., key_width: _Optional[int] = ..., start_token: _Optional[int] = ..., want_plan: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ..., replica: _Optional[str] = ..., wait_pending_ms: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_blocks", "tiers", "plan")
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    hit_blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    plan: Plan
    def __init__(self, hit_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("layout", "keys", "key_width", "lease_ttl_ms")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    layout: bytes
    keys: bytes
    key_width: int
    lease_ttl_ms: int
    def __init__(self, layout: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., key_width: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "count", "offsets", "block_bytes", "segment", "source_tiers", "lease_ttl_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    count: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    segment: SegmentInfo
    source_tiers: _containers.RepeatedScalarFieldContainer[Tier]
    lease_ttl_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., count: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ..., segment: _Optional[_Union[SegmentInfo, _Mapping]] = ..., source_tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "bytes", "seconds")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    bytes: int
    seconds: float
    def __init__(self, lease_id: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "lease_ttl_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_ttl_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease_ttl_ms",)
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    def __init__(self, lease_ttl_ms: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("layout", "keys", "key_width", "parent_key", "lease_ttl_ms", "handoff")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    layout: bytes
    keys: bytes
    key_width: int
    parent_key: bytes
    lease_ttl_ms: int
    handoff: bool
    def __init__(self, layout: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., key_width: _Optional[int] = ..., parent_key: _Optional[bytes] = ..., lease_ttl_ms: _Optional[int] = ..., handoff: _Optional[bool] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("lease_id", "indices", "offsets", "block_bytes", "segment", "lease_ttl_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    indices: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    segment: SegmentInfo
    lease_ttl_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., indices: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ..., segment: _Optional[_Union[SegmentInfo, _Mapping]] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id", "bytes", "seconds")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    bytes: int
    seconds: float
    def __init__(self, lease_id: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    def __init__(self, committed: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReadBlocksRequest(_message.Message):
    __slots__ = ("layout", "keys", "key_width")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    layout: bytes
    keys: bytes
    key_width: int
    def __init__(self, layout: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., key_width: _Optional[int] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("index", "offset", "data", "count")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    count: int
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., count: _Optional[int] = ...) -> None: ...

class WriteHeader(_message.Message):
    __slots__ = ("layout", "keys", "key_width", "parent_key")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    layout: bytes
    keys: bytes
    key_width: int
    parent_key: bytes
    def __init__(self, layout: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., key_width: _Optional[int] = ..., parent_key: _Optional[bytes] = ...) -> None: ...

class WriteBlocksRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: WriteHeader
    chunk: BlockChunk
    def __init__(self, header: _Optional[_Union[WriteHeader, _Mapping]] = ..., chunk: _Optional[_Union[BlockChunk, _Mapping]] = ...) -> None: ...

class WriteBlocksResponse(_message.Message):
    __slots__ = ("stored", "skipped")
    STORED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    skipped: int
    def __init__(self, stored: _Optional[int] = ..., skipped: _Optional[int] = ...) -> None: ...

class ReportHbmRequest(_message.Message):
    __slots__ = ("layout", "replica", "key_width", "added", "removed", "reset")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    KEY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    layout: bytes
    replica: str
    key_width: int
    added: bytes
    removed: bytes
    reset: bool
    def __init__(self, layout: _Optional[bytes] = ..., replica: _Optional[str] = ..., key_width: _Optional[int] = ..., added: _Optional[bytes] = ..., removed: _Optional[bytes] = ..., reset: _Optional[bool] = ...) -> None: ...

class ReportHbmResponse(_message.Message):
    __slots__ = ("tracked",)
    TRACKED_FIELD_NUMBER: _ClassVar[int]
    tracked: int
    def __init__(self, tracked: _Optional[int] = ...) -> None: ...

class ReportPrefillRequest(_message.Message):
    __slots__ = ("layout", "tokens", "seconds", "context_tokens")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    layout: bytes
    tokens: int
    seconds: float
    context_tokens: int
    def __init__(self, layout: _Optional[bytes] = ..., tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., context_tokens: _Optional[int] = ...) -> None: ...

class ReportPrefillResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportVerificationRequest(_message.Message):
    __slots__ = ("layout", "key_width", "keys", "matched", "mismatched", "detail")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    MISMATCHED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    layout: bytes
    key_width: int
    keys: bytes
    matched: int
    mismatched: bool
    detail: str
    def __init__(self, layout: _Optional[bytes] = ..., key_width: _Optional[int] = ..., keys: _Optional[bytes] = ..., matched: _Optional[int] = ..., mismatched: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class ReportVerificationResponse(_message.Message):
    __slots__ = ("quarantined_dram", "quarantined_ssd", "quarantined_remote", "deferred")
    QUARANTINED_DRAM_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_SSD_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_REMOTE_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    quarantined_dram: int
    quarantined_ssd: int
    quarantined_remote: int
    deferred: bool
    def __init__(self, quarantined_dram: _Optional[int] = ..., quarantined_ssd: _Optional[int] = ..., quarantined_remote: _Optional[int] = ..., deferred: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    blocks: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "active_leases", "lookups", "blocks_hit", "blocks_missed", "tenant_dram_bytes", "tenant_ssd_bytes", "tenant_dram_quota_bytes", "tenant_ssd_quota_bytes", "segment", "uptime_seconds", "layouts", "writeback_dropped", "checksum_failures", "version", "mrc", "node_wide", "tenant_dram_guarantee_bytes", "mrc_sampled_blocks", "groups", "verify_verified_blocks", "verify_mismatched_blocks", "verify_quarantined_blocks")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_HIT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_MISSED_FIELD_NUMBER: _ClassVar[int]
    TENANT_DRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_SSD_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_DRAM_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_SSD_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    WRITEBACK_DROPPED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MRC_FIELD_NUMBER: _ClassVar[int]
    NODE_WIDE_FIELD_NUMBER: _ClassVar[int]
    TENANT_DRAM_GUARANTEE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MRC_SAMPLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_VERIFIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MISMATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_QUARANTINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    active_leases: int
    lookups: int
    blocks_hit: int
    blocks_missed: int
    tenant_dram_bytes: int
    tenant_ssd_bytes: int
    tenant_dram_quota_bytes: int
    tenant_ssd_quota_bytes: int
    segment: SegmentInfo
    uptime_seconds: float
    layouts: int
    writeback_dropped: int
    checksum_failures: int
    version: str
    mrc: _containers.RepeatedCompositeFieldContainer[MrcPoint]
    node_wide: bool
    tenant_dram_guarantee_bytes: int
    mrc_sampled_blocks: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupStats]
    verify_verified_blocks: int
    verify_mismatched_blocks: int
    verify_quarantined_blocks: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., active_leases: _Optional[int] = ..., lookups: _Optional[int] = ..., blocks_hit: _Optional[int] = ..., blocks_missed: _Optional[int] = ..., tenant_dram_bytes: _Optional[int] = ..., tenant_ssd_bytes: _Optional[int] = ..., tenant_dram_quota_bytes: _Optional[int] = ..., tenant_ssd_quota_bytes: _Optional[int] = ..., segment: _Optional[_Union[SegmentInfo, _Mapping]] = ..., uptime_seconds: _Optional[float] = ..., layouts: _Optional[int] = ..., writeback_dropped: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., version: _Optional[str] = ..., mrc: _Optional[_Iterable[_Union[MrcPoint, _Mapping]]] = ..., node_wide: _Optional[bool] = ..., tenant_dram_guarantee_bytes: _Optional[int] = ..., mrc_sampled_blocks: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupStats, _Mapping]]] = ..., verify_verified_blocks: _Optional[int] = ..., verify_mismatched_blocks: _Optional[int] = ..., verify_quarantined_blocks: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class MrcPoint(_message.Message):
    __slots__ = ("scaled", "factor", "dram_blocks", "ssd_blocks", "dram_hit_ratio", "hit_ratio")
    SCALED_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    DRAM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SSD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAM_HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    scaled: str
    factor: float
    dram_blocks: int
    ssd_blocks: int
    dram_hit_ratio: float
    hit_ratio: float
    def __init__(self, scaled: _Optional[str] = ..., factor: _Optional[float] = ..., dram_blocks: _Optional[int] = ..., ssd_blocks: _Optional[int] = ..., dram_hit_ratio: _Optional[float] = ..., hit_ratio: _Optional[float] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("since_sequence",)
    SINCE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    since_sequence: int
    def __init__(self, since_sequence: _Optional[int] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "block_size", "medium", "layout")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    block_size: int
    medium: Tier
    layout: bytes
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., block_size: _Optional[int] = ..., medium: _Optional[_Union[Tier, str]] = ..., layout: _Optional[bytes] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium", "layout")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: Tier
    layout: bytes
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[_Union[Tier, str]] = ..., layout: _Optional[bytes] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("sequence", "timestamp", "stored", "removed")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    timestamp: float
    stored: BlockStored
    removed: BlockRemoved
    def __init__(self, sequence: _Optional[int] = ..., timestamp: _Optional[float] = ..., stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ...) -> None: ...

class Selector(_message.Message):
    __slots__ = ("tenant", "all_tenants", "model_id", "layout")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ALL_TENANTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    all_tenants: bool
    model_id: str
    layout: bytes
    def __init__(self, tenant: _Optional[str] = ..., all_tenants: _Optional[bool] = ..., model_id: _Optional[str] = ..., layout: _Optional[bytes] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("scope", "keys", "key_width", "clear", "local_only")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    scope: Selector
    keys: bytes
    key_width: int
    clear: bool
    local_only: bool
    def __init__(self, scope: _Optional[_Union[Selector, _Mapping]] = ..., keys: _Optional[bytes] = ..., key_width: _Optional[int] = ..., clear: _Optional[bool] = ..., local_only: _Optional[bool] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("namespaces", "blocks", "dram_blocks", "ssd_blocks", "remote_blocks", "doomed_blocks", "remote_error")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SSD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DOOMED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ERROR_FIELD_NUMBER: _ClassVar[int]
    namespaces: int
    blocks: int
    dram_blocks: int
    ssd_blocks: int
    remote_blocks: int
    doomed_blocks: int
    remote_error: str
    def __init__(self, namespaces: _Optional[int] = ..., blocks: _Optional[int] = ..., dram_blocks: _Optional[int] = ..., ssd_blocks: _Optional[int] = ..., remote_blocks: _Optional[int] = ..., doomed_blocks: _Optional[int] = ..., remote_error: _Optional[str] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("scope", "keys", "key_width", "ttl_seconds", "hint")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    scope: Selector
    keys: bytes
    key_width: int
    ttl_seconds: float
    hint: bool
    def __init__(self, scope: _Optional[_Union[Selector, _Mapping]] = ..., keys: _Optional[bytes] = ..., key_width: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., hint: _Optional[bool] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("namespaces", "asked", "pinned", "new_pins", "ttl_seconds")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    ASKED_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    NEW_PINS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    namespaces: int
    asked: int
    pinned: int
    new_pins: int
    ttl_seconds: float
    def __init__(self, namespaces: _Optional[int] = ..., asked: _Optional[int] = ..., pinned: _Optional[int] = ..., new_pins: _Optional[int] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("scope", "keys", "key_width")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    scope: Selector
    keys: bytes
    key_width: int
    def __init__(self, scope: _Optional[_Union[Selector, _Mapping]] = ..., keys: _Optional[bytes] = ..., key_width: _Optional[int] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("unpinned",)
    UNPINNED_FIELD_NUMBER: _ClassVar[int]
    unpinned: int
    def __init__(self, unpinned: _Optional[int] = ...) -> None: ...

class ListPinsRequest(_message.Message):
    __slots__ = ("scope",)
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    scope: Selector
    def __init__(self, scope: _Optional[_Union[Selector, _Mapping]] = ...) -> None: ...

class PinnedNamespace(_message.Message):
    __slots__ = ("tenant", "model_id", "layout", "blocks", "first_expiry_seconds", "last_expiry_seconds")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_EXPIRY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_EXPIRY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model_id: str
    layout: bytes
    blocks: int
    first_expiry_seconds: float
    last_expiry_seconds: float
    def __init__(self, tenant: _Optional[str] = ..., model_id: _Optional[str] = ..., layout: _Optional[bytes] = ..., blocks: _Optional[int] = ..., first_expiry_seconds: _Optional[float] = ..., last_expiry_seconds: _Optional[float] = ...) -> None: ...

class ListPinsResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[PinnedNamespace]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[PinnedNamespace, _Mapping]]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("scope", "keys", "key_width", "hint")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    scope: Selector
    keys: bytes
    key_width: int
    hint: bool
    def __init__(self, scope: _Optional[_Union[Selector, _Mapping]] = ..., keys: _Optional[bytes] = ..., key_width: _Optional[int] = ..., hint: _Optional[bool] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("namespaces", "asked", "in_dram", "from_ssd", "from_remote", "missing")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    ASKED_FIELD_NUMBER: _ClassVar[int]
    IN_DRAM_FIELD_NUMBER: _ClassVar[int]
    FROM_SSD_FIELD_NUMBER: _ClassVar[int]
    FROM_REMOTE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    namespaces: int
    asked: int
    in_dram: int
    from_ssd: int
    from_remote: int
    missing: int
    def __init__(self, namespaces: _Optional[int] = ..., asked: _Optional[int] = ..., in_dram: _Optional[int] = ..., from_ssd: _Optional[int] = ..., from_remote: _Optional[int] = ..., missing: _Optional[int] = ...) -> None: ...
