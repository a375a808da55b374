"""The lease table: every pin and every allocation the daemon hands out is a lease with a TTL.

Pure bookkeeping, no I/O and no threads: the owner (`kvtier.daemon.cache.cache.Cache`) calls
`expired()` periodically and undoes what each returned lease held (unpins blocks, aborts
allocations). A lease that is released, aborted, committed or expired leaves the table exactly once,
so whatever it holds is freed exactly once — that is how no slot ever leaks.

Lease ids are 128-bit random hex strings: unguessable, so one tenant cannot name another's lease
(ownership is still checked by the caller against `Lease.tenant`).

A lease may belong to a *session* (a client process's OpenSession stream): `pop_session` removes
every live lease of a session at once, when the stream ends — so a client that dies loses its
leases within moments instead of after their TTL, which stays the backstop.

Not thread-safe: the caller serializes access (the daemon runs it under its cache lock).
"""

from __future__ import annotations

import enum
import heapq
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


class LeaseKind(enum.Enum):
    READ = "read"    # pins committed blocks (Acquire)
    WRITE = "write"  # holds freshly allocated slots until Commit/Abort (Allocate)


@dataclass(slots=True)
class Lease:
    """One lease. `payload` is owned by the caller (what to undo when the lease ends)."""

    id: str
    tenant: str
    kind: LeaseKind
    ttl_s: float
    expires_at: float
    payload: object = field(repr=False)
    session: str = ""  # "" = none: only Release/Commit/Abort or the TTL end it


class LeaseTable:
    """Leases by id, with expiry in O(log n) per grant/renew (a heap with lazy deletion)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._heap: list[tuple[float, str]] = []
        self._by_session: dict[str, set[str]] = {}
        self._sessions: dict[str, str] = {}  # open session id -> tenant

    def __len__(self) -> int:
        return len(self._leases)

    def clock(self) -> float:
        return self._clock()

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._leases.values()))

    def count(self, kind: LeaseKind) -> int:
        return sum(1 for lease in self._leases.values() if lease.kind is kind)

    def grant(self, tenant: str, kind: LeaseKind, ttl_s: float, payload: object,
              session: str = "") -> Lease:
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl_s}")
        lease_id = secrets.token_hex(16)
        lease = Lease(lease_id, tenant, kind, ttl_s, self._clock() + ttl_s, payload, session)
        self._leases[lease_id] = lease
        if session:
            self._by_session.setdefault(session, set()).add(lease_id)
        heapq.heappush(self._heap, (lease.expires_at, lease_id))
        return lease

    def get(self, lease_id: str) -> Lease | None:
        """The live lease with this id (an expired one not yet collected still counts as live)."""
        return self._leases.get(lease_id)

    def renew(self, lease_id: str, ttl_s: float) -> Lease | None:
        lease = self._leases.get(lease_id)
        if lease is None:
            return None
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl_s}")
        lease.ttl_s = ttl_s
        lease.expires_at = self._clock() + ttl_s
        heapq.heappush(self._heap, (lease.expires_at, lease_id))
        return lease

    def pop(self, lease_id: str) -> Lease | None:
        """Removes and returns the lease (the caller then frees what it holds), or None."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._unbind(lease)
        return lease

    def open_session(self, tenant: str) -> str:
        """A new, unguessable session id for `tenant`."""
        session = secrets.token_hex(16)
        self._sessions[session] = tenant
        return session

    def session_open(self, session: str, tenant: str) -> bool:
        """Whether `session` is open and belongs to `tenant`."""
        return self._sessions.get(session) == tenant

    def pop_session(self, session: str) -> list[Lease]:
        """Closes the session; removes and returns every live lease of it (its client is gone)."""
        self._sessions.pop(session, None)
        ids = self._by_session.pop(session, set())
        return [lease for i in ids if (lease := self._leases.pop(i, None)) is not None]

    def _unbind(self, lease: Lease) -> None:
        if lease.session:
            ids = self._by_session.get(lease.session)
            if ids is not None:
                ids.discard(lease.id)
                if not ids:
                    del self._by_session[lease.session]

    def expired(self) -> list[Lease]:
        """Removes and returns every lease whose deadline has passed, oldest deadline first."""
        now = self._clock()
        out: list[Lease] = []
        while self._heap and self._heap[0][0] <= now:
            deadline, lease_id = heapq.heappop(self._heap)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at == deadline:
                del self._leases[lease_id]
                self._unbind(lease)
                out.append(lease)
        if len(self._heap) > 4 * len(self._leases) + 64:
            self._heap = [(lease.expires_at, lease.id) for lease in self._leases.values()]
            heapq.heapify(self._heap)
        return out

    def pop_all(self) -> list[Lease]:
        """Removes and returns every lease (shutdown)."""
        out = list(self._leases.values())
        self._leases.clear()
        self._heap.clear()
        self._by_session.clear()
        self._sessions.clear()
        return out

    def next_deadline(self) -> float | None:
        """Earliest expiry among live leases (clock units), or None when there are none."""
        while self._heap:
            deadline, lease_id = self._heap[0]
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at == deadline:
                return deadline
            heapq.heappop(self._heap)
        return None
