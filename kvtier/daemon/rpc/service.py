"""The gRPC servicer: a thin translation between kvtier.v1 messages and
`kvtier.daemon.cache.cache.Cache`.

Each handler authenticates the caller (`kvtier.daemon.auth`), validates the message's own fields,
calls the cache, and maps domain errors to gRPC status codes:

    InvalidArgument → INVALID_ARGUMENT     NotFound → NOT_FOUND
    PermissionDenied → PERMISSION_DENIED   ResourceExhausted → RESOURCE_EXHAUSTED
    FailedPrecondition → FAILED_PRECONDITION   Unauthenticated → UNAUTHENTICATED

A refused request changes nothing. Every call is counted and timed per method in the metrics.
`answer` is that whole treatment of a unary call — tenant, guard's verdict, handler, error
mapping, metrics — for any transport: the gRPC handlers call it through `_unary`, and the lookup
socket (`kvtier.daemon.rpc.local_socket`) through `lookup` and `call` (Lookup and the lease calls of
the shared-memory path), so a call means the same on both.
Requests arrive through `kvtier.daemon.rpc.guard` (per-method size limits, decoding that never
raises): a request it refused reaches the handler as a `Refused` value and is answered with its
code.

Tenancy: layouts, cost models and prefill rates are the caller's own
(`kvtier.daemon.cache.namespaces`); Stats and WatchEvents show the caller's own figures and events,
node-wide ones only for an admin token. Sessions (OpenSession): leases granted to a call carrying
`kvtier-session` metadata end when that session's stream ends — within moments of the client process
dying. Handlers run on the server's event loop; cache calls are short and synchronous, except SSD
promotions (Acquire, ReadBlocks), whose reads run on a worker thread (`Cache.acquire_async`), and
the page moves Allocate, WriteBlocks and Acquire's claims make room with, whose copies run on a
worker thread without the cache lock (`Cache.allocate_async`, `acquire_async`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import Message

from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier._version import __version__ as _version
from kvtier.core.chunkwire import Chunk, chunk_head
from kvtier.core.costmodel import CostModel
from kvtier.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from kvtier.core.lookupwire import lookup_response
from kvtier.core.segment import VERSION as SEGMENT_VERSION
from kvtier.core.types import Tier
from kvtier.daemon.auth import Authenticator, Unauthenticated
from kvtier.daemon.cache.api import AllocateResult, CacheApi, SegmentView
from kvtier.daemon.cache.namespaces import Tenant
from kvtier.daemon.rpc.guard import Refused, RefusedError, decoded

log = logging.getLogger(__name__)
CHUNK_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 8 << 20  # what the daemon sends at most (ReadBlocks chunks, replies)
SESSION_METADATA = "kvtier-session"

_CODES: dict[type[Exception], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}
_TIER_TO_PB = {Tier.HBM: pb.TIER_HBM, Tier.DRAM: pb.TIER_DRAM, Tier.SSD: pb.TIER_SSD,
               Tier.REMOTE: pb.TIER_REMOTE}

_TIERS = ("dram", "ssd")
R = TypeVar("R")
if TYPE_CHECKING:
    Ctx = grpc.aio.ServicerContext[Any, Any]
else:
    Ctx = grpc.aio.ServicerContext


_PLUS_ONE = bytes(min(i + 1, 255) for i in range(256))


def tiers_to_pb(tiers: list[Tier]) -> list[Any]:
    """kvtier.core.types.Tier → kvtier.v1.Tier (TIER_NONE = 0 shifts every value by one), in C."""
    return list(bytes(tiers).translate(_PLUS_ONE))


def segment_info(view: SegmentView) -> pb.SegmentInfo:
    """The segment as a client of a class of slot `view.stride` sees it (`kvtier.core.segment`);
    `by_fd`: an isolated pool, mapped from the fd the daemon's fd socket hands out."""
    h, stride = view.handle, view.stride
    return pb.SegmentInfo(by_fd=view.by_fd,
        name=h.name, size=h.size, generation=h.generation, slot_bytes=stride,
        slot_stride=stride, slot_count=h.page_bytes * h.page_count // stride,
        data_offset=h.data_offset, shm_dir=h.shm_dir, format_version=SEGMENT_VERSION,
        page_bytes=h.page_bytes, page_count=h.page_count, pool_slot_bytes=h.slot_size,
        pool_slot_stride=h.slot_stride, pool_slot_count=h.slot_count,
    )


