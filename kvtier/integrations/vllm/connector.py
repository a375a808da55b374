"""`KvtierConnector`: vLLM's KV-connector API (`KVConnectorBase_V1`) over the kvtier daemon.

    LLM(model, kv_transfer_config=KVTransferConfig(
        kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_connector_extra_config={...}))     # keys: settings.py

vLLM builds one instance per role: in the scheduler (`scheduler.py`: lookups, leases, what to
store) and in each worker (`worker.py`: the copies). This class only routes vLLM's calls to the
side of its role. vLLM's `kv_role` decides what it does (`settings.Role`: a `kv_producer` only
stores, as a prefill's hand-off; a `kv_consumer` only loads, waiting for blocks still being
written; `kv_both` both); an unknown role, or one its extra config contradicts, stops the
engine's start with one line (`SettingsError`). A configuration kvtier cannot serve (Mamba
state without vLLM's checkpoints, ...) logs one warning and the connector does nothing; an
unreachable daemon makes it do nothing until it is back.

The connector supports vLLM's hybrid KV cache manager (`SupportsHMA`): with it vLLM keeps that
manager on (sliding-window layers keep only their window; Mamba hybrids start at all), and
models with several KV cache groups, a sliding window or recurrent state are served per group
(`layout.py`).

Load failures are recomputed: the connector sets vLLM's `kv_load_failure_policy` to
"recompute" (a cache miss must never fail a request).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.integrations.vllm.events import TierEvents, tier_events
from kvtier.integrations.vllm.layout import Unsupported, default_model_id, engine_kv
from kvtier.integrations.vllm.metadata import KvtierMetadata
from kvtier.integrations.vllm.pages import PREFERRED_LAYOUT
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.settings import ConnectorSettings, role_of
from kvtier.integrations.vllm.stats import KvtierConnectorStats, KvtierPromMetrics
from kvtier.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.integrations.vllm")


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError):
        return 0


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(ktc.kv_connector_extra_config)
        self.pd_role = role_of(ktc.kv_role, self.settings, ktc.kv_connector_extra_config)
        ktc.kv_load_failure_policy = "recompute"
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.tier_events: TierEvents | None = None
        mc = vllm_config.model_config
        model_id = self.settings.model_id or default_model_id(
            mc, vllm_config.load_config, mc.seed)
        rank = 0 if role == KVConnectorRole.SCHEDULER else _tp_rank()
        try:
            kv = engine_kv(vllm_config, kv_cache_config, rank, model_id)
        except Unsupported as exc:
            log.warning("kvtier connector disabled: %s", exc)
            return
        if role == KVConnectorRole.SCHEDULER:
            pc = vllm_config.parallel_config
            self.scheduler = SchedulerSide(
                self.settings, kv, int(pc.tensor_parallel_size),
                max(int(mc.get_total_num_kv_heads()), 1), bool(getattr(mc, "use_mla", False)),
                self.pd_role)
            self.tier_events = tier_events(vllm_config, self.scheduler.links[0])
        else:
            _init_cpu_isa()
            self.worker = WorkerSide(self.settings, kv, rank, self.pd_role)
        log.info("kvtier connector (%s, %s): model %r, %d-byte blocks of %d tokens, shard %d/%d, "
                 "daemon %s, layout %s (layers %s)", role.name.lower(), self.pd_role.name,
                 model_id, kv.block_bytes, kv.block_tokens, kv.shard.number, kv.shard.of,
                 self.settings.socket or "default socket", kv.describe(),
                 ",".join(kv.layer_names))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, never wrong output

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker is None:
            return
        try:
            self.worker.register_kv_caches(kv_caches)
        except Unsupported as exc:
            log.warning("kvtier connector disabled: %s", exc)
            self.worker = None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, KvtierMetadata):
            self.worker.bind(connector_metadata)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return PREFERRED_LAYOUT  # pages in [H, N, C] order, one run per block (pages.py)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and isinstance(meta, KvtierMetadata):
            # a full CUDA graph's replay skips wait_for_layer_load: wait for every layer here
            mode = getattr(forward_context, "cudagraph_runtime_mode", None)
            self.worker.start_load_kv(meta, wait_all=getattr(mode, "name", "") == "FULL")

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_for_layer_load(layer_name)  # that layer's copy only

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # wait_for_save copies whole blocks after the forward

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and isinstance(meta, KvtierMetadata):
            self.worker.wait_for_save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.worker is not None:
            done, failed = self.worker.transfer_results()
        else:  # disabled on this worker only: the scheduler's hybrid loads must still end
            meta = self._connector_metadata
            done = failed = ({job.req_id for job in meta.loads if job.groups}
                             if isinstance(meta, KvtierMetadata) else set())
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> KvtierConnectorStats | None:
        """The worker's counters since the last call; on the scheduler side (vLLM asks it too,
        every step), the tier events dropped since then."""
        data: dict[str, Any] = self.worker.stats.take() if self.worker is not None else {}
        if self.tier_events is not None:
            data["dropped_tier_events"] = self.tier_events.take_dropped()
        stats = KvtierConnectorStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KvtierConnectorStats | None:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """kvtier's tier events since the last step (`events.py`), beside vLLM's own."""
        return self.tier_events.take() if self.tier_events is not None else ()

    def shutdown(self) -> None:
        if self.tier_events is not None:
            self.tier_events.close()
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        # (None, False) while the Lookup runs off this thread: vLLM asks again next step
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.scheduler is None:
            return KvtierMetadata()
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is None:
            return False, None
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is None:
            return False, None
        return self.scheduler.request_finished(request)  # nothing is held past a step


def _init_cpu_isa() -> None:
    """Request the AMX tile state before vLLM's CPU attention kernels can use it (a first
    forward over loaded KV otherwise dies with SIGILL on a CPU with AMX; docs/history/
    architecture-log.md, "vLLM connector"). A no-op without AMX or off CPU."""
    init = getattr(torch.cpu, "_init_amx", None)
    if init is not None:
        try:
            init()
        except Exception as exc:
            log.debug("torch.cpu._init_amx failed: %s", exc)
