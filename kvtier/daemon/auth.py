"""Tenants and tokens: who a caller is, and how many DRAM/SSD bytes it may hold.

Without a tokens file the daemon has one tenant, `default`, with no quota and no authentication
(the Unix socket's mode 0600 is the boundary), who counts as admin. With one, every call must
carry the gRPC metadata `authorization: Bearer <token>`, and the token decides the tenant; keys
are namespaced by that tenant, never by anything the client claims. The tokens file is TOML:

    [tenants.alice]
    token = "s3cret-alice"          # or token_sha256 = "<hex digest of the token>"
    dram_quota = "2GiB"             # optional; 0 or absent = unlimited
    ssd_quota = "20GiB"
    dram_guarantee = "1GiB"         # optional: its slice of the DRAM pool is at least this
    admin = true                    # optional: Stats and WatchEvents show the whole node

    [tenants.bob]
    token_sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

Whitespace around a presented token is not part of it (as around an HTTP field's value): "Bearer
 s3cret-alice " and a hello or fd request with spaces around the token name alice on every
transport. A token in the file with whitespace around it could therefore never be presented, and
is refused when the file is read.

Tokens are compared as SHA-256 digests in constant time. Immutable after construction; safe to
share between threads. A SIGHUP reload (`kvtier.daemon.reload`) builds a new one from the file and
swaps it in whole, so a call sees either the old tenants or the new ones, never a mix.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path

from kvtier.core.errors import Unauthenticated, UsageError
from kvtier.core.units import parse_bytes
from kvtier.daemon.cache.namespaces import Tenant

DEFAULT_TENANT = "default"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class Authenticator:
    """Maps `authorization` metadata to a `Tenant`."""

    def __init__(self, tenants: dict[bytes, Tenant] | None = None) -> None:
        self._by_digest = dict(tenants or {})
        self.required = bool(self._by_digest)
        self._default = Tenant(DEFAULT_TENANT, admin=True)

    @classmethod
    def from_file(cls, path: str | Path | None) -> Authenticator:
        """The daemon's authenticator: single tenant when `path` is empty. Raises UsageError."""
        if not path:
            return cls()
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise UsageError(f"tokens file {path}: {exc}") from None
        tenants = data.get("tenants")
        if not isinstance(tenants, dict) or not tenants:
            raise UsageError(f"tokens file {path}: needs at least one [tenants.NAME] table")
        by_digest: dict[bytes, Tenant] = {}
        for name, spec in tenants.items():
            where = f"tokens file {path}: tenant {name!r}"
            if not _NAME_RE.match(name):
                raise UsageError(f"{where}: name must match {_NAME_RE.pattern}")
            if not isinstance(spec, dict):
                raise UsageError(f"{where}: must be a table")
            unknown = set(spec) - {"token", "token_sha256", "dram_quota", "ssd_quota",
                                   "dram_guarantee", "admin"}
            if unknown:
                raise UsageError(f"{where}: unknown keys {sorted(unknown)}")
            digest = _digest_of(spec, where)
            if digest in by_digest:
                raise UsageError(f"{where}: token already used by {by_digest[digest].name!r}")
            admin = spec.get("admin", False)
            if not isinstance(admin, bool):
                raise UsageError(f"{where}: admin must be true or false")
            quota = parse_bytes(spec.get("dram_quota", 0), f"{where}: dram_quota")
            guarantee = parse_bytes(spec.get("dram_guarantee", 0), f"{where}: dram_guarantee")
            if quota and guarantee > quota:
                raise UsageError(f"{where}: dram_guarantee exceeds its dram_quota")
            by_digest[digest] = Tenant(
                name, quota, parse_bytes(spec.get("ssd_quota", 0), f"{where}: ssd_quota"),
                guarantee, admin,
            )
        return cls(by_digest)

    def digests(self) -> dict[str, bytes]:
        """Tenant name -> its token's SHA-256 digest (empty without a tokens file)."""
        return {t.name: d for d, t in self._by_digest.items()}

    def tenants(self) -> list[Tenant]:
        return list(self._by_digest.values()) if self.required else [self._default]

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant:
        """The caller's tenant. Raises Unauthenticated when a required token is missing or wrong."""
        if not self.required:
            return self._default
        values = [v for k, v in (metadata or ()) if k.lower() == "authorization"]
        if not values:
            raise Unauthenticated("missing 'authorization: Bearer <token>' metadata")
        value = values[0]
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
        digest = hashlib.sha256(token.strip().encode()).digest()
        found: Tenant | None = None
        for known, tenant in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                found = tenant
        if found is None:
            raise Unauthenticated("unknown token")
        return found


def _digest_of(spec: dict[str, object], where: str) -> bytes:
    token, hexed = spec.get("token"), spec.get("token_sha256")
    if (token is None) == (hexed is None):
        raise UsageError(f"{where}: give exactly one of token or token_sha256")
    if token is not None:
        if not isinstance(token, str) or len(token) < 8:
            raise UsageError(f"{where}: token must be a string of at least 8 characters")
        if token != token.strip():
            raise UsageError(f"{where}: token has whitespace around it (clients' tokens are "
                             "read without it, so this one could never be presented)")
        return hashlib.sha256(token.encode()).digest()
    if not isinstance(hexed, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", hexed):
        raise UsageError(f"{where}: token_sha256 must be 64 hex digits")
    return bytes.fromhex(hexed)
