"""Synchronous client of the kvtier daemon (the asyncio twin is `kvtier.client.async_client`).

    from kvtier.client.sync_client import Client, LayoutDecl
    layout = LayoutDecl(fingerprint=b"my-layout-tp0-v1", block_bytes=4096, block_tokens=16,
                        model_id="my-org/my-model@rev1")  # or LayoutDecl.from_layout(kvl, id)
    with Client(layout=layout) as kv:                      # default socket, as `kvtier serve`
        kv.store(keys, blocks)                             # allocate + write + commit
        with kv.load(keys) as got:                         # acquire + zero-copy views + release
            for view in got.views: ...

Data path: a local client maps the daemon's shared DRAM segment and copies blocks in place, so
payloads never cross the socket. When the segment cannot be mapped (another machine, another
user, `streaming=True`), the same calls use the ReadBlocks/WriteBlocks byte streams instead.
Lookup and the shared-memory path's lease calls (Allocate, Commit, Abort, Acquire, Release) go
over the daemon's lookup socket when it takes them (`kvtier.client.lookup_channel`: the same
answers and errors, without gRPC's per-call cost), else over gRPC.

No daemon: creating a client fails at once (well within 1 s) with `KvtierUnavailable` "no kvtier
daemon at <socket> (start one: kvtier serve)" when nothing listens on the socket.
Restarts: calls wait for the daemon to come back (up to `timeout`), re-register the layout when the
daemon no longer knows it, and re-attach the new segment generation. A lease does not survive a
restart or its TTL: the `load`/`store_into` block that held it ends with `KvtierRpcError`
(NOT_FOUND) from its Release/Commit — treat what was read as invalid, and retry.

Sessions: a Client opens one OpenSession stream and sends its id with every Acquire/Allocate,
so when the process dies (its connection closes) the daemon ends its leases at once instead of
after their TTL.

Lifetimes: views from `load` are valid only inside its `with` block (afterwards the slot may be
reused), and only while the lease lives: a `with` block held longer than the lease TTL (daemon
default 30 s; `lease_ttl_s=` asks for more, up to the daemon's maximum) loses its pins.
Threading: one Client may be shared by threads for lookups/loads/stores; each call is
independent. Errors: `KvtierRpcError` (with `.code`) for refused requests.
"""

from __future__ import annotations

import contextlib
import os
import socket as _socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier.client.decl import LayoutDecl as LayoutDecl
from kvtier.client.decl import ModelCost as ModelCost
from kvtier.client.decl import register_request as register_request
from kvtier.client.lookup_channel import LookupChannel, Refusal
from kvtier.client.shm import MappedSegment, SegmentHolder
from kvtier.client.shm import SlotBuffer as SlotBuffer
from kvtier.core.chunkwire import Chunk, chunk_head, parse_chunk
from kvtier.core.errors import KvtierError
from kvtier.core.methods import BY_NAME, METHODS, PROTOCOL_VERSION, Local
from kvtier.core.paths import default_socket as _default_socket
from kvtier.core.types import Tier

MAX_MESSAGE_BYTES = 8 << 20
CHUNK_BYTES = 4 << 20
TIER_FROM_PB = {pb.TIER_HBM: Tier.HBM, pb.TIER_DRAM: Tier.DRAM, pb.TIER_SSD: Tier.SSD,
                pb.TIER_REMOTE: Tier.REMOTE}
_TIER_BY_PB = [Tier.HBM, Tier.HBM, Tier.DRAM, Tier.SSD, Tier.REMOTE]  # TIER_NONE never in a reply
T = TypeVar("T")
U8 = npt.NDArray[np.uint8]


