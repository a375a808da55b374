"""`kv_connector_extra_config` of the vLLM connector: every key, its default, its check; and
what vLLM's `kv_role` makes the connector do (`Role`). Pure.

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket": "/run/kvtier/kvtier.sock"}}'

Roles (prefill/decode disaggregation):

    kv_producer   a prefill engine: stores what it computes, never looks up or loads; its
                  stores are hand-offs (`AllocateRequest.handoff`): allocated within the step
                  that computed them, so the blocks are pending at the daemon before the request
                  answers, and written to the remote tier ahead of background copies
    kv_consumer   a decode engine: loads what the daemon holds, never stores (no Allocate, no
                  save queued); its lookups wait up to `pending_wait_s` for blocks a producer is
                  still writing; it loads every held block (the planner is not asked unless
                  `use_plan` is set: a decode engine's compute is for decoding)
    kv_both       looks up, loads and stores (the default of a single engine)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvtier.integrations.common.extra import SettingsError, parse_extra

__all__ = ["ROLES", "ConnectorSettings", "Role", "SettingsError", "role_of"]

TRANSFERS = ("auto", "engine", "torch")
ROLES = ("kv_producer", "kv_consumer", "kv_both")


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
    """After the daemon is found unreachable: run without kvtier this long (or until a new
    daemon takes the socket), then reconnect."""
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
    pending_wait_s: float = 5.0
    """How long a `kv_consumer`'s lookup waits for blocks a producer is still writing (its
    prefill's stores; the daemon caps it, `max_pending_wait_s`); 0 = never. Other roles never
    wait."""
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
                or s.prefill_report_s < 0 or s.save_buffer_mib <= 0 or s.pending_wait_s < 0
                or not 0.0 <= s.verify_sample <= 1.0):
            raise SettingsError("kvtier connector: timeout_s and save_buffer_mib must be > 0, "
                                "retry_after_s, lease_ttl_s, prefill_report_s and "
                                "pending_wait_s >= 0, verify_sample within [0, 1]")
        return s


class Role(NamedTuple):
    """What the connector does in vLLM's `kv_role` (the module docstring)."""

    name: str
    loads: bool
    """Looks prompts up and loads what the daemon holds."""
    stores: bool
    """Stores the blocks the engine computes."""
    handoff: bool
    """Its stores are a prefill's hand-offs (pending from the step that computed them)."""
    wait_s: float
    """How long a lookup waits for blocks being written."""
    use_plan: bool
    """Asks the daemon's planner how much of a hit to fetch."""


def role_of(kv_role: object, settings: ConnectorSettings,
            extra: Mapping[str, Any] | None = None) -> Role:
    """The connector's role from vLLM's `kv_role` and the extra config (`extra`: the keys given,
    to tell an explicit setting from a default); `SettingsError` for an unknown role or one the
    settings contradict."""
    if kv_role not in ROLES:
        raise SettingsError(f"kvtier connector: kv_role must be one of {list(ROLES)}, "
                            f"got {kv_role!r}")
    given = dict(extra or {})
    if kv_role == "kv_consumer" and "store" in given and settings.store:
        raise SettingsError("kvtier connector: kv_role 'kv_consumer' never stores; drop "
                            "kv_connector_extra_config['store'] (or use kv_role 'kv_both')")
    if kv_role == "kv_producer" and not settings.store:
        raise SettingsError("kvtier connector: kv_role 'kv_producer' stores what it computes, "
                            "and kv_connector_extra_config['store'] is false (an engine that "
                            "only loads is a 'kv_consumer')")
    consumer = kv_role == "kv_consumer"
    return Role(str(kv_role), loads=kv_role != "kv_producer",
                stores=not consumer and settings.store, handoff=kv_role == "kv_producer",
                wait_s=settings.pending_wait_s if consumer else 0.0,
                use_plan=settings.use_plan if ("use_plan" in given or not consumer) else False)