class Failed(Exception):
    """A call answered with a gRPC status other than OK (already recorded in the metrics)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _seconds(value: float, name: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{name} must be a finite number >= 0, got {value}")
    return value


class KvTierService(pb_grpc.KvTierServicer):
    def __init__(self, cache: CacheApi, auth: Authenticator,
                 started_at: float | None = None) -> None:
        self.cache = cache
        self.auth = auth
        self.metrics = cache.metrics
        self.started_at = started_at or time.time()
        self._closing = asyncio.Event()  # set at shutdown: session streams end

    def close_sessions(self) -> None:
        self._closing.set()

    # -- plumbing ---------------------------------------------------------------------------

    def _failure(self, method: str, exc: Exception, started: float) -> Failed:
        """Records a refusal (domain error) or an internal error (a bug: logged); the `Failed`
        that answers it."""
        code = next((c for t, c in _CODES.items() if isinstance(exc, t)), None)
        if isinstance(exc, RefusedError):
            code = exc.refused.code
        if code is None:
            log.error("%s failed", method, exc_info=exc)
            code, message = grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})"
        else:
            message = str(exc)
        self._record(method, code, started)
        return Failed(code, message)

    async def _fail(self, method: str, context: Ctx, exc: Exception, started: float) -> NoReturn:
        """Records and answers a refusal or an internal error (`_failure`)."""
        failed = self._failure(method, exc, started)
        await context.abort(failed.code, failed.message)
        raise AssertionError("unreachable")  # context.abort raises

    def _tenant(self, context: Ctx) -> Tenant:
        return self.auth.authenticate(context.invocation_metadata())

    def _segment(self, tenant: Tenant, block_bytes: int) -> pb.SegmentInfo:
        """The pool as `tenant`'s blocks of `block_bytes` lie in it (their class's grid)."""
        return segment_info(self.cache.segment(tenant, block_bytes))

    @staticmethod
    def _session(context: Ctx) -> str:
        for k, v in context.invocation_metadata() or ():
            if k == SESSION_METADATA:
                return v if isinstance(v, str) else v.decode("ascii", "replace")
        return ""

    def _record(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self.metrics.rpcs.labels(method, code.name).inc()
        self.metrics.rpc_seconds.labels(method).observe(time.perf_counter() - started)

    # -- unary RPCs -------------------------------------------------------------------------

    async def RegisterLayout(
        self, request: pb.RegisterLayoutRequest, context: Ctx
    ) -> pb.RegisterLayoutResponse:
        async def go(tenant: Tenant) -> pb.RegisterLayoutResponse:
            cost = None
            if request.HasField("model"):
                m = request.model
                if not (math.isfinite(m.active_params) and m.active_params > 0
                        and m.num_layers > 0 and m.attn_dim > 0):
                    raise InvalidArgument(
                        "model: active_params, num_layers and attn_dim must be positive"
                    )
                cost = CostModel.dense(
                    "client", m.active_params, m.num_layers, m.attn_dim, m.sliding_window,
                )
            reg = self.cache.register_layout(
                tenant, request.model_id, request.layout, request.block_bytes, request.block_tokens,
                request.key_width, cost, tuple((g.name, g.block_bytes) for g in request.groups),
            )
            return pb.RegisterLayoutResponse(
                segment=self._segment(tenant, request.block_bytes),
                layout_id=reg.layout_id,
                max_blocks_per_request=self.cache.spec.max_blocks_per_request,
                default_lease_ttl_ms=int(self.cache.spec.lease_ttl_s * 1000),
                tenant=tenant.name,
            )

        return await self._unary("RegisterLayout", request, context, go)

    async def Lookup(self, request: pb.LookupRequest, context: Ctx) -> bytes:
        return await self._unary("Lookup", request, context, partial(self._lookup, request))

    async def lookup(self, request: pb.LookupRequest | Refused, tenant: Callable[[], Tenant]
                     ) -> bytes:
        """Lookup for a transport other than gRPC (`kvtier.daemon.rpc.local_socket`): the same
        checks, errors, metrics and stats as the RPC; raises `Failed` for a refused request."""
        return await self.answer("Lookup", request, tenant,
                                 partial(self._lookup, request))  # type: ignore[arg-type]

    async def call(self, method: str, request: Message | Refused, session: str,
                   tenant: Callable[[], Tenant]) -> bytes:
        """`method` (one of `kvtier.core.lookupwire.CALLS`) for a transport other than gRPC,
        `session` standing for the `kvtier-session` metadata: the same handler, checks, errors
        and metrics as the RPC, its reply in wire form; raises `Failed` for a refused request."""
        if method == "Lookup":
            return await self.lookup(request, tenant)  # type: ignore[arg-type]
        handlers: dict[str, Callable[..., Awaitable[Message]]] = {
            "Acquire": self._acquire, "Release": self._release, "Allocate": self._allocate,
            "Commit": self._commit, "Abort": self._abort}
        reply: Message = await self.answer(method, request, tenant,
                                           partial(handlers[method], request, session))
        return reply.SerializeToString()

    async def _lookup(self, request: pb.LookupRequest, tenant: Tenant) -> bytes:
        """The `LookupResponse` in wire form (`kvtier.core.lookupwire.lookup_response`), which
        gRPC sends as is (`kvtier.daemon.rpc.guard`) and the lookup socket frames."""
        res = await self.cache.lookup_async(
            tenant, request.layout, request.keys, request.key_width, request.start_token,
            request.prompt_tokens, request.want_plan, request.replica,
            request.wait_pending_ms / 1000,
        )
        plan = None
        if res.plan is not None:
            p = res.plan
            plan = pb.Plan(
                fetch_blocks=p.cut, predicted_fetch_seconds=p.fetch_s,
                predicted_recompute_seconds=p.recompute_avoided_s, reason=str(p.reason),
                promote_in_background=bool(p.promote_in_background),
            ).SerializeToString()
        return lookup_response(bytes(res.tiers).translate(_PLUS_ONE), plan)

    async def Acquire(self, request: pb.AcquireRequest, context: Ctx) -> pb.AcquireResponse:
        return await self._unary("Acquire", request, context,
                                 partial(self._acquire, request, self._session(context)))

    async def _acquire(self, request: pb.AcquireRequest, session: str, tenant: Tenant
                       ) -> pb.AcquireResponse:
        res = await self.cache.acquire_async(
            tenant, request.layout, request.keys, request.key_width,
            request.lease_ttl_ms / 1000, session,
        )
        info = self.cache.layout(tenant, request.layout)
        return pb.AcquireResponse(
            lease_id=res.lease_id, count=len(res.offsets), offsets=res.offsets,
            block_bytes=info.block_bytes, segment=self._segment(tenant, info.block_bytes),
            source_tiers=tiers_to_pb(res.source_tiers),
            lease_ttl_ms=int(res.ttl_s * 1000),
        )

    async def Release(self, request: pb.ReleaseRequest, context: Ctx) -> pb.ReleaseResponse:
        return await self._unary("Release", request, context, partial(self._release, request, ""))

    async def _release(self, request: pb.ReleaseRequest, session: str, tenant: Tenant
                       ) -> pb.ReleaseResponse:
        self.cache.release(
            tenant, request.lease_id, request.bytes, _seconds(request.seconds, "seconds")
        )
        return pb.ReleaseResponse()

    async def RenewLease(
        self, request: pb.RenewLeaseRequest, context: Ctx
    ) -> pb.RenewLeaseResponse:
        async def go(tenant: Tenant) -> pb.RenewLeaseResponse:
            ttl = self.cache.renew(tenant, request.lease_id, request.lease_ttl_ms / 1000)
            return pb.RenewLeaseResponse(lease_ttl_ms=int(ttl * 1000))

        return await self._unary("RenewLease", request, context, go)

    async def Allocate(self, request: pb.AllocateRequest, context: Ctx) -> pb.AllocateResponse:
        return await self._unary("Allocate", request, context,
                                 partial(self._allocate, request, self._session(context)))

    async def _allocate(self, request: pb.AllocateRequest, session: str, tenant: Tenant
                        ) -> pb.AllocateResponse:
        res = await self.cache.allocate_async(
            tenant, request.layout, request.keys, request.key_width, request.parent_key,
            request.lease_ttl_ms / 1000, session, request.handoff,
        )
        info = self.cache.layout(tenant, request.layout)
        return pb.AllocateResponse(
            lease_id=res.lease_id, indices=res.indices, offsets=res.offsets,
            block_bytes=info.block_bytes, segment=self._segment(tenant, info.block_bytes),
            lease_ttl_ms=int(res.ttl_s * 1000),
        )

    async def Commit(self, request: pb.CommitRequest, context: Ctx) -> pb.CommitResponse:
        return await self._unary("Commit", request, context, partial(self._commit, request, ""))

    async def _commit(self, request: pb.CommitRequest, session: str, tenant: Tenant
                      ) -> pb.CommitResponse:
        n = self.cache.commit(
            tenant, request.lease_id, request.bytes, _seconds(request.seconds, "seconds")
        )
        return pb.CommitResponse(committed=n)

    async def Abort(self, request: pb.AbortRequest, context: Ctx) -> pb.AbortResponse:
        return await self._unary("Abort", request, context, partial(self._abort, request, ""))

    async def _abort(self, request: pb.AbortRequest, session: str, tenant: Tenant
                     ) -> pb.AbortResponse:
        self.cache.abort(tenant, request.lease_id)
        return pb.AbortResponse()

    async def ReportHbm(
        self, request: pb.ReportHbmRequest, context: Ctx
    ) -> pb.ReportHbmResponse:
        async def go(tenant: Tenant) -> pb.ReportHbmResponse:
            n = self.cache.report_hbm(
                tenant, request.layout, request.replica, request.key_width, request.added,
                request.removed, request.reset,
            )
            return pb.ReportHbmResponse(tracked=n)

        return await self._unary("ReportHbm", request, context, go)

    async def ReportPrefill(
        self, request: pb.ReportPrefillRequest, context: Ctx
    ) -> pb.ReportPrefillResponse:
        async def go(tenant: Tenant) -> pb.ReportPrefillResponse:
            self.cache.report_prefill(
                tenant, request.layout, request.tokens, request.seconds, request.context_tokens
            )
            return pb.ReportPrefillResponse()

        return await self._unary("ReportPrefill", request, context, go)

    async def Stats(self, request: pb.StatsRequest, context: Ctx) -> pb.StatsResponse:
        async def go(tenant: Tenant) -> pb.StatsResponse:
            s = self.cache.stats(tenant)
            value, total = self.metrics.value, self.metrics.total
            reply = pb.StatsResponse(
                tiers=[
                    pb.TierStats(tier=pb.TIER_DRAM, capacity_bytes=s.dram_capacity_bytes,
                                 used_bytes=s.dram_used_bytes, blocks=s.dram_blocks),
                    pb.TierStats(tier=pb.TIER_SSD, capacity_bytes=s.ssd_capacity_bytes,
                                 used_bytes=s.ssd_used_bytes, blocks=s.ssd_blocks),
                ],
                active_leases=s.read_leases + s.write_leases,
                lookups=s.lookups, blocks_hit=s.blocks_hit, blocks_missed=s.blocks_missed,
                tenant_dram_bytes=s.tenant_dram_bytes, tenant_ssd_bytes=s.tenant_ssd_bytes,
                tenant_dram_quota_bytes=tenant.dram_quota_bytes,
                tenant_ssd_quota_bytes=tenant.ssd_quota_bytes,
                tenant_dram_guarantee_bytes=tenant.dram_guarantee_bytes,
                segment=segment_info(self.cache.segment(tenant)),
                uptime_seconds=time.time() - self.started_at,
                layouts=s.layouts, version=_version, node_wide=s.node_wide,
                groups=[pb.GroupStats(model_id=g.model_id, group=g.group, dram_bytes=g.dram_bytes,
                                      ssd_bytes=g.ssd_bytes) for g in s.groups],
            )
            if s.node_wide:  # node totals, and the miss-ratio curve of all tenants' traffic
                reply.lookups = int(total("kvtier_lookups_total"))
                reply.blocks_hit = int(sum(total("kvtier_blocks_hit_total", tier=t)
                                           for t in _TIERS))
                reply.blocks_missed = int(total("kvtier_blocks_missed_total"))
                reply.writeback_dropped = int(value("kvtier_writeback_dropped_total"))
                reply.checksum_failures = int(value("kvtier_checksum_failures_total"))
                reply.mrc.extend(
                    pb.MrcPoint(scaled=p.scaled, factor=p.factor, dram_blocks=p.dram_blocks,
                                ssd_blocks=p.ssd_blocks, dram_hit_ratio=p.dram_hit_ratio,
                                hit_ratio=p.hit_ratio) for p in self.cache.mrc_gauges().points)
                reply.mrc_sampled_blocks = self.cache.mrc_sampled()
            return reply

        return await self._unary("Stats", request, context, go)

    async def answer(self, method: str, request: object, tenant: Callable[[], Tenant],
                     go: Callable[[Tenant], Awaitable[R]]) -> R:
        """A unary call on any transport: the caller's tenant (`tenant()`), the handler, the
        metrics; raises `Failed` (recorded) for a refused request or an internal error."""
        started = time.perf_counter()
        try:
            if isinstance(request, Refused):
                raise RefusedError(request)
            result = await go(tenant())
        except Exception as exc:
            raise self._failure(method, exc, started) from None
        self._record(method, grpc.StatusCode.OK, started)
        return result

    async def _unary(
        self, method: str, request: object, context: Ctx, go: Callable[[Tenant], Awaitable[R]]
    ) -> R:
        try:
            return await self.answer(method, request, lambda: self._tenant(context), go)
        except Failed as failed:
            await context.abort(failed.code, failed.message)
            raise AssertionError("unreachable") from None  # context.abort raises

    # -- streams ----------------------------------------------------------------------------

    async def ReadBlocks(
        self, request: pb.ReadBlocksRequest, context: Ctx
    ) -> AsyncIterator[pb.BlockChunk | bytes]:
        started = time.perf_counter()
        try:
            if isinstance(request, Refused):
                raise RefusedError(request)
            tenant = self._tenant(context)
            async with self.cache.reading(
                tenant, request.layout, request.keys, request.key_width
            ) as stream:
                if not len(stream):
                    yield pb.BlockChunk(index=0, offset=0, data=b"", count=0)
                size = stream.block_bytes
                for i in range(len(stream)):
                    for off in range(0, size, CHUNK_BYTES):
                        # in wire form (`kvtier.core.chunkwire`): the bytes copied once, under
                        # the lock while the lease lives, behind the message's head
                        head = chunk_head(i, off, len(stream) if i == 0 and off == 0 else 0,
                                          min(CHUNK_BYTES, size - off), wrapped=False)
                        yield stream.read(i, off, CHUNK_BYTES, head)
        except Exception as exc:
            await self._fail("ReadBlocks", context, exc, started)
        self._record("ReadBlocks", grpc.StatusCode.OK, started)

    async def WriteBlocks(
        self, request_iterator: AsyncIterator[pb.WriteBlocksRequest], context: Ctx
    ) -> pb.WriteBlocksResponse:
        started = time.perf_counter()
        try:
            tenant = self._tenant(context)
            reply = await self._write_blocks(tenant, decoded(request_iterator))
        except Exception as exc:
            await self._fail("WriteBlocks", context, exc, started)
        self._record("WriteBlocks", grpc.StatusCode.OK, started)
        return reply

    async def _write_blocks(
        self, tenant: Tenant, requests: AsyncIterator[pb.WriteBlocksRequest]
    ) -> pb.WriteBlocksResponse:
        first = await anext(aiter(requests), None)
        if first is None or isinstance(first, Chunk) or not first.HasField("header"):
            raise InvalidArgument("the first WriteBlocks message must be a header")
        h = first.header
        info = self.cache.layout(tenant, h.layout)
        alloc = await self.cache.allocate_async(tenant, h.layout, h.keys, h.key_width,
                                                h.parent_key, 0.0)
        n_keys = len(h.keys) // info.key_width
        slots = self.cache.writing(tenant, alloc.lease_id, alloc.offsets, info.block_bytes)
        slot_of = {index: j for j, index in enumerate(alloc.indices)}
        done, committed = 0, False
        try:
            index, filled = 0, 0
            async for msg in requests:
                if isinstance(msg, Chunk):  # read by hand (`rpc_guard`): data is a view
                    c = msg
                elif msg.HasField("chunk"):
                    c = msg.chunk
                else:
                    raise InvalidArgument("only the first WriteBlocks message may be a header")
                if filled == info.block_bytes:
                    index, filled = index + 1, 0
                if c.index != index or c.offset != filled:
                    raise InvalidArgument(
                        f"expected bytes of block {index} at offset {filled}, got block "
                        f"{c.index} at offset {c.offset}"
                    )
                if index >= n_keys or filled + len(c.data) > info.block_bytes or not c.data:
                    raise InvalidArgument(
                        f"chunk overruns the {n_keys} blocks of {info.block_bytes} bytes"
                    )
                if index in slot_of:  # checked and copied under the lock while the lease lives
                    slots.write(slot_of[index], filled, c.data)
                filled += len(c.data)
            got = index + (1 if filled == info.block_bytes else 0)
            if got != n_keys:
                raise InvalidArgument(f"received {got} complete blocks of {n_keys}")
            if alloc.lease_id:
                done = self.cache.commit(tenant, alloc.lease_id, len(slot_of) * info.block_bytes)
            committed = True
        finally:
            if alloc.lease_id and not committed:
                with contextlib.suppress(NotFound):  # expired meanwhile
                    self.cache.abort(tenant, alloc.lease_id)
        return pb.WriteBlocksResponse(stored=done, skipped=n_keys - len(alloc.indices))

    # -- the bulk calls of the lookup socket (`kvtier.core.lookupwire.BULK`) -------------------

    async def begin_write(self, header: pb.WriteHeader | Refused,
                          tenant: Callable[[], Tenant]) -> BlockWrite:
        """A WriteBlocks whose payload follows as raw bytes (`BlockWrite`): the tenant, its
        layout and the slots claimed as the RPC claims them; raises `Failed` (recorded)."""
        started = time.perf_counter()
        try:
            if isinstance(header, Refused):
                raise RefusedError(header)
            who = tenant()
            info = self.cache.layout(who, header.layout)
            alloc = await self.cache.allocate_async(who, header.layout, header.keys,
                                                    header.key_width, header.parent_key, 0.0)
        except Exception as exc:
            raise self._failure("WriteBlocks", exc, started) from None
        return BlockWrite(self, who, alloc, len(header.keys) // info.key_width,
                          info.block_bytes, started)

    async def read_blocks(self, request: pb.ReadBlocksRequest | Refused,
                          tenant: Callable[[], Tenant], begin: Callable[[int], None],
                          send: Callable[[bytes], Awaitable[None]]) -> None:
        """A ReadBlocks whose payload goes out as raw bytes: `begin(count)` once the blocks are
        held, then `send` of each block's bytes (copied under the lock while the lease lives).
        Raises `Failed` (recorded); a failure after `begin` must end the connection."""
        started = time.perf_counter()
        try:
            if isinstance(request, Refused):
                raise RefusedError(request)
            async with self.cache.reading(
                tenant(), request.layout, request.keys, request.key_width
            ) as stream:
                begin(len(stream))
                for i in range(len(stream)):
                    await send(stream.read(i, 0, stream.block_bytes))
        except ConnectionError:
            self._record("ReadBlocks", grpc.StatusCode.CANCELLED, started)
            raise Failed(grpc.StatusCode.CANCELLED, "the client went away mid-payload") from None
        except Exception as exc:
            raise self._failure("ReadBlocks", exc, started) from None
        self._record("ReadBlocks", grpc.StatusCode.OK, started)

    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: Ctx
    ) -> AsyncIterator[pb.KvEvent]:
        started = time.perf_counter()
        try:
            if isinstance(request, Refused):
                raise RefusedError(request)
            tenant = self._tenant(context)
        except (Unauthenticated, RefusedError) as exc:
            await self._fail("WatchEvents", context, exc, started)
        node_wide = tenant.admin
        sub = self.cache.events.subscribe(None if node_wide else tenant.name,
                                          request.since_sequence)
        try:
            while True:
                event = await sub.queue.get()
                if event is None:
                    break
                msg = pb.KvEvent(
                    sequence=event.node_sequence if node_wide else event.sequence,
                    timestamp=event.timestamp)
                medium = _TIER_TO_PB[event.tier]
                if event.stored:
                    msg.stored.CopyFrom(pb.BlockStored(
                        block_hashes=event.keys, parent_block_hash=event.parent,
                        block_size=event.block_tokens, medium=medium, layout=event.layout,
                    ))
                else:
                    msg.removed.CopyFrom(pb.BlockRemoved(
                        block_hashes=event.keys, medium=medium, layout=event.layout,
                    ))
                yield msg
        finally:
            self.cache.events.unsubscribe(sub)
            self._record("WatchEvents", grpc.StatusCode.OK, started)


    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: Ctx
    ) -> AsyncIterator[pb.SessionEvent]:
        """Names the session, then holds the stream open; when it ends (the client cancelled,
        its connection closed, the daemon stops) every lease granted under it ends."""
        started = time.perf_counter()
        try:
            if isinstance(request, Refused):
                raise RefusedError(request)
            tenant = self._tenant(context)
        except (Unauthenticated, RefusedError) as exc:
            await self._fail("OpenSession", context, exc, started)
        session = self.cache.open_session(tenant)
        try:
            yield pb.SessionEvent(session_id=session)
            await self._closing.wait()
        finally:
            ended = self.cache.close_session(session)
            if ended:
                log.info("session of tenant %s ended with %d lease(s) still held: ended them",
                         tenant.name, ended)
            self._record("OpenSession", grpc.StatusCode.OK, started)


class BlockWrite:
    """The WriteBlocks of `KvTierService.begin_write`, its payload fed as it arrives (`feed`:
    the blocks in key order, each block's bytes copied into its slot under the lock while the
    lease lives, those of blocks already cached skipped), then `finish` (commit) or `abort`
    (the payload ended short or the connection did: the slots freed, nothing committed)."""

    def __init__(self, service: KvTierService, tenant: Tenant, alloc: AllocateResult, n_keys: int,
                 block_bytes: int, started: float) -> None:
        self._service = service
        self._tenant = tenant
        self._alloc = alloc
        self._slots = service.cache.writing(tenant, alloc.lease_id, alloc.offsets, block_bytes)
        self._slot_of = {index: j for j, index in enumerate(alloc.indices)}
        self.n_keys = n_keys
        self.block_bytes = block_bytes
        self.total = n_keys * block_bytes
        self.received = 0
        self._started = started
        self._ended = False

    def feed(self, data: memoryview) -> int:
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

    @property
    def complete(self) -> bool:
        return self.received == self.total

    def finish(self) -> bytes:
        """Commits the complete payload; the serialized `WriteBlocksResponse`. Raises `Failed`."""
        assert self.complete and not self._ended
        service, done = self._service, 0
        try:
            if self._alloc.lease_id:
                done = service.cache.commit(self._tenant, self._alloc.lease_id,
                                            len(self._slot_of) * self.block_bytes)
        except Exception as exc:
            raise self.fail(exc) from None
        self._ended = True
        service._record("WriteBlocks", grpc.StatusCode.OK, self._started)
        return pb.WriteBlocksResponse(
            stored=done, skipped=self.n_keys - len(self._alloc.indices)).SerializeToString()

    def abort(self, code: grpc.StatusCode = grpc.StatusCode.CANCELLED,
              message: str = "the client went away mid-payload") -> Failed:
        """Frees the slots, commits nothing; the `Failed` answering it, recorded as `code`."""
        self._free()
        self._service._record("WriteBlocks", code, self._started)
        return Failed(code, message)

    def fail(self, exc: Exception) -> Failed:
        """`abort` for the error `exc` (its code, as the RPC would answer it)."""
        self._free()
        return self._service._failure("WriteBlocks", exc, self._started)

    def _free(self) -> None:
        if not self._ended:
            self._ended = True
            if self._alloc.lease_id:
                with contextlib.suppress(NotFound):  # expired meanwhile: already freed
                    self._service.cache.abort(self._tenant, self._alloc.lease_id)
