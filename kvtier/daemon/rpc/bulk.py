"""The bulk calls, one path for both transports: WriteBlocks and ReadBlocks with their payload
moved piece by piece through the slots of a lease.

    WriteBlocks  BulkWrite.begin: the header's slots claimed (Allocate: a WRITE lease; keys
                 already cached get none) ─▶ `feed` each piece in order, copied into its slot
                 under the cache lock while the lease lives (pieces of cached blocks skipped)
                 ─▶ `finish`: Commit  │  a short payload, an error or the caller's end:
                 `abort` / `fail` (the slots freed, nothing committed)
    ReadBlocks   BulkRead: the longest cached prefix held (Acquire: a READ lease, SSD and remote
                 blocks promoted first) ─▶ `pieces`, each copied out under the lock while the
                 lease lives ─▶ Release (with the bytes sent), whatever happened

gRPC carries the pieces as `BlockChunk`s (`kvtier.daemon.rpc.grpc_server`: a chunk's position
is checked with `feed_chunk`, ReadBlocks' pieces go out in a chunk's wire form), the local
socket as raw bytes (`kvtier.daemon.rpc.local_socket`). A slot is never touched after its lease
ended (`kvtier.daemon.cache.api.SlotStream`): a stalled call fails with NOT_FOUND at its next
piece. Each call is recorded once, as "WriteBlocks"/"ReadBlocks", with the code it ended with
(CANCELLED for a caller gone mid-payload).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from types import TracebackType

import grpc

from kvtier._proto import kvtier_pb2 as pb
from kvtier.core.chunkwire import chunk_head
from kvtier.core.errors import InvalidArgument, NotFound, Unauthenticated
from kvtier.daemon.cache.api import AllocateResult, Buffer, CacheApi, SlotStream
from kvtier.daemon.cache.namespaces import Tenant
from kvtier.daemon.rpc.calls import Call, Failed, Outcomes
from kvtier.daemon.rpc.guard import Refused, RefusedError


def still_theirs(who: Callable[[], Tenant], tenant: Tenant) -> None:
    """A write's check before its commit: the token that began it (`who`: its tenant by the
    tokens of the moment) is still `tenant`'s. Raises Unauthenticated when a reload rotated or
    revoked it meanwhile (the caller aborts the write: nothing of it is committed)."""
    try:
        now = who()
    except Unauthenticated as exc:
        raise Unauthenticated(f"{exc}: the token that began this write was changed or revoked; "
                              "nothing of it is committed") from None
    if now.name != tenant.name:
        raise Unauthenticated("the token that began this write belongs to another tenant now; "
                              "nothing of it is committed")


class BulkWrite:
    """One WriteBlocks between its claim and its end (see the module docstring)."""

    def __init__(self, cache: CacheApi, outcomes: Outcomes, tenant: Tenant,
                 alloc: AllocateResult, n_keys: int, block_bytes: int, started: float,
                 who: Callable[[], Tenant] | None = None) -> None:
        """`who`: the caller's tenant by its token now (`Call.tenant`), asked again at the
        commit (`still_theirs`)."""
        self._cache = cache
        self._outcomes = outcomes
        self._tenant = tenant
        self._who = who
        self._alloc = alloc
        self._slots = cache.writing(tenant, alloc.lease_id, alloc.offsets, block_bytes)
        self._slot_of = {index: j for j, index in enumerate(alloc.indices)}
        self.n_keys = n_keys
        self.block_bytes = block_bytes
        self.total = n_keys * block_bytes
        self.received = 0
        self._started = started
        self._ended = False

    @classmethod
    async def begin(cls, cache: CacheApi, outcomes: Outcomes, header: pb.WriteHeader | Refused,
                    call: Call) -> BulkWrite:
        """The caller's layout and the slots claimed as Allocate claims them; raises `Failed`
        (recorded, nothing claimed)."""
        started = time.perf_counter()
        try:
            if isinstance(header, Refused):
                raise RefusedError(header)
            tenant = call.tenant()
            info = cache.layout(tenant, header.layout)
            alloc = await cache.allocate_async(tenant, header.layout, header.keys,
                                               header.key_width, header.parent_key, 0.0)
        except Exception as exc:
            raise outcomes.failure("WriteBlocks", exc, started) from None
        return cls(cache, outcomes, tenant, alloc, len(header.keys) // info.key_width,
                   info.block_bytes, started, call.tenant)

    @property
    def complete(self) -> bool:
        return self.received == self.total

    def feed(self, data: Buffer) -> int:
        """Takes the front of `data` up to the payload's end; returns how many bytes it took.
        Raises `Failed` (recorded, the slots freed) when the lease ended meanwhile."""
        took = 0
        bb = self.block_bytes
        while took < len(data) and self.received < self.total:
            index, at = divmod(self.received, bb)
            n = min(len(data) - took, bb - at)
            if index in self._slot_of:
                try:
                    self._slots.write(self._slot_of[index], at, data[took : took + n])
                except Exception as exc:
                    raise self.fail(exc) from None
            took += n
            self.received += n
        return took

    def feed_chunk(self, index: int, offset: int, data: Buffer) -> None:
        """A piece that names its place (a gRPC chunk): it must be the next one, within the
        payload, and not empty. Raises `Failed` (recorded, the slots freed)."""
        at_index, at = divmod(self.received, self.block_bytes)
        if index != at_index or offset != at:
            raise self.fail(InvalidArgument(
                f"expected bytes of block {at_index} at offset {at}, got block {index} at "
                f"offset {offset}"))
        if index >= self.n_keys or at + len(data) > self.block_bytes or not data:
            raise self.fail(InvalidArgument(
                f"chunk overruns the {self.n_keys} blocks of {self.block_bytes} bytes"))
        self.feed(data)

    def finish(self) -> pb.WriteBlocksResponse:
        """Commits the payload; raises `Failed` (recorded, the slots freed) for a payload that
        is not complete or a commit that fails."""
        if not self.complete:
            raise self.fail(InvalidArgument(
                f"received {self.received // self.block_bytes} complete blocks of "
                f"{self.n_keys}"))
        assert not self._ended
        done = 0
        try:
            if self._alloc.lease_id:
                if self._who is not None:
                    still_theirs(self._who, self._tenant)
                done = self._cache.commit(self._tenant, self._alloc.lease_id,
                                          len(self._slot_of) * self.block_bytes)
        except Exception as exc:
            raise self.fail(exc) from None
        self._ended = True
        self._outcomes.record("WriteBlocks", grpc.StatusCode.OK, self._started)
        return pb.WriteBlocksResponse(stored=done, skipped=self.n_keys - len(self._alloc.indices))

    def abort(self, code: grpc.StatusCode = grpc.StatusCode.CANCELLED,
              message: str = "the client went away mid-payload") -> Failed:
        """Frees the slots, commits nothing; the `Failed` answering it, recorded as `code`."""
        if self._ended:
            return Failed(code, message)
        self._free()
        self._outcomes.record("WriteBlocks", code, self._started)
        return Failed(code, message)

    def fail(self, exc: Exception) -> Failed:
        """`abort` for the error `exc` (its code, as any call answers it)."""
        if isinstance(exc, Failed):
            return exc
        self._free()
        return self._outcomes.failure("WriteBlocks", exc, self._started)

    def _free(self) -> None:
        if not self._ended:
            self._ended = True
            if self._alloc.lease_id:
                with contextlib.suppress(NotFound):  # expired meanwhile: already freed
                    self._cache.abort(self._tenant, self._alloc.lease_id)


class BulkRead:
    """One ReadBlocks, an async context: entered, the blocks are held (`count`); `pieces` copies
    them out; its end releases them and records the call (raises `Failed`, recorded)."""

    def __init__(self, cache: CacheApi, outcomes: Outcomes,
                 request: pb.ReadBlocksRequest | Refused, call: Call) -> None:
        self._cache = cache
        self._outcomes = outcomes
        self._request = request
        self._call = call
        self._started = time.perf_counter()
        self._held: AbstractAsyncContextManager[SlotStream] | None = None
        self.stream: SlotStream | None = None

    @property
    def count(self) -> int:
        assert self.stream is not None
        return len(self.stream)

    async def __aenter__(self) -> BulkRead:
        try:
            if isinstance(self._request, Refused):
                raise RefusedError(self._request)
            r = self._request
            self._held = self._cache.reading(self._call.tenant(), r.layout, r.keys, r.key_width)
            self.stream = await self._held.__aenter__()
        except Exception as exc:
            raise self._outcomes.failure("ReadBlocks", exc, self._started) from None
        return self

    def pieces(self, piece_bytes: int, chunked: bool) -> Iterator[bytes]:
        """Each block's bytes in pieces of up to `piece_bytes`, in order, each copied under the
        lock while the lease lives (NotFound once it ended); `chunked`: each piece in a
        `BlockChunk`'s wire form, the first carrying the count."""
        stream = self.stream
        assert stream is not None
        size, n = stream.block_bytes, len(stream)
        for i in range(n):
            for off in range(0, size, piece_bytes):
                head = (chunk_head(i, off, n if i == 0 and off == 0 else 0,
                                   min(piece_bytes, size - off), wrapped=False)
                        if chunked else b"")
                yield stream.read(i, off, piece_bytes, head)

    def expired(self) -> Failed:
        """The `Failed` (recorded) of a read whose client took no piece for the lease's TTL."""
        ttl = self.stream.ttl_s if self.stream is not None else 0.0
        self._outcomes.record("ReadBlocks", grpc.StatusCode.DEADLINE_EXCEEDED, self._started)
        return Failed(grpc.StatusCode.DEADLINE_EXCEEDED,
                      f"the client took no block for {ttl:g} s (the lease's TTL)")

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._held is not None:
            await self._held.__aexit__(kind, exc, tb)
        if exc is None:
            self._outcomes.record("ReadBlocks", grpc.StatusCode.OK, self._started)
        elif isinstance(exc, ConnectionError):
            raise self._outcomes.cancelled("ReadBlocks", self._started) from None
        elif isinstance(exc, Exception) and not isinstance(exc, Failed):
            raise self._outcomes.failure("ReadBlocks", exc, self._started) from None