class KvtierRpcError(KvtierError):
    """The daemon refused a call; `code` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class KvtierUnavailable(KvtierRpcError):
    """The daemon is not reachable (or restarted during a lease)."""


class Lookup(NamedTuple):
    hit_blocks: int
    tiers: list[Tier]
    fetch_blocks: int  # the plan's cut (== hit_blocks without a plan)
    plan: pb.Plan | None


class Loaded(NamedTuple):
    """Blocks keys[0:blocks]: read-only views (shm) or read-only arrays of the received bytes
    (streaming).

    `slots[i]` is the pool slot behind `views[i]` (a row of `Client.slot_buffer()`), for engines
    that copy with their own kernels; empty on the streaming path.
    """

    blocks: int
    views: list[U8]
    tiers: list[Tier]
    slots: tuple[int, ...] = ()


class Stored(NamedTuple):
    stored: int
    skipped: int


class Acquired(NamedTuple):
    """A lease on keys[0:blocks] that outlives the call (`Client.acquire`): the caller, or another
    process of the same tenant that maps `segment`, copies from `slots` and calls `release`."""

    lease_id: str
    blocks: int
    slots: tuple[int, ...]
    tiers: list[Tier]
    segment: pb.SegmentInfo
    block_bytes: int


@dataclass(slots=True)
class StoreTx:
    """What `store_into` yields: (index in keys, writable slot view) for each key to write, and
    in `slot_ids[j]` the pool slot behind `slots[j]`'s view (a row of `Client.slot_buffer()`).

    `committed` is set after the `with` block commits (blocks whose parent vanished meanwhile
    are dropped by the daemon and not counted).
    """

    slots: list[tuple[int, U8]]
    slot_ids: list[int] = field(default_factory=list)
    committed: int = 0


def default_socket() -> Path:
    return _default_socket(os.environ)


def no_daemon(where: str) -> KvtierUnavailable:
    """The one error for "nothing answers at `where`" (a socket path or a gRPC target)."""
    return KvtierUnavailable(grpc.StatusCode.UNAVAILABLE,
                             f"no kvtier daemon at {where} (start one: kvtier serve)")


def require_daemon(target: str) -> None:
    """Raises `no_daemon` at once when nothing listens on a `unix:` target (no socket file, or a
    dead daemon's leftover); other targets are not probed (their first call fails fast)."""
    if not target.startswith("unix:"):
        return
    path = target.removeprefix("unix:")
    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        raise no_daemon(path) from None
    finally:
        probe.close()


def pack_keys(keys: Sequence[bytes], width: int) -> bytes:
    if list(map(len, keys)).count(width) != len(keys):  # the check at C speed (~13 ns a key)
        bad = next(k for k in keys if len(k) != width)
        raise ValueError(f"key of {len(bad)} bytes; this layout's keys have {width}")
    return b"".join(keys)


def check_registered(layout: LayoutDecl, reply: pb.RegisterLayoutResponse) -> None:
    """The daemon must speak this client's protocol version and confirm the layout id this
    client names its requests by."""
    if reply.protocol_version != PROTOCOL_VERSION:
        raise KvtierRpcError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the daemon speaks protocol {reply.protocol_version}, this client protocol "
            f"{PROTOCOL_VERSION}: upgrade the daemon and its clients together")
    if reply.layout_id != layout.layout_id:
        raise KvtierRpcError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "the daemon did not confirm this layout's id for model "
            f"{layout.model_id!r} (a daemon without model namespaces? upgrade it)")


_CODE_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def refused(refusal: Refusal) -> KvtierRpcError:
    """The client's error for a refusal on the lookup socket: the one gRPC's would give."""
    code = _CODE_BY_NUMBER.get(refusal.code, grpc.StatusCode.UNKNOWN)
    cls = KvtierUnavailable if code is grpc.StatusCode.UNAVAILABLE else KvtierRpcError
    return cls(code, refusal.message)


def lookup_socket_of(target: str) -> str | None:
    """The daemon socket whose lookup socket a client of `target` may use (a `unix:` target)."""
    return target.removeprefix("unix:") if target.startswith("unix:") else None


