"""`--hicache-storage-backend-extra-config` of the SGLang backend: every key, its default, its
check. Pure.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang.backend", "class_name": "KvtierStorage",
        "interface_v1": 1, "hicache_storage_pass_prefix_keys": true}'

SGLang removes its prefetch keys (`prefetch_threshold`, `prefetch_timeout_*`,
`hicache_storage_pass_prefix_keys`) before the backend sees the mapping; the dynamic loader's
own keys (`SGLANG_KEYS`) stay in it and are ignored here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.integrations.common.extra import SettingsError, parse_extra

SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1",
               "file_storage_path")
WHERE = "hicache_storage_backend_extra_config"


@dataclass(frozen=True, slots=True)
class StorageSettings:
    """What the backend reads from the extra config (docs/sglang.md lists the same
    keys and defaults)."""

    socket: str = ""
    """The daemon's Unix socket; "" = `$KVTIER_SOCKET`, else the default of `kvtier serve`."""
    token: str = ""
    """Bearer token of the tenant ("" = the daemon's default tenant)."""
    model_id: str = ""
    """Whose KV the pages hold; "" = an id that follows the weights (`layout.default_model_id`:
    a cheap digest of a local directory's weight files, a hub model's snapshot commit, the
    seed of dummy weights; plus dtype and quantization)."""
    timeout_s: float = 1.0
    """Bound on each call to the daemon; a slow or dead daemon costs a storage call at most
    this."""
    retry_after_s: float = 10.0
    """After the daemon is found unreachable: run without kvtier this long (or until a new
    daemon takes the socket), then reconnect."""
    lease_ttl_s: float = 0.0
    """Lease on pages being read or written; 0 = the daemon's default."""
    use_plan: bool = True
    """`batch_exists` answers the daemon planner's cut (pages worth fetching rather than
    recomputing; needs the model's config.json to be readable) instead of every cached page."""
    store: bool = True
    """Store pages SGLang backs up (False: only load)."""
    verify_sample: float = 0.01
    """Shadow verification: the fraction of `batch_exists` calls with a hit answered 0 instead
    (SGLang computes the pages), whose pages are compared with the bytes kvtier holds when
    SGLang backs them up; a mismatch quarantines the page and its descendants in the daemon
    (0 = never)."""
    chain_memory: int = 262144
    """Page keys whose parents the generic (non-v1) path remembers: SGLang's generic calls
    carry no prefix, and kvtier's keys form chains from a prompt's first page."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> StorageSettings:
        s = parse_extra(cls, extra, where=WHERE, ignore=SGLANG_KEYS)
        if (s.timeout_s <= 0 or s.retry_after_s < 0 or s.lease_ttl_s < 0 or s.chain_memory < 0
                or not 0.0 <= s.verify_sample <= 1.0):
            raise SettingsError(f"kvtier: {WHERE}: timeout_s must be > 0, retry_after_s, "
                                "lease_ttl_s and chain_memory >= 0, verify_sample within "
                                "[0, 1]")
        return s
