"""The remote tier's store: verified blocks in Redis / Valkey (standalone or cluster) via redis-py.

    key    b"<prefix>:" + namespace + b":" + block key     namespace = "<tenant>/ns2:<layout hex>"
    value  64-byte `blockfmt` header + payload             (header: payload xxh3-64, key digest
                                                            of the whole redis key, lengths)

The namespace (authenticated tenant × layout id, `kvtier.daemon.cache.namespaces`) is part of every
key, so two daemons sharing a store share blocks only within one tenant and one model layout,
and the header's key digest covers the whole key: a value copied or renamed to another key (another
tenant's) fails verification. Every fetched value is checked (header checksum, magic, version,
layout tag, key digest, length) and its payload checksummed **after** it is copied into the
caller's buffer, so what is served is what was verified; a damaged value is a miss, a counted
`Corruption` and a best-effort DEL.

Requests are pipelined (one round trip per call; in cluster mode redis-py's `ClusterPipeline`
groups the commands per node — no sharding of ours) and bounded by `timeout_s` per socket
operation (connect, send, receive). redis-py retries only a broken pooled connection, once; the
caller (`kvtier.daemon.cache.remote_tier`) decides what a failure means and when to try again.
Eviction is the store's (`maxmemory-policy allkeys-lru`): nothing here tracks what the store holds.

`redis` is imported when the first connection is made, so a daemon without a remote tier does not
need the package. Threading: one `RemoteStore` is shared by all threads (redis-py's connection
pools are thread-safe; each call uses its own pipeline).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit

from kvtier.core.errors import KvtierError, UsageError
from kvtier.tiers import blockfmt

if TYPE_CHECKING:
    from redis import Redis
    from redis.cluster import RedisCluster

log = logging.getLogger(__name__)

FETCH_CHUNK = 8
"""Blocks per GET pipeline of a fetch (see `RemoteStore._get_chunks`)."""
LAYOUT_TAG = blockfmt.layout_digest(b"kvtier-remote/v1")
"""The remote values' layout digest; each block's tenant and layout id are in its key."""

SCHEMES = ("redis", "rediss", "valkey", "valkeys", "unix")


class RemoteUnavailable(KvtierError):
    """The store could not be reached or answered with an error (not a damaged value)."""


@dataclass(frozen=True, slots=True)
class RemoteSpec:
    """Where the store is and how to talk to it (from the daemon's `remote_*` settings).

    `url`: redis://[user:pass@]host:port/db, rediss:// for TLS (valkey:// and valkeys:// are
    accepted as aliases), unix:///path. `cluster`: a Redis Cluster / Valkey cluster (the url
    names one startup node). `username`/`password` override the url's. TLS files (PEM): the CA
    to verify the server with, and a client certificate + key for mutual TLS.
    """

    url: str
    cluster: bool = False
    username: str = ""
    password: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    timeout_s: float = 0.25
    prefix: str = "kvtier"

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in SCHEMES:
            raise UsageError(f"remote_url: expected {'://, '.join(SCHEMES)}:// URL, "
                             f"got {self.url!r}")
        if (self.tls_ca or self.tls_cert or self.tls_key) and not self.tls:
            raise UsageError("remote_tls_*: TLS options need a rediss:// (or valkeys://) URL")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise UsageError("remote_tls_cert and remote_tls_key go together")
        if self.cluster and scheme == "unix":
            raise UsageError("remote_mode cluster needs a host:port URL, not unix://")
        if not 0 < self.timeout_s <= 60:
            raise UsageError(f"remote_timeout_s: must be in (0, 60] seconds, got "
                             f"{self.timeout_s}")
        if not self.prefix or ":" in self.prefix:
            raise UsageError(f"remote_prefix: must be non-empty without ':', got "
                             f"{self.prefix!r}")

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme in ("rediss", "valkeys")

    def redis_url(self) -> str:
        """The url with the valkey aliases spelled as redis-py expects."""
        scheme, rest = self.url.split("://", 1)
        return {"valkey": "redis", "valkeys": "rediss"}.get(scheme, scheme) + "://" + rest

    def client_kwargs(self) -> dict[str, Any]:
        """redis-py keyword arguments: timeouts, auth, TLS, and one immediate retry on a
        connection error only (a pooled connection the store closed: reconnect once), never on
        a timeout (a slow store costs one bounded wait, not two)."""
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.retry import Retry

        kw: dict[str, Any] = {
            "socket_timeout": self.timeout_s, "socket_connect_timeout": self.timeout_s,
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            "health_check_interval": 0,
        }
        if self.username:
            kw["username"] = self.username
        if self.password:
            kw["password"] = self.password
        if self.tls:
            if self.tls_ca:
                kw["ssl_ca_certs"] = self.tls_ca
            if self.tls_cert:
                kw["ssl_certfile"] = self.tls_cert
                kw["ssl_keyfile"] = self.tls_key
        return kw


class Fetched(NamedTuple):
    """Per key: payload bytes copied into its buffer, or None (absent, damaged, or after a
    miss: only a prefix is useful). `corrupt`: why each damaged value was rejected."""

    sizes: list[int | None]
    corrupt: list[blockfmt.Corruption]
    nbytes: int


class RemoteStore:
    def __init__(self, spec: RemoteSpec) -> None:
        self.spec = spec
        self._prefix = spec.prefix.encode() + b":"
        self._client: Redis | RedisCluster | None = None
        self._fetcher: ThreadPoolExecutor | None = None

    def key(self, ns: str, key: bytes) -> bytes:
        return self._prefix + ns.encode() + b":" + key

    def client(self) -> Redis | RedisCluster:
        """The redis-py client (connected on first use), for benchmarks and tools that compare
        against raw commands over the same connections."""
        return self._redis()

    def _redis(self) -> Redis | RedisCluster:
        client = self._client
        if client is None:
            try:
                if self.spec.cluster:
                    from redis.cluster import RedisCluster

                    client = RedisCluster.from_url(self.spec.redis_url(),
                                                   **self.spec.client_kwargs())
                else:
                    from redis import Redis

                    client = Redis.from_url(self.spec.redis_url(), **self.spec.client_kwargs())
            except Exception as exc:  # RedisClusterException, ConnectionError, OSError, ...
                raise RemoteUnavailable(f"remote store {self.where()}: {exc}") from exc
            self._client = client
        return client

    def where(self) -> str:
        u = urlsplit(self.spec.url)
        return f"{u.scheme}://{u.hostname or ''}{':' + str(u.port) if u.port else ''}{u.path}"

    def _run(self, commands: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """One pipelined round trip; per-command errors come back as exception objects."""
        try:
            pipe = self._redis().pipeline(transaction=False)
            for name, args in commands:
                pipe.execute_command(name, *args)
            return list(pipe.execute(raise_on_error=False))
        except RemoteUnavailable:
            raise
        except Exception as exc:  # ConnectionError, TimeoutError, ClusterDownError, OSError
            self._reset()
            raise RemoteUnavailable(f"remote store {self.where()}: "
                                    f"{type(exc).__name__}: {exc}") from exc

    def _reset(self) -> None:
        """Drops the client after a failure, so the next attempt reconnects (and, in cluster
        mode, re-reads the topology)."""
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a broken connection may fail again
                log.debug("closing the remote client failed", exc_info=True)

    def ping(self) -> float:
        """One PING round trip; its seconds."""
        started = time.perf_counter()
        got = self._run([("PING", ())])
        if isinstance(got[0], Exception):
            raise RemoteUnavailable(f"remote store {self.where()}: {got[0]}")
        return time.perf_counter() - started

    def present(self, ns: str, keys: Sequence[bytes]) -> int:
        """How many of `keys`' leading blocks the store holds. One multi-key EXISTS (split per
        slot by redis-py in cluster mode) answers the common cases, all or none, in one
        command; only a partial count costs a second round trip of one EXISTS per key."""
        rkeys = [self.key(ns, k) for k in keys]
        try:
            count = int(self._redis().exists(*rkeys))
        except RemoteUnavailable:
            raise
        except Exception as exc:
            self._reset()
            raise RemoteUnavailable(f"remote store {self.where()}: "
                                    f"{type(exc).__name__}: {exc}") from exc
        if count in (0, len(rkeys)):
            return count
        got = self._run([("EXISTS", (k,)) for k in rkeys])
        n = 0
        for r in got:
            if isinstance(r, Exception):
                raise RemoteUnavailable(f"remote store {self.where()}: EXISTS: {r}")
            if not r:
                break
            n += 1
        return n

    def get_into(
        self, ns: str, keys: Sequence[bytes], views: Sequence[memoryview],
    ) -> Fetched:
        """Fetches `keys` (one pipelined GET each), verifies each value and copies its payload
        into the same-index view, which must be exactly the block's payload size. Stops at the
        first absent or damaged block (the rest are None)."""
        if len(keys) != len(views):
            raise ValueError("one view per key")
        rkeys = [self.key(ns, k) for k in keys]
        sizes: list[int | None] = [None] * len(keys)
        corrupt: list[blockfmt.Corruption] = []
        damaged: list[bytes] = []
        total = 0
        i = 0
        for got in self._get_chunks(rkeys):
            for value in got:
                if isinstance(value, Exception):
                    raise RemoteUnavailable(f"remote store {self.where()}: GET: {value}")
                if value is None:
                    break
                why = _copy_verified(rkeys[i], value, views[i])
                if why is not None:
                    corrupt.append(why)
                    damaged.append(rkeys[i])
                    break
                sizes[i] = len(views[i])
                total += len(views[i])
                i += 1
            else:
                continue
            break
        if damaged:
            with contextlib.suppress(RemoteUnavailable):  # else it fails verification again
                self._run([("DEL", (k,)) for k in damaged])
        return Fetched(sizes, corrupt, total)

    def _get_chunks(self, rkeys: list[bytes]) -> Iterator[list[Any]]:
        """GET results in chunks of `FETCH_CHUNK`, in order. A long chain's chunks are fetched on
        a helper thread (one pipeline after the other) while the caller verifies and copies the
        chunk before, so the copy into the slots overlaps the network instead of following it.
        Closing the iterator early cancels the chunks not yet started."""
        chunks = [rkeys[i:i + FETCH_CHUNK] for i in range(0, len(rkeys), FETCH_CHUNK)]
        if len(chunks) == 1:
            yield self._run([("GET", (k,)) for k in rkeys])
            return
        if self._fetcher is None:
            self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="kvtier-remote-fetch")
        futures = [self._fetcher.submit(self._run, [("GET", (k,)) for k in c]) for c in chunks]
        try:
            for f in futures:
                yield f.result()
        finally:
            for f in futures:
                f.cancel()

    def put_many(self, items: Sequence[tuple[str, bytes, memoryview]]
                 ) -> tuple[list[bool], int]:
        """Stores (namespace, key, payload) values, one pipelined SET each; returns (whether
        each item was stored, in order; bytes sent). A store that refuses writes (`maxmemory`
        with `noeviction`: OOM) refuses per block; those are False."""
        commands = []
        sent = 0
        for ns, key, payload in items:
            rkey = self.key(ns, key)
            value = b"".join((blockfmt.encode_header(rkey, LAYOUT_TAG, payload), payload))
            sent += len(value)
            commands.append(("SET", (rkey, value)))
        got = self._run(commands)
        refused = [r for r in got if isinstance(r, Exception)]
        if refused:
            log.debug("remote store refused %d of %d writes: %s", len(refused), len(got),
                      refused[0])
        return [not isinstance(r, Exception) for r in got], sent

    def delete(self, ns: str, keys: Sequence[bytes]) -> int:
        """Deletes the values of `keys` (one pipelined DEL each); how many existed."""
        if not keys:
            return 0
        got = self._run([("DEL", (self.key(ns, k),)) for k in keys])
        errors = [r for r in got if isinstance(r, Exception)]
        if errors:
            raise RemoteUnavailable(f"remote store {self.where()}: DEL: {errors[0]}")
        return sum(int(r) for r in got)

    def close(self) -> None:
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True, cancel_futures=True)
            self._fetcher = None
        self._reset()


def _copy_verified(
    rkey: bytes, value: bytes, view: memoryview,
) -> blockfmt.Corruption | None:
    """Copies a stored value's payload into `view` and verifies it there; the reason on failure."""
    if not isinstance(value, bytes | bytearray):
        return blockfmt.Corruption.SHORT
    try:
        csum = blockfmt.check_header(rkey, LAYOUT_TAG, value, len(value))
    except blockfmt.BlockCorrupt as exc:
        return exc.reason
    if len(value) - blockfmt.HEADER_SIZE != len(view):
        return blockfmt.Corruption.LENGTH
    view[:] = memoryview(value)[blockfmt.HEADER_SIZE:]
    if blockfmt.payload_checksum(view) != csum:
        return blockfmt.Corruption.PAYLOAD_CHECKSUM
    return None