def lookup_result(reply: pb.LookupResponse) -> Lookup:
    # the repeated field read once, as bytes (its values are 0..4); a chain in one tier (the
    # usual hit) needs no look-up per block
    codes = bytes(reply.tiers)
    if codes and codes.count(codes[0]) == len(codes):
        tiers = [_TIER_BY_PB[codes[0]]] * len(codes)
    else:
        tiers = list(map(_TIER_BY_PB.__getitem__, codes))
    has_plan = reply.HasField("plan")
    cut = reply.plan.fetch_blocks if has_plan else reply.hit_blocks
    return Lookup(reply.hit_blocks, tiers, cut, reply.plan if has_plan else None)


def rpc_error(exc: grpc.RpcError, unreachable: str | None = None) -> KvtierRpcError:
    """The client's error for a failed call; with `unreachable` (the target of a first call
    that does not wait), UNAVAILABLE becomes `no_daemon`."""
    code: grpc.StatusCode = exc.code()
    details: str = exc.details() or ""
    if unreachable is not None and code is grpc.StatusCode.UNAVAILABLE:
        return no_daemon(f"{unreachable} ({details})")
    cls = KvtierUnavailable if code is grpc.StatusCode.UNAVAILABLE else KvtierRpcError
    return cls(code, details)


SESSION_METADATA = "kvtier-session"
_LOOKUP = BY_NAME["Lookup"].number


def is_closed_session(exc: KvtierRpcError) -> bool:
    """The daemon no longer knows this client's session (it restarted): open a new one."""
    return exc.code is grpc.StatusCode.FAILED_PRECONDITION and "session" in exc.details


def is_unknown_layout(exc: KvtierRpcError) -> bool:
    return exc.code is grpc.StatusCode.NOT_FOUND and "unknown layout" in exc.details


def write_chunks(layout: LayoutDecl, keys: bytes, parent: bytes, blocks: Sequence[Any]
                 ) -> Iterator[pb.WriteBlocksRequest | bytes]:
    """The WriteBlocks stream: the header, then each chunk already in wire form (one copy of
    its bytes, `kvtier.core.chunkwire`); send it through `stream_calls`'s WriteBlocks."""
    yield pb.WriteBlocksRequest(header=pb.WriteHeader(
        layout=layout.layout_id, keys=keys, key_width=layout.key_width, parent_key=parent))
    for i, block in enumerate(blocks):
        data = memoryview(block).cast("B")
        for off in range(0, len(data), CHUNK_BYTES):
            part = data[off : off + CHUNK_BYTES]
            yield chunk_head(i, off, 0, len(part), wrapped=True) + part


def _write_request(msg: pb.WriteBlocksRequest | bytes) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _read_chunk(data: bytes) -> Chunk | pb.BlockChunk:
    """A ReadBlocks reply: read by hand (its data a view, not copied) when in the plain form,
    else by protobuf."""
    chunk = parse_chunk(data, wrapped=False)
    return chunk if chunk is not None else pb.BlockChunk.FromString(data)


_SERVICE = pb.DESCRIPTOR.services_by_name["KvTier"].full_name


def stream_calls(channel: Any) -> tuple[Any, Any]:
    """ReadBlocks and WriteBlocks of `channel` (sync or asyncio) with the chunk serializers
    above in place of the generated ones: the same messages on the wire, fewer copies."""
    return (
        channel.unary_stream(f"/{_SERVICE}/ReadBlocks",
                             request_serializer=pb.ReadBlocksRequest.SerializeToString,
                             response_deserializer=_read_chunk),
        channel.stream_unary(f"/{_SERVICE}/WriteBlocks", request_serializer=_write_request,
                             response_deserializer=pb.WriteBlocksResponse.FromString),
    )


def check_blocks(layout: LayoutDecl, keys: Sequence[bytes], blocks: Sequence[Any]) -> None:
    if len(keys) != len(blocks):
        raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
    for b in blocks:
        if memoryview(b).nbytes != layout.block_bytes:
            raise ValueError(f"a block has {memoryview(b).nbytes} bytes, the layout "
                             f"{layout.block_bytes}")


