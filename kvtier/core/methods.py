"""The daemon's methods, named once: each RPC of `kvtier.v1.KvTier` with its request and
response messages, its size limit, whether its handler waits, and the transports that carry it.

The daemon builds from `METHODS` its gRPC servicer's handlers, its local socket's dispatcher and
the guard's per-method size limits (`kvtier.daemon.rpc`); the clients build their call maps
from it (which calls may take the local socket, and under which number). tests/test_methods.py
checks it against the proto, so a method added to the proto and not here fails the tests.

Transports: every method is served over gRPC. Those with a `local` kind are also served on the
daemon's local socket (`kvtier.core.lookupwire`) under their `number`, the frame's method byte:
- CALL: one request frame, one reply frame (the unary calls engines make most: Lookup and the
  shared-memory path's lease calls);
- BULK_WRITE: a `WriteHeader` frame, the go-ahead, then the blocks' bytes raw (WriteBlocks);
- BULK_READ: a request frame, the block count, then the blocks' bytes raw (ReadBlocks).

`waits`: the handler may wait (the remote tier's round trip, an SSD read or a page move on a
worker thread, a stream): the daemon runs it as a coroutine; the others answer at once on the
event loop. `PROTOCOL_VERSION` is the one version of all of it: the local socket's hello and
RegisterLayout carry it, and a client and a daemon of different versions refuse each other.
Pure: names only (the daemon and the clients resolve the messages in `kvtier._proto`).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

PROTOCOL_VERSION = 1


class Size(enum.Enum):
    """A method's request size limit, in the daemon's units (`kvtier.daemon.rpc.guard`)."""

    SMALL = "small"  # no keys, no payload: a few KiB
    KEYS = "keys"  # one chain of the daemon's largest key count
    TWO_CHAINS = "two_chains"  # two chains (ReportHbm: added and removed)
    CHUNK = "chunk"  # a chain, or a chunk of a block's payload, whichever is larger


class Local(enum.Enum):
    """How the local socket carries a method (see the module docstring)."""

    CALL = "call"
    BULK_WRITE = "bulk_write"
    BULK_READ = "bulk_read"


class Method(NamedTuple):
    name: str  # the RPC's name in kvtier.v1.KvTier
    request: str  # message names in kvtier.v1
    response: str
    size: Size
    waits: bool
    local: Local | None = None  # None: gRPC only
    number: int = -1  # on the local socket (`local` set): the frame's method byte


METHODS: tuple[Method, ...] = (
    Method("RegisterLayout", "RegisterLayoutRequest", "RegisterLayoutResponse", Size.SMALL,
           False),
    Method("Lookup", "LookupRequest", "LookupResponse", Size.KEYS, True, Local.CALL, 0),
    Method("Acquire", "AcquireRequest", "AcquireResponse", Size.KEYS, True, Local.CALL, 1),
    Method("Release", "ReleaseRequest", "ReleaseResponse", Size.SMALL, False, Local.CALL, 2),
    Method("RenewLease", "RenewLeaseRequest", "RenewLeaseResponse", Size.SMALL, False),
    Method("Allocate", "AllocateRequest", "AllocateResponse", Size.KEYS, True, Local.CALL, 3),
    Method("Commit", "CommitRequest", "CommitResponse", Size.SMALL, False, Local.CALL, 4),
    Method("Abort", "AbortRequest", "AbortResponse", Size.SMALL, False, Local.CALL, 5),
    Method("ReadBlocks", "ReadBlocksRequest", "BlockChunk", Size.KEYS, True, Local.BULK_READ, 7),
    Method("WriteBlocks", "WriteBlocksRequest", "WriteBlocksResponse", Size.CHUNK, True,
           Local.BULK_WRITE, 6),
    Method("ReportHbm", "ReportHbmRequest", "ReportHbmResponse", Size.TWO_CHAINS, False),
    Method("ReportPrefill", "ReportPrefillRequest", "ReportPrefillResponse", Size.SMALL, False),
    Method("Stats", "StatsRequest", "StatsResponse", Size.SMALL, False),
    Method("WatchEvents", "WatchEventsRequest", "KvEvent", Size.SMALL, True),
    Method("ReportVerification", "ReportVerificationRequest", "ReportVerificationResponse",
           Size.KEYS, True),
    Method("OpenSession", "OpenSessionRequest", "SessionEvent", Size.SMALL, True),
    Method("Evict", "EvictRequest", "EvictResponse", Size.KEYS, True),
    Method("Pin", "PinRequest", "PinResponse", Size.KEYS, False),
    Method("Unpin", "UnpinRequest", "UnpinResponse", Size.KEYS, False),
    Method("ListPins", "ListPinsRequest", "ListPinsResponse", Size.SMALL, False),
    Method("Prefetch", "PrefetchRequest", "PrefetchResponse", Size.KEYS, True),
)
"""Every method, in the proto's order."""

BY_NAME = {m.name: m for m in METHODS}
LOCAL: tuple[Method, ...] = tuple(sorted((m for m in METHODS if m.local is not None),
                                         key=lambda m: m.number))
"""The local socket's methods, by number (`LOCAL[m.number] is m`)."""
BULK_WRITE_HEADER = "WriteHeader"
"""The request message of a BULK_WRITE on the local socket (its payload follows raw)."""
