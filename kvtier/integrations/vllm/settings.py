"""`kv_connector_extra_config` of the vLLM connector: every key, its default, its check. Pure.

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket": "/run/kvtier/kvtier.sock"}}'
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.integrations.common.extra import SettingsError, parse_extra

__all__ = ["ConnectorSettings", "SettingsError"]

TRANSFERS = ("auto", "engine", "torch")


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What the connector reads from `kv_connector_extra_config` (docs/vllm.md lists the
    same keys and defaults)."""

    socket: str = ""
    """The daemon's Unix socket; "" = `$KVTIER_SOCKET`, else the default of `kvtier serve`."""
    token: str = ""
    """Bearer token of the tenant ("" = the daemon's default tenant)."""
    model_id: str = ""
    """Whose KV the blocks hold; "" = an id that follows the weights (`common/identity.py`: a cheap
    digest of a local directory's weight files, a hub model's snapshot commit, the seed of
    dummy weights; plus dtype and quantization)."""
    timeout_s: float = 1.0
    """Bound on each call to the daemon; a slow or dead daemon costs a step at most this."""
    retry_after_s: float = 10.0
    """After the daemon is found unreachable: run without kvtier this long, then reconnect."""
    use_plan: bool = True
    """Ask the daemon's planner how much of a hit to fetch (False: fetch every cached block)."""
    store: bool = True
    """Store newly computed full blocks (False: only load)."""
    lease_ttl_s: float = 0.0
    """Lease on blocks being loaded; 0 = the daemon's default."""
    async_lookup: bool = True
    """Run each request's Lookup on a background thread: vLLM is told "not known yet" and asks
    again at its next step, so the scheduler's thread never waits for the daemon (False: the
    Lookup runs on the scheduler's thread, within `get_num_new_matched_tokens`)."""
    async_save: bool = True
    """Store computed blocks on a background thread: `wait_for_save` only copies them into a
    staging buffer (False: Allocate, copy and Commit within `wait_for_save`)."""
    save_buffer_mib: float = 256.0
    """Bound on the staging buffer of `async_save`: a step whose blocks do not fit waits for
    the saves before it (backpressure; a save is never dropped for it)."""
    prefill_report_s: float = 2.0
    """Report vLLM's measured prefill rate to the daemon's planner at most this often
    (0 = never)."""
    verify_sample: float = 0.01
    """Shadow verification: the fraction of requests with a hit that are recomputed instead of
    loaded, their computed blocks compared with the bytes kvtier holds under the same keys
    (within the engine's numerical spread, `common/verify.py`); a mismatch quarantines the
    block and its descendants on every tier of the daemon (0 = never)."""
    transfer: str = "auto"
    """How loads copy slots into vLLM's cache: "engine" (kvtier's TransferEngine, layer by
    layer: CUDA kernels or batched DMA on a GPU, its CPU backend otherwise), "torch"
    (synchronous torch indexing, every layer before the forward), "auto" (the engine: measured
    faster on CPU too, docs/benchmarks.md; on CUDA without CuPy, torch with a warning)."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        s = parse_extra(cls, extra, where="kv_connector_extra_config")
        if s.transfer not in TRANSFERS:
            raise SettingsError(f"kvtier connector: kv_connector_extra_config['transfer'] must "
                                f"be one of {list(TRANSFERS)}, got {s.transfer!r}")
        if (s.timeout_s <= 0 or s.retry_after_s < 0 or s.lease_ttl_s < 0
                or s.prefill_report_s < 0 or s.save_buffer_mib <= 0
                or not 0.0 <= s.verify_sample <= 1.0):
            raise SettingsError("kvtier connector: timeout_s and save_buffer_mib must be > 0, "
                                "retry_after_s, lease_ttl_s and prefill_report_s >= 0, "
                                "verify_sample within [0, 1]")
        return s