class Client(SegmentHolder):
    """A connection to one daemon for one layout. Use as a context manager or call `close()`."""

    def __init__(
        self, socket: str | Path | None = None, *, layout: LayoutDecl, target: str | None = None,
        token: str | None = None, streaming: bool = False, lease_ttl_s: float = 0.0,
        timeout: float = 30.0, credentials: grpc.ChannelCredentials | None = None,
        lookup_socket: bool = True,
    ) -> None:
        self.layout = layout
        self.target = target or f"unix:{Path(socket) if socket else default_socket()}"
        self.force_streaming = streaming
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._token = token or ""
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self._channel = (grpc.secure_channel(self.target, credentials, options=opts)
                         if credentials else grpc.insecure_channel(self.target, options=opts))
        self._stub = pb_grpc.KvTierStub(self._channel)  # type: ignore[no-untyped-call]
        self._read_blocks, self._write_blocks = stream_calls(self._channel)
        self._segment: MappedSegment | None = None
        self.tenant = ""
        self._session_lock = threading.Lock()
        self._session: Any = None  # the OpenSession stream (None: the daemon has none)
        self._session_id = ""
        self._call_metadata = self._metadata
        local = lookup_socket_of(self.target)
        self._lookups = (LookupChannel(local, self._token, timeout)
                         if local is not None and lookup_socket else None)
        # the unary calls the local socket also carries (`kvtier.core.methods`), Lookup aside
        # (`_lookup`): by stub method, (its number there, its reply type)
        self._local_calls: dict[Any, tuple[int, Any]] = {
            getattr(self._stub, m.name): (m.number, getattr(pb, m.response))
            for m in METHODS if m.local is Local.CALL and m.name != "Lookup"}
        try:
            require_daemon(self.target)
            self._register(first=True)
            self._open_session()
        except BaseException:
            self._channel.close()
            raise

    # -- connection -------------------------------------------------------------------------

    def _raw(self, method: Callable[..., T], request: Any, wait: bool = True) -> T:
        """One RPC; `wait`: wait (up to the timeout) for a daemon that is (re)starting. The
        lease calls go over the lookup socket when it takes them (`LookupChannel.request`: the
        same handler, answers and errors), else — and when it cannot be used — over gRPC."""
        local = self._local_calls.get(method) if self._lookups is not None else None
        if local is not None:
            assert self._lookups is not None
            got = self._lookups.request(local[0], self._session_id, request.SerializeToString())
            if isinstance(got, Refusal):
                raise refused(got)
            if got is not None:
                reply: T = local[1].FromString(got)
                return reply
        try:
            return method(request, timeout=self.timeout, metadata=self._call_metadata,
                          wait_for_ready=wait)
        except grpc.RpcError as exc:
            raise rpc_error(exc, self.target if not wait else None) from None

    def _call(self, method: Callable[..., T], request: Any) -> T:
        """One RPC; after a restart (unknown layout, closed session) re-registers or reopens
        the session, and retries once."""
        try:
            return self._raw(method, request)
        except KvtierRpcError as exc:
            if not (is_closed_session(exc) or is_unknown_layout(exc)):
                raise
            self._register()  # either means the daemon restarted: it knows neither now
            self._open_session()
            return self._raw(method, request)

    def _open_session(self) -> None:
        """(Re)opens the OpenSession stream the daemon binds this client's leases to."""
        with self._session_lock:
            if self._session is not None:
                self._session.cancel()
            self._session, self._session_id, self._call_metadata = None, "", self._metadata
            call = self._stub.OpenSession(pb.OpenSessionRequest(), metadata=self._metadata,
                                          wait_for_ready=True)
            try:
                first = next(call)
            except grpc.RpcError as exc:
                raise rpc_error(exc) from None
            self._session, self._session_id = call, first.session_id
            self._call_metadata = (*self._metadata, (SESSION_METADATA, first.session_id))

    def _register(self, first: bool = False) -> None:
        reply = self._raw(self._stub.RegisterLayout, register_request(self.layout), wait=not first)
        check_registered(self.layout, reply)
        self.tenant = reply.tenant
        self._adopt(reply.segment)

    def close(self) -> None:
        if self._session is not None:
            self._session.cancel()
        self._close_segment()
        if self._lookups is not None:
            self._lookups.close()
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- API --------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], *, start_token: int = 0, prompt_tokens: int = 0,
               plan: bool = False, replica: str = "", wait_pending_s: float = 0.0) -> Lookup:
        """The cached prefix of `keys`. `wait_pending_s`: first wait up to this long (the
        daemon caps it) for blocks after the prefix that another client is still writing (a
        decode engine's lookup of its prefill's blocks); the call's timeout grows by as much."""
        wait_ms = max(0, round(wait_pending_s * 1000))
        reply = self._call(partial(self._lookup, extra_s=wait_ms / 1000), pb.LookupRequest(
            layout=self.layout.layout_id, keys=pack_keys(keys, self.layout.key_width),
            key_width=self.layout.key_width, start_token=start_token,
            prompt_tokens=prompt_tokens, want_plan=plan, replica=replica,
            wait_pending_ms=wait_ms))
        return lookup_result(reply)

    def _lookup(self, request: pb.LookupRequest, extra_s: float = 0.0, **kwargs: Any
                ) -> pb.LookupResponse:
        """Lookup on the lookup socket when there is one (`kvtier.client.lookup_channel`),
        else over gRPC."""
        if self._lookups is not None:
            got = self._lookups.request(_LOOKUP, "", request.SerializeToString(), extra_s)
            if isinstance(got, Refusal):
                raise refused(got)
            if got is not None:
                return pb.LookupResponse.FromString(got)
        if extra_s and "timeout" in kwargs:
            kwargs["timeout"] += extra_s
        reply: pb.LookupResponse = self._stub.Lookup(request, **kwargs)
        return reply

    @contextlib.contextmanager
    def load(self, keys: Sequence[bytes]) -> Iterator[Loaded]:
        """Pins the cached prefix of `keys` and yields views of it; releases on exit."""
        packed = pack_keys(keys, self.layout.key_width)
        if not self.uses_shm:
            yield self._read_stream(packed)
            return
        reply = self._call(self._stub.Acquire, pb.AcquireRequest(
            layout=self.layout.layout_id, keys=packed, key_width=self.layout.key_width,
            lease_ttl_ms=self.lease_ttl_ms))
        seg = self._adopt(reply.segment)
        if reply.count and seg.dram is None:  # the new segment cannot be mapped: give back
            self._raw(self._stub.Release, pb.ReleaseRequest(lease_id=reply.lease_id))
            yield self._read_stream(packed)
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
                self._raw(self._stub.Release, pb.ReleaseRequest(
                    lease_id=reply.lease_id, bytes=reply.count * reply.block_bytes,
                    seconds=time.perf_counter() - started))

    def acquire(self, keys: Sequence[bytes]) -> Acquired:
        """Pins the cached prefix of `keys` until `release(lease_id)` or the lease TTL, for engines
        whose copy runs elsewhere (vLLM's scheduler pins, its worker process copies).
        Shared-memory only; `lease_id` is empty when nothing is cached."""
        reply = self._call(self._stub.Acquire, pb.AcquireRequest(
            layout=self.layout.layout_id, keys=pack_keys(keys, self.layout.key_width),
            key_width=self.layout.key_width, lease_ttl_ms=self.lease_ttl_ms))
        seg = self._adopt(reply.segment)
        return Acquired(reply.lease_id, reply.count, tuple(seg.slots(reply.offsets)),
                        [TIER_FROM_PB[t] for t in reply.source_tiers], reply.segment,
                        reply.block_bytes)

    def release(self, lease_id: str, nbytes: int = 0, seconds: float = 0.0) -> None:
        """Ends a lease from `acquire`; NOT_FOUND when it expired or the daemon restarted (then
        what was copied under it must be treated as invalid)."""
        self._raw(self._stub.Release, pb.ReleaseRequest(lease_id=lease_id, bytes=nbytes,
                                                        seconds=seconds))

    def slot_buffer_for(self, segment: pb.SegmentInfo) -> SlotBuffer | None:
        """The slot buffer of the pool `segment` names (mapping it if this client has not yet):
        the rows `Acquired.slots` index, from an `acquire` made by another client."""
        return self._adopt(segment).buffer()

    def _read_stream(self, packed: bytes) -> Loaded:
        req = pb.ReadBlocksRequest(layout=self.layout.layout_id, keys=packed,
                                   key_width=self.layout.key_width)

        def read() -> Loaded:
            if self._lookups is not None:  # the bulk call on the lookup socket, if it takes it
                got = self._lookups.read_blocks(req.SerializeToString(), self.layout.block_bytes)
                if isinstance(got, Refusal):
                    raise _AsRpcError(refused(got))
                if got is not None:
                    for block in got:
                        block.flags.writeable = False  # as the other paths' views
                    return Loaded(len(got), got, [Tier.DRAM] * len(got))
            stream = self._read_blocks(req, timeout=self.timeout, metadata=self._metadata,
                                           wait_for_ready=True)
            return assemble(stream, self.layout.block_bytes)

        try:
            return read()
        except _AsRpcError as exc:
            if not is_unknown_layout(exc.error):
                raise exc.error from None
        except grpc.RpcError as exc:
            err = rpc_error(exc)
            if not is_unknown_layout(err):
                raise err from None
        self._register()
        try:
            return read()
        except _AsRpcError as exc:
            raise exc.error from None
        except grpc.RpcError as exc:
            raise rpc_error(exc) from None

    def store(self, keys: Sequence[bytes], blocks: Sequence[Any], parent: bytes = b"") -> Stored:
        """Stores blocks (buffers of block_bytes each) under keys (a chain after `parent`)."""
        check_blocks(self.layout, keys, blocks)
        packed = pack_keys(keys, self.layout.key_width)
        if not self.uses_shm:
            if self._lookups is not None:  # the bulk call on the lookup socket, if it takes it
                got = self._lookups.write_blocks(pb.WriteHeader(
                    layout=self.layout.layout_id, keys=packed, key_width=self.layout.key_width,
                    parent_key=parent).SerializeToString(), blocks)
                if isinstance(got, Refusal):
                    raise refused(got)
                if got is not None:
                    done = pb.WriteBlocksResponse.FromString(got)
                    return Stored(done.stored, done.skipped)
            try:
                reply = self._write_blocks(
                    write_chunks(self.layout, packed, parent, blocks), timeout=self.timeout,
                    metadata=self._metadata, wait_for_ready=True)
            except grpc.RpcError as exc:
                raise rpc_error(exc) from None
            return Stored(reply.stored, reply.skipped)
        with self.store_into(keys, parent) as tx:
            for index, view in tx.slots:
                np.copyto(view, np.frombuffer(blocks[index], dtype=np.uint8))
        return Stored(tx.committed, len(keys) - len(tx.slots))

    @contextlib.contextmanager
    def store_into(self, keys: Sequence[bytes], parent: bytes = b"", *, handoff: bool = False,
                   allocated: pb.AllocateResponse | None = None) -> Iterator[StoreTx]:
        """Allocates slots for the keys not cached; yields (index in keys, writable view) pairs.

        Commits on normal exit, aborts if the block raises. Shared-memory only. `handoff`: the
        blocks are a prefill's for a decode engine (`AllocateRequest.handoff`): with a remote
        tier they go there at Commit ahead of background copies. `allocated`: the reply of an
        `allocate` of these keys made before (on another thread, say): no second Allocate.
        """
        reply = allocated if allocated is not None else self.allocate(keys, parent,
                                                                       handoff=handoff)
        seg = self._adopt(reply.segment)
        if reply.lease_id and seg.dram is None:
            self._raw(self._stub.Abort, pb.AbortRequest(lease_id=reply.lease_id))
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
                    self._raw(self._stub.Abort, pb.AbortRequest(lease_id=reply.lease_id))
            raise
        if reply.lease_id:
            done = self._raw(self._stub.Commit, pb.CommitRequest(
                lease_id=reply.lease_id, bytes=len(tx.slots) * reply.block_bytes,
                seconds=time.perf_counter() - started))
            tx.committed = done.committed

    def allocate(self, keys: Sequence[bytes], parent: bytes = b"", *, handoff: bool = False
                 ) -> pb.AllocateResponse:
        """The Allocate of `store_into` alone: from its return the keys are pending (a lookup
        that waits for them waits until they are committed); hand the reply to `store_into`
        (`allocated=`) to fill and commit the slots, or `abort` its lease."""
        reply: pb.AllocateResponse = self._call(self._stub.Allocate, pb.AllocateRequest(
            layout=self.layout.layout_id, keys=pack_keys(keys, self.layout.key_width),
            key_width=self.layout.key_width, parent_key=parent, lease_ttl_ms=self.lease_ttl_ms,
            handoff=handoff))
        return reply

    def abort(self, lease_id: str) -> None:
        """Ends an `allocate`'s lease without committing (its slots go back)."""
        self._raw(self._stub.Abort, pb.AbortRequest(lease_id=lease_id))

    def report_hbm(self, replica: str, added: Sequence[bytes] = (),
                   removed: Sequence[bytes] = (), reset: bool = False) -> int:
        """Tells the daemon which blocks `replica` now holds in its GPU pool; returns how many of
        `added` are cached (the others are ignored). `reset` forgets earlier reports first."""
        w = self.layout.key_width
        reply = self._call(self._stub.ReportHbm, pb.ReportHbmRequest(
            layout=self.layout.layout_id, replica=replica, key_width=w,
            added=pack_keys(added, w), removed=pack_keys(removed, w), reset=reset))
        return int(reply.tracked)

    def report_prefill(self, tokens: int, seconds: float, context_tokens: int = 0) -> None:
        self._call(self._stub.ReportPrefill, pb.ReportPrefillRequest(
            layout=self.layout.layout_id, tokens=tokens, seconds=seconds,
            context_tokens=context_tokens))

    def report_verification(self, keys: list[bytes], matched: int, mismatched: bool,
                            detail: str = "") -> pb.ReportVerificationResponse:
        """Shadow verification: `keys` (consecutive blocks of a chain) were recomputed and
        compared; keys[:matched] matched, and with `mismatched` keys[matched] did not: the
        daemon quarantines it and its descendants on every tier."""
        reply: pb.ReportVerificationResponse = self._call(
            self._stub.ReportVerification, pb.ReportVerificationRequest(
                layout=self.layout.layout_id, key_width=self.layout.key_width,
                keys=pack_keys(keys, self.layout.key_width), matched=matched,
                mismatched=mismatched, detail=detail))
        return reply

    def stats(self) -> pb.StatsResponse:
        reply: pb.StatsResponse = self._call(self._stub.Stats, pb.StatsRequest())
        return reply

    # -- this layout's blocks, as an operator would act on them (`kvtier.client.control`) ------

    def pin(self, keys: Sequence[bytes], ttl_s: float, hint: bool = False) -> pb.PinResponse:
        """Keeps the cached prefix of the chain `keys` through pressure for `ttl_s` seconds
        (a pinned block keeps the later deadline). `hint`: for one request of an engine (the
        daemon logs it at debug level)."""
        w = self.layout.key_width
        reply: pb.PinResponse = self._call(self._stub.Pin, pb.PinRequest(
            scope=pb.Selector(layout=self.layout.layout_id), keys=pack_keys(keys, w),
            key_width=w, ttl_seconds=ttl_s, hint=hint))
        return reply

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Ends the pins of these blocks; how many there were."""
        w = self.layout.key_width
        reply: pb.UnpinResponse = self._call(self._stub.Unpin, pb.UnpinRequest(
            scope=pb.Selector(layout=self.layout.layout_id), keys=pack_keys(keys, w),
            key_width=w))
        return int(reply.unpinned)

    def prefetch(self, keys: Sequence[bytes], hint: bool = False) -> pb.PrefetchResponse:
        """Brings the cached prefix of the chain `keys` into DRAM (from SSD, the remote tier)."""
        w = self.layout.key_width
        reply: pb.PrefetchResponse = self._call(self._stub.Prefetch, pb.PrefetchRequest(
            scope=pb.Selector(layout=self.layout.layout_id), keys=pack_keys(keys, w),
            key_width=w, hint=hint))
        return reply

    def evict(self, keys: Sequence[bytes]) -> pb.EvictResponse:
        """Removes each key's block and every block under it from every tier."""
        w = self.layout.key_width
        reply: pb.EvictResponse = self._call(self._stub.Evict, pb.EvictRequest(
            scope=pb.Selector(layout=self.layout.layout_id), keys=pack_keys(keys, w),
            key_width=w))
        return reply

    def watch(self, since: int = 0) -> Iterator[pb.KvEvent]:
        """This tenant's block events (blocks until the stream ends or the client closes)."""
        try:
            yield from self._stub.WatchEvents(pb.WatchEventsRequest(since_sequence=since),
                                              metadata=self._metadata, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise rpc_error(exc) from None


class _AsRpcError(Exception):
    """Carries a lookup-socket refusal through `_read_stream`'s unknown-layout retry."""

    def __init__(self, error: KvtierRpcError) -> None:
        super().__init__(str(error))
        self.error = error


def assemble(stream: Any, block_bytes: int) -> Loaded:
    """Rebuilds blocks from ReadBlocks chunks (checks order and sizes)."""
    asm = Assembler(block_bytes)
    for chunk in stream:
        if not asm.add(chunk):
            break
    return asm.result()


class Assembler:
    """Rebuilds blocks from ReadBlocks chunks (checks order, sizes). A block that arrives in one
    chunk is a read-only view of the received message, not copied; a block in several chunks is
    copied into an array of its own (read-only too, like the shared-memory path's views)."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.blocks: list[U8] = []
        self.filled: list[int] = []
        self.count = -1

    def add(self, chunk: pb.BlockChunk | Chunk) -> bool:
        """Takes one chunk; False when the stream says nothing is cached."""
        if self.count < 0:
            if chunk.index or chunk.offset:
                raise KvtierRpcError(grpc.StatusCode.DATA_LOSS, "ReadBlocks stream without start")
            self.count = chunk.count
            self.blocks = [_EMPTY] * self.count
            self.filled = [0] * self.count
            if not self.count:
                return False
        i, n = chunk.index, len(chunk.data)
        if i >= self.count or self.filled[i] != chunk.offset or chunk.offset + n > self.block_bytes:
            raise KvtierRpcError(grpc.StatusCode.DATA_LOSS, "out-of-order ReadBlocks chunk")
        data = np.frombuffer(chunk.data, np.uint8)
        if n == self.block_bytes:  # the whole block: its view of the message
            self.blocks[i] = data
        else:
            if not chunk.offset:
                self.blocks[i] = np.empty(self.block_bytes, np.uint8)
            self.blocks[i][chunk.offset : chunk.offset + n] = data
        self.filled[i] += n
        return True

    def result(self) -> Loaded:
        if any(f != self.block_bytes for f in self.filled):
            raise KvtierRpcError(grpc.StatusCode.DATA_LOSS, "truncated ReadBlocks stream")
        for b in self.blocks:
            b.flags.writeable = False
        count = max(self.count, 0)
        return Loaded(count, self.blocks, [Tier.DRAM] * count)


_EMPTY: U8 = np.empty(0, np.uint8)
