"""asyncio client of the kvtier daemon: the same calls and rules as
`kvtier.client.sync_client.Client`.

    async with await AsyncClient.connect(layout=layout) as kv:
        await kv.store(keys, blocks)
        async with kv.load(keys) as got:
            ...

Views from `load` are valid only inside its `async with` block. One AsyncClient belongs to one
event loop. Like `Client`, it binds its leases to an OpenSession stream (they end when the process
dies).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier.client.lookup_channel import AsyncLookupChannel, Refusal
from kvtier.client.shm import MappedSegment, SegmentHolder
from kvtier.client.sync_client import (
    MAX_MESSAGE_BYTES,
    SESSION_METADATA,
    TIER_FROM_PB,
    Assembler,
    KvtierRpcError,
    KvtierUnavailable,
    LayoutDecl,
    Loaded,
    Lookup,
    Stored,
    StoreTx,
    check_blocks,
    check_registered,
    default_socket,
    is_closed_session,
    is_unknown_layout,
    lookup_result,
    lookup_socket_of,
    pack_keys,
    refused,
    register_request,
    require_daemon,
    rpc_error,
    stream_calls,
    write_chunks,
)

T = TypeVar("T")


class AsyncClient(SegmentHolder):
    """Create with `await AsyncClient.connect(...)` (registers the layout, maps the segment)."""

    def __init__(
        self, socket: str | Path | None = None, *, layout: LayoutDecl, target: str | None = None,
        token: str | None = None, streaming: bool = False, lease_ttl_s: float = 0.0,
        timeout: float = 30.0, lookup_socket: bool = True,
    ) -> None:
        self.layout = layout
        self.target = target or f"unix:{Path(socket) if socket else default_socket()}"
        self.force_streaming = streaming
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._token = token or ""
        self._channel = grpc.aio.insecure_channel(self.target, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        self._stub = pb_grpc.KvTierStub(self._channel)  # type: ignore[no-untyped-call]
        self._read_blocks, self._write_blocks = stream_calls(self._channel)
        self._segment: MappedSegment | None = None
        self.tenant = ""
        self._session: Any = None  # the OpenSession stream (None: the daemon has none)
        self._call_metadata = self._metadata
        local = lookup_socket_of(self.target)
        self._lookups = (AsyncLookupChannel(local, self._token, timeout)
                         if local is not None and lookup_socket else None)

    @classmethod
    async def connect(cls, socket: str | Path | None = None, **kwargs: Any) -> AsyncClient:
        """A registered client; fails at once with `KvtierUnavailable` ("no kvtier daemon at
        <socket> (start one: kvtier serve)") when nothing listens there."""
        client = cls(socket, **kwargs)
        try:
            require_daemon(client.target)
            await client._register(first=True)
            await client._open_session()
        except BaseException:
            await client._channel.close(None)
            if client._lookups is not None:
                client._lookups.close()
            raise
        return client

    async def _raw(self, method: Callable[..., Awaitable[T]], request: Any,
                   wait: bool = True) -> T:
        try:
            return await method(request, timeout=self.timeout, metadata=self._call_metadata,
                                wait_for_ready=wait)
        except grpc.RpcError as exc:
            raise rpc_error(exc, self.target if not wait else None) from None

    async def _call(self, method: Callable[..., Awaitable[T]], request: Any) -> T:
        try:
            return await self._raw(method, request)
        except KvtierRpcError as exc:
            if not (is_closed_session(exc) or is_unknown_layout(exc)):
                raise
            await self._register()  # either means the daemon restarted: it knows neither now
            await self._open_session()
            return await self._raw(method, request)

    async def _open_session(self) -> None:
        """(Re)opens the OpenSession stream the daemon binds this client's leases to."""
        if self._session is not None:
            self._session.cancel()
        self._session, self._call_metadata = None, self._metadata
        call = self._stub.OpenSession(pb.OpenSessionRequest(), metadata=self._metadata,
                                      wait_for_ready=True)
        try:
            first = await call.read()
        except grpc.RpcError as exc:
            raise rpc_error(exc) from None
        if not isinstance(first, pb.SessionEvent):  # the stream ended at once (EOF)
            return
        self._session = call
        self._call_metadata = (*self._metadata, (SESSION_METADATA, first.session_id))

    async def _register(self, first: bool = False) -> None:
        reply = await self._raw(self._stub.RegisterLayout, register_request(self.layout),
                                wait=not first)
        check_registered(self.layout, reply)
        self.tenant = reply.tenant
        self._adopt(reply.segment)

    async def close(self) -> None:
        if self._session is not None:
            self._session.cancel()
        self._close_segment()
        if self._lookups is not None:
            self._lookups.close()
        await self._channel.close(None)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def lookup(self, keys: Sequence[bytes], *, start_token: int = 0,
                     prompt_tokens: int = 0, plan: bool = False, replica: str = "") -> Lookup:
        reply = await self._call(self._lookup, pb.LookupRequest(
            layout=self.layout.layout_id, keys=pack_keys(keys, self.layout.key_width),
            key_width=self.layout.key_width, start_token=start_token,
            prompt_tokens=prompt_tokens, want_plan=plan, replica=replica))
        return lookup_result(reply)

    async def _lookup(self, request: pb.LookupRequest, **kwargs: Any) -> pb.LookupResponse:
        """Lookup on the lookup socket when there is one, else over gRPC (as `Client`)."""
        if self._lookups is not None:
            got = await self._lookups.call(request.SerializeToString())
            if isinstance(got, Refusal):
                raise refused(got)
            if got is not None:
                return pb.LookupResponse.FromString(got)
        reply: pb.LookupResponse = await self._stub.Lookup(request, **kwargs)
        return reply

    @contextlib.asynccontextmanager
    async def load(self, keys: Sequence[bytes]) -> AsyncIterator[Loaded]:
        packed = pack_keys(keys, self.layout.key_width)
        if not self.uses_shm:
            yield await self._read_stream(packed)
            return
        reply = await self._call(self._stub.Acquire, pb.AcquireRequest(
            layout=self.layout.layout_id, keys=packed, key_width=self.layout.key_width,
            lease_ttl_ms=self.lease_ttl_ms))
        seg = self._adopt(reply.segment)
        if reply.count and seg.dram is None:
            await self._raw(self._stub.Release, pb.ReleaseRequest(lease_id=reply.lease_id))
            yield await self._read_stream(packed)
            return
        views = seg.views(reply.offsets, reply.block_bytes)
        for v in views:
            v.flags.writeable = False
        started = time.perf_counter()
        try:
            yield Loaded(reply.count, views, [TIER_FROM_PB[t] for t in reply.source_tiers],
                         tuple(seg.slots(reply.offsets)))
        finally:
            if reply.lease_id:
                await self._raw(self._stub.Release, pb.ReleaseRequest(
                    lease_id=reply.lease_id, bytes=reply.count * reply.block_bytes,
                    seconds=time.perf_counter() - started))

    async def _read_stream(self, packed: bytes) -> Loaded:
        req = pb.ReadBlocksRequest(layout=self.layout.layout_id, keys=packed,
                                   key_width=self.layout.key_width)
        for attempt in (0, 1):
            try:
                return await self._assemble(req)
            except grpc.RpcError as exc:
                err = rpc_error(exc)
                if attempt or not is_unknown_layout(err):
                    raise err from None
            await self._register()
        raise AssertionError("unreachable")

    async def _assemble(self, req: pb.ReadBlocksRequest) -> Loaded:
        asm = Assembler(self.layout.block_bytes)
        stream = self._read_blocks(req, timeout=self.timeout, metadata=self._metadata,
                                       wait_for_ready=True)
        async for chunk in stream:
            if not asm.add(chunk):
                break
        return asm.result()

    async def store(self, keys: Sequence[bytes], blocks: Sequence[Any], parent: bytes = b""
                    ) -> Stored:
        check_blocks(self.layout, keys, blocks)
        packed = pack_keys(keys, self.layout.key_width)
        if not self.uses_shm:
            try:
                reply = await self._write_blocks(
                    write_chunks(self.layout, packed, parent, blocks), timeout=self.timeout,
                    metadata=self._metadata, wait_for_ready=True)
            except grpc.RpcError as exc:
                raise rpc_error(exc) from None
            return Stored(reply.stored, reply.skipped)
        async with self.store_into(keys, parent) as tx:
            for index, view in tx.slots:
                np.copyto(view, np.frombuffer(blocks[index], dtype=np.uint8))
        return Stored(tx.committed, len(keys) - len(tx.slots))

    @contextlib.asynccontextmanager
    async def store_into(self, keys: Sequence[bytes], parent: bytes = b""
                         ) -> AsyncIterator[StoreTx]:
        reply = await self._call(self._stub.Allocate, pb.AllocateRequest(
            layout=self.layout.layout_id, keys=pack_keys(keys, self.layout.key_width),
            key_width=self.layout.key_width, parent_key=parent, lease_ttl_ms=self.lease_ttl_ms))
        seg = self._adopt(reply.segment)
        if reply.lease_id and seg.dram is None:
            await self._raw(self._stub.Abort, pb.AbortRequest(lease_id=reply.lease_id))
            raise KvtierUnavailable(grpc.StatusCode.UNAVAILABLE, "shared segment not mappable")
        tx = StoreTx(list(zip(reply.indices, seg.views(reply.offsets, reply.block_bytes),
                              strict=True)),
                     seg.slots(reply.offsets))
        started = time.perf_counter()
        try:
            yield tx
        except BaseException:
            if reply.lease_id:
                with contextlib.suppress(KvtierRpcError):
                    await self._raw(self._stub.Abort, pb.AbortRequest(lease_id=reply.lease_id))
            raise
        if reply.lease_id:
            done = await self._raw(self._stub.Commit, pb.CommitRequest(
                lease_id=reply.lease_id, bytes=len(tx.slots) * reply.block_bytes,
                seconds=time.perf_counter() - started))
            tx.committed = done.committed

    async def report_hbm(self, replica: str, added: Sequence[bytes] = (),
                   removed: Sequence[bytes] = (), reset: bool = False) -> int:
        """Tells the daemon which blocks `replica` now holds in its GPU pool; returns how many of
        `added` are cached (the others are ignored). `reset` forgets earlier reports first."""
        w = self.layout.key_width
        reply = await self._call(self._stub.ReportHbm, pb.ReportHbmRequest(
            layout=self.layout.layout_id, replica=replica, key_width=w,
            added=pack_keys(added, w), removed=pack_keys(removed, w), reset=reset))
        return int(reply.tracked)

    async def report_prefill(self, tokens: int, seconds: float, context_tokens: int = 0) -> None:
        await self._call(self._stub.ReportPrefill, pb.ReportPrefillRequest(
            layout=self.layout.layout_id, tokens=tokens, seconds=seconds,
            context_tokens=context_tokens))

    async def stats(self) -> pb.StatsResponse:
        reply: pb.StatsResponse = await self._call(self._stub.Stats, pb.StatsRequest())
        return reply

    async def watch(self, since: int = 0) -> AsyncIterator[pb.KvEvent]:
        stream = self._stub.WatchEvents(pb.WatchEventsRequest(since_sequence=since),
                                        metadata=self._metadata, wait_for_ready=True)
        try:
            async for event in stream:
                yield event
        except grpc.RpcError as exc:
            raise rpc_error(exc) from None
