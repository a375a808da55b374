"""SIGHUP: reload what can change while serving, keep the rest, and say which is which.

The daemon re-reads its configuration from the same sources it started from (`ConfigSource`: the
same flags, environment and TOML file) and the tokens file, validates all of it, and only then
applies it (nothing changes when anything is invalid: one ERROR line says why). What changes live:

    tokens file            re-read even when its path is the same: tenants added, revoked, their
                           tokens, quotas and guarantees; the DRAM and SSD contents stay (a
                           revoked tenant's calls are refused from then on, its blocks are evicted
                           like any other's and lose its DRAM guarantee); tenants on or off
                           (a tokens file set or removed) needs a restart: the running
                           authenticator and pool stay as they are, in both directions
    log_level              the root logger's level
    ssd_dwpd, ssd_write_bytes_per_day, ssd_write_burst_bytes     the SSD wear budget's rate/burst
    remote_write_bytes_per_s, remote_write_burst_bytes          the remote write-through rate
    remote_url, remote_mode, remote_username, remote_password, remote_tls_*, remote_timeout_s,
    remote_prefix          while the remote tier is on: it connects to the store so described
                           from then on (calls under way on the old one end as an outage would);
                           turning the tier on or off ("" <-> a URL) needs a restart

Every other setting (the socket, the tiers' sizes and places, the remote store's address and
credentials, ...) needs a restart: a change to one of them in the TOML file is named in one
WARNING line and the running value is kept. A changed setting is one whose value in the file
differs from the file at the previous (re)load and whose merged value differs from the running
one, so a machine-sized default that drifted (free /dev/shm with our own segment in it) is not
taken for a change. Each reload logs one INFO line of what changed (or that nothing did).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kvtier.core.errors import UsageError
from kvtier.core.paths import CONFIG_FILE, config_dirs
from kvtier.core.units import format_bytes
from kvtier.daemon import config as config_mod
from kvtier.daemon.auth import Authenticator
from kvtier.daemon.config import Config
from kvtier.tiers.dram_regions import tenant_count_problem

if TYPE_CHECKING:
    from kvtier.core.wear import WriteBudget
    from kvtier.daemon.cache.namespaces import Tenant
    from kvtier.daemon.cache.remote_tier import RemoteTier

log = logging.getLogger(__name__)

LIVE_BUDGET = ("ssd_dwpd", "ssd_write_bytes_per_day", "ssd_write_burst_bytes")
LIVE_REMOTE = ("remote_write_bytes_per_s", "remote_write_burst_bytes")
LIVE_REMOTE_STORE = ("remote_url", "remote_mode", "remote_username", "remote_password",
                     "remote_tls_ca", "remote_tls_cert", "remote_tls_key", "remote_timeout_s",
                     "remote_prefix")
"""Live while a remote tier runs and stays on: the daemon connects to the store so described."""
LIVE = frozenset(("tokens_file", "log_level", *LIVE_BUDGET, *LIVE_REMOTE, *LIVE_REMOTE_STORE))
"""Settings a SIGHUP applies; every other one needs a restart (as does turning the remote tier
on or off: `remote_url` from or to "")."""


class ConfigSource:
    """Where a daemon's configuration came from, to load it again: the flags and the TOML file
    (resolved once, as `config.load` resolves it; the environment is the process's own)."""

    def __init__(self, flags: Mapping[str, object] | None = None,
                 config_path: str | None = None, env: Mapping[str, str] | None = None) -> None:
        self.flags = dict(flags or {})
        self.env = os.environ if env is None else env
        path = config_path or self.env.get("KVTIER_CONFIG")
        if not path:
            found = [d / CONFIG_FILE for d in config_dirs(self.env) if (d / CONFIG_FILE).is_file()]
            path = str(found[0]) if found else None
        self.path = path

    def load(self) -> Config:
        return config_mod.load(self.flags, self.env, self.path)

    def file_values(self) -> dict[str, Any]:
        """The TOML file's settings as written ({} without a file; the error is `load`'s)."""
        if not self.path:
            return {}
        try:
            return config_mod._read_toml(Path(self.path))
        except UsageError:
            return {}


class Changes(NamedTuple):
    live: dict[str, tuple[object, object]]  # setting -> (running value, new value)
    fixed: list[str]  # changed in the file, needs a restart: kept


def changes(old: Config, new: Config, old_file: Mapping[str, Any],
            new_file: Mapping[str, Any]) -> Changes:
    """What a reload would change (see the module docstring)."""
    live: dict[str, tuple[object, object]] = {}
    fixed: list[str] = []
    in_file = {k for k in {*old_file, *new_file} if old_file.get(k) != new_file.get(k)}
    for f in dataclasses.fields(Config):
        was, now = getattr(old, f.name), getattr(new, f.name)
        if was == now:
            continue
        if f.name == "remote_url" and not (was and now):
            fixed.append(f.name)  # the remote tier on or off: its queue and slots are sized
        elif f.name == "tokens_file" and not (was and now):
            fixed.append(f.name)  # tenants on or off: the DRAM pool is shared or isolated
        elif f.name in LIVE:
            live[f.name] = (was, now)
        elif f.name in in_file:
            fixed.append(f.name)
    return Changes(live, fixed)


class TenantChanges(NamedTuple):
    added: list[str]
    revoked: list[str]
    changed: list[str]  # token, quota, guarantee or admin flag
    rekeyed: list[str]  # revoked, or its token changed: an fd fetched before must not follow


def tenant_changes(old: Authenticator, new: Authenticator) -> TenantChanges:
    old_t = {t.name: t for t in old.tenants()}
    new_t = {t.name: t for t in new.tenants()}
    old_d, new_d = old.digests(), new.digests()
    revoked = sorted(old_t.keys() - new_t.keys())
    rotated = {n for n in new_t.keys() & old_t.keys() if new_d.get(n) != old_d.get(n)}
    return TenantChanges(
        sorted(new_t.keys() - old_t.keys()), revoked,
        sorted(n for n in new_t.keys() & old_t.keys()
               if new_t[n] != old_t[n] or n in rotated),
        sorted(rotated.union(revoked)))


def _shown(name: str, value: object) -> str:
    if name in config_mod.SECRETS:
        return "(changed)" if value else "(none)"
    if name == "remote_url" and isinstance(value, str) and "@" in value:
        scheme, _, rest = value.partition("://")
        return repr(f"{scheme}://…@{rest.rpartition('@')[2]}")  # never a password in the log
    if isinstance(value, int) and name.endswith(("_bytes", "_bytes_per_day", "_bytes_per_s")):
        return format_bytes(value)
    return repr(value) if isinstance(value, str) else f"{value}"


class Reloaded(NamedTuple):
    cfg: Config
    auth: Authenticator
    summary: str  # the INFO line
    kept: str | None  # the WARNING line naming what needs a restart, if any


def prepare(source: ConfigSource, running: Config, auth: Authenticator,
            old_file: Mapping[str, Any]) -> tuple[Reloaded, dict[str, Any]]:
    """Loads and validates everything a reload would apply; raises UsageError (nothing applied).
    Returns what to apply and the file's values (the next reload's `old_file`)."""
    new_file = source.file_values()
    loaded = source.load()
    found = changes(running, loaded, old_file, new_file)
    # tenants on or off is restart-only: the running authenticator stays, whichever direction
    new_auth = (auth if "tokens_file" in found.fixed
                else Authenticator.from_file(loaded.tokens_file))
    guaranteed = sum(t.dram_guarantee_bytes for t in new_auth.tenants())
    if guaranteed > running.dram_bytes:
        raise UsageError(f"tokens file {loaded.tokens_file}: the tenants' dram_guarantee add up "
                         f"to {format_bytes(guaranteed)}, more than the DRAM pool "
                         f"({format_bytes(running.dram_bytes)})")
    problem = (tenant_count_problem(len(new_auth.tenants()), loaded.tokens_file)
               if new_auth.required else None)
    if problem:
        raise UsageError(problem)
    # the running configuration with only the live settings replaced
    updates: dict[str, Any] = {k: now for k, (_, now) in found.live.items()}
    cfg = dataclasses.replace(running, **updates)
    parts = [f"{k} {_shown(k, was)} -> {_shown(k, now)}" for k, (was, now) in found.live.items()
             if k != "tokens_file"]
    if "tokens_file" in found.live:
        parts.insert(0, f"tokens_file {found.live['tokens_file'][0]!r} -> "
                        f"{found.live['tokens_file'][1]!r}")
    who = tenant_changes(auth, new_auth)
    for label, names in (("added", who.added), ("revoked", who.revoked),
                         ("changed", who.changed)):
        if names:
            parts.append(f"tenants {label}: {', '.join(names)}")
    summary = "reloaded (SIGHUP): " + ("; ".join(parts) if parts else "nothing changed")
    kept = None
    if found.fixed:
        kept = (f"reload (SIGHUP): {', '.join(found.fixed)} cannot change while serving; "
                "keeping the running value (restart to apply)")
    return Reloaded(cfg, new_auth, summary, kept), new_file


class Running(Protocol):
    """What a reload changes in the running cache (`kvtier.daemon.cache.cache.Cache`)."""

    @property
    def write_budget(self) -> WriteBudget | None: ...

    @property
    def remote(self) -> RemoteTier | None: ...

    def set_tenants(self, tenants: Iterable[Tenant], revoked: Iterable[str],
                    rekeyed: Iterable[str] = ()) -> None: ...


def apply(r: Reloaded, running: Config, cache: Running | None, old_auth: Authenticator) -> None:
    """Applies a prepared reload to the running tiers (the caller swaps in `r.cfg`/`r.auth`)."""
    if r.cfg.log_level != running.log_level:
        logging.getLogger().setLevel(r.cfg.log_level.upper())
    if cache is None:
        return
    who = tenant_changes(old_auth, r.auth)
    cache.set_tenants(r.auth.tenants(), who.revoked, who.rekeyed)
    budget = cache.write_budget
    if budget is not None and any(getattr(r.cfg, k) != getattr(running, k) for k in LIVE_BUDGET):
        budget.retune(r.cfg.ssd_write_bytes_per_day, r.cfg.ssd_write_burst_bytes)
    remote = cache.remote
    if remote is not None and any(getattr(r.cfg, k) != getattr(running, k) for k in LIVE_REMOTE):
        remote.retune_writes(r.cfg.remote_write_bytes_per_s, r.cfg.remote_write_burst_bytes)
    if remote is not None and any(getattr(r.cfg, k) != getattr(running, k)
                                  for k in LIVE_REMOTE_STORE):
        from kvtier.tiers.remote import RemoteSpec, RemoteStore

        args = config_mod.remote_spec_args({k: getattr(r.cfg, k) for k in LIVE_REMOTE_STORE})
        remote.replace_store(RemoteStore(RemoteSpec(**args)))
        log.info("remote tier: now %s (%s)", remote.store.where(), r.cfg.remote_mode)
