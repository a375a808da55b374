"""The daemon's methods, whatever the transport: each handler turns a `kvtier.v1` request into
calls on the cache (`kvtier.daemon.cache.api.CacheApi`) and its reply.

`Service.answer` is the whole treatment of a unary call — the guard's verdict, the caller's
tenant, the handler of `kvtier.core.methods.METHODS`, the error's status code, the metrics
(`kvtier.daemon.rpc.calls`) — and both transports call it: the gRPC servicer
(`kvtier.daemon.rpc.grpc_server`) and the local socket (`kvtier.daemon.rpc.local_socket`), so a
call means the same on both. The bulk calls go through `kvtier.daemon.rpc.bulk`, one path for
both transports. A request the guard refused (`kvtier.daemon.rpc.guard`: oversized,
undecodable) reaches `answer` as a `Refused` value and is answered with its code.

Handlers: one per unary method, named after it (`register_layout` for RegisterLayout); a method
that `waits` (`Method.waits`) has a coroutine handler, the others a plain one that answers at
once on the event loop — checked when the service is built (`handlers`). Replies are protobuf
messages, or bytes already in wire form (Lookup's, `kvtier.core.lookupwire.lookup_response`).

Tenancy: layouts, cost models and prefill rates are the caller's own; Stats and WatchEvents show
the caller's own figures and events, node-wide ones only for an admin token; the operators'
calls (Evict, Pin, Unpin, ListPins, Prefetch) act on the caller's own namespaces, another
tenant's or every tenant's only for an admin token. Sessions: leases an
Acquire or Allocate takes under a session end when it ends (`Cache.close_session`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from kvtier._proto import kvtier_pb2 as pb
from kvtier._version import __version__ as _version
from kvtier.core.costmodel import CostModel
from kvtier.core.errors import FailedPrecondition, InvalidArgument
from kvtier.core.lookupwire import lookup_response
from kvtier.core.methods import METHODS, PROTOCOL_VERSION, Local
from kvtier.core.segment import VERSION as SEGMENT_VERSION
from kvtier.core.types import Tier
from kvtier.daemon.auth import Authenticator
from kvtier.daemon.cache.api import CacheApi, Scope, SegmentView
from kvtier.daemon.cache.events import BlockEvent
from kvtier.daemon.cache.namespaces import Tenant
from kvtier.daemon.rpc.bulk import BulkRead, BulkWrite
from kvtier.daemon.rpc.calls import Call, Failed, Outcomes

__all__ = ["CHUNK_BYTES", "MAX_MESSAGE_BYTES", "Call", "Failed", "Service", "segment_info"]
from kvtier.daemon.rpc.guard import Refused, RefusedError

log = logging.getLogger(__name__)
OK = grpc.StatusCode.OK
CHUNK_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 8 << 20  # what the daemon sends at most (ReadBlocks chunks, replies)
_TIERS = ("dram", "ssd")
_PLUS_ONE = bytes(min(i + 1, 255) for i in range(256))

Reply = Message | bytes
Handler = Callable[[Any, Call], Reply | Awaitable[Reply]]


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


def _seconds(value: float, name: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{name} must be a finite number >= 0, got {value}")
    return value


def _scope(sel: pb.Selector, keys: bytes = b"", key_width: int = 0) -> Scope:
    return Scope(sel.tenant, sel.all_tenants, sel.model_id, sel.layout, keys, key_width)


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


class Service:
    """The handlers over one cache; `auth` is swapped whole by a reload (`kvtier.daemon.reload`)."""

    def __init__(self, cache: CacheApi, auth: Authenticator,
                 started_at: float | None = None) -> None:
        self.cache = cache
        self.auth = auth
        self.metrics = cache.metrics
        self.outcomes = Outcomes(cache.metrics)
        self.started_at = started_at or time.time()
        self.closing = asyncio.Event()  # set at shutdown: session streams end
        self._parked = os.environ.get("KVTIER_TEST_PARK", "")  # a test-only hook: see `answer`
        if self._parked:
            log.warning("KVTIER_TEST_PARK=%s (a test-only hook): every %s call waits until the "
                        "daemon exits", self._parked, self._parked)
        self.handlers: dict[str, Handler] = {}
        for m in METHODS:
            if m.local is Local.BULK_READ or m.local is Local.BULK_WRITE or (
                    m.name in ("WatchEvents", "OpenSession")):
                continue  # streams: `begin_write`, `begin_read`, `events`, `session`
            handler = getattr(self, _snake(m.name))
            if inspect.iscoroutinefunction(handler) is not m.waits:
                raise AssertionError(f"{m.name}'s handler must {'' if m.waits else 'not '}wait")
            self.handlers[m.name] = handler

    def close_sessions(self) -> None:
        self.closing.set()

    def tenant_of(self, metadata: Any) -> Tenant:
        """The caller of a call carrying `metadata` (`authorization: Bearer <token>`)."""
        return self.auth.authenticate(metadata)

    async def answer(self, method: str, request: object, call: Call) -> Reply:
        """A unary call on any transport: the handler of `method` for the caller, the metrics;
        raises `Failed` (recorded) for a refused request or an internal error."""
        started = time.perf_counter()
        if method == self._parked:  # the kill of a test lands at a known point of a request
            log.warning("KVTIER_TEST_PARK: a %s call parked", method)
            await asyncio.Event().wait()
        try:
            if isinstance(request, Refused):
                raise RefusedError(request)
            result = self.handlers[method](request, call)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            raise self.outcomes.failure(method, exc, started) from None
        self.outcomes.record(method, OK, started)
        return result

    def _segment(self, tenant: Tenant, block_bytes: int) -> pb.SegmentInfo:
        """The pool as `tenant`'s blocks of `block_bytes` lie in it (their class's grid)."""
        return segment_info(self.cache.segment(tenant, block_bytes))

    # -- unary handlers ----------------------------------------------------------------------

    def register_layout(self, request: pb.RegisterLayoutRequest, call: Call
                        ) -> pb.RegisterLayoutResponse:
        tenant = call.tenant()
        if request.protocol_version not in (0, PROTOCOL_VERSION):
            raise FailedPrecondition(
                f"the client speaks protocol {request.protocol_version}, this daemon protocol "
                f"{PROTOCOL_VERSION}: upgrade the daemon and its clients together")
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
        spec = self.cache.spec
        return pb.RegisterLayoutResponse(
            segment=self._segment(tenant, request.block_bytes),
            layout_id=reg.layout_id,
            max_blocks_per_request=spec.max_blocks_per_request,
            default_lease_ttl_ms=int(spec.lease_ttl_s * 1000),
            tenant=tenant.name, protocol_version=PROTOCOL_VERSION,
        )

    async def lookup(self, request: pb.LookupRequest, call: Call) -> bytes:
        """The `LookupResponse` in wire form (`kvtier.core.lookupwire.lookup_response`), which
        gRPC sends as is and the local socket frames."""
        res = await self.cache.lookup_async(
            call.tenant(), request.layout, request.keys, request.key_width, request.start_token,
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

    async def acquire(self, request: pb.AcquireRequest, call: Call) -> pb.AcquireResponse:
        tenant = call.tenant()
        res = await self.cache.acquire_async(
            tenant, request.layout, request.keys, request.key_width,
            request.lease_ttl_ms / 1000, call.session,
        )
        info = self.cache.layout(tenant, request.layout)
        return pb.AcquireResponse(
            lease_id=res.lease_id, count=len(res.offsets), offsets=res.offsets,
            block_bytes=info.block_bytes, segment=self._segment(tenant, info.block_bytes),
            source_tiers=tiers_to_pb(res.source_tiers),
            lease_ttl_ms=int(res.ttl_s * 1000),
        )

    def release(self, request: pb.ReleaseRequest, call: Call) -> pb.ReleaseResponse:
        self.cache.release(call.tenant(), request.lease_id, request.bytes,
                           _seconds(request.seconds, "seconds"))
        return pb.ReleaseResponse()

    def renew_lease(self, request: pb.RenewLeaseRequest, call: Call) -> pb.RenewLeaseResponse:
        ttl = self.cache.renew(call.tenant(), request.lease_id, request.lease_ttl_ms / 1000)
        return pb.RenewLeaseResponse(lease_ttl_ms=int(ttl * 1000))

    async def allocate(self, request: pb.AllocateRequest, call: Call) -> pb.AllocateResponse:
        tenant = call.tenant()
        res = await self.cache.allocate_async(
            tenant, request.layout, request.keys, request.key_width, request.parent_key,
            request.lease_ttl_ms / 1000, call.session, request.handoff,
        )
        info = self.cache.layout(tenant, request.layout)
        return pb.AllocateResponse(
            lease_id=res.lease_id, indices=res.indices, offsets=res.offsets,
            block_bytes=info.block_bytes, segment=self._segment(tenant, info.block_bytes),
            lease_ttl_ms=int(res.ttl_s * 1000),
        )

    def commit(self, request: pb.CommitRequest, call: Call) -> pb.CommitResponse:
        n = self.cache.commit(call.tenant(), request.lease_id, request.bytes,
                              _seconds(request.seconds, "seconds"))
        return pb.CommitResponse(committed=n)

    def abort(self, request: pb.AbortRequest, call: Call) -> pb.AbortResponse:
        self.cache.abort(call.tenant(), request.lease_id)
        return pb.AbortResponse()

    def report_hbm(self, request: pb.ReportHbmRequest, call: Call) -> pb.ReportHbmResponse:
        n = self.cache.report_hbm(
            call.tenant(), request.layout, request.replica, request.key_width, request.added,
            request.removed, request.reset,
        )
        return pb.ReportHbmResponse(tracked=n)

    def report_prefill(self, request: pb.ReportPrefillRequest, call: Call
                       ) -> pb.ReportPrefillResponse:
        self.cache.report_prefill(call.tenant(), request.layout, request.tokens,
                                  request.seconds, request.context_tokens)
        return pb.ReportPrefillResponse()

    async def report_verification(self, request: pb.ReportVerificationRequest, call: Call
                                  ) -> pb.ReportVerificationResponse:
        q = await self.cache.report_verification_async(
            call.tenant(), request.layout, request.keys, request.key_width, request.matched,
            request.mismatched, request.detail)
        return pb.ReportVerificationResponse(quarantined_dram=q.dram, quarantined_ssd=q.ssd,
                                             quarantined_remote=q.remote, deferred=q.deferred)

    def stats(self, request: pb.StatsRequest, call: Call) -> pb.StatsResponse:
        tenant = call.tenant()
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
            verify_verified_blocks=s.verified, verify_mismatched_blocks=s.mismatched,
            verify_quarantined_blocks=s.quarantined,
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

    # -- operators' actions (`kvtier.daemon.cache.control`) -----------------------------------

    async def evict(self, request: pb.EvictRequest, call: Call) -> pb.EvictResponse:
        r = await self.cache.evict_async(
            call.tenant(), _scope(request.scope, request.keys, request.key_width),
            request.clear, request.local_only)
        return pb.EvictResponse(
            namespaces=r.namespaces, blocks=r.blocks, dram_blocks=r.dram_blocks,
            ssd_blocks=r.ssd_blocks, remote_blocks=r.remote_blocks, doomed_blocks=r.doomed,
            remote_error=r.remote_error)

    def pin(self, request: pb.PinRequest, call: Call) -> pb.PinResponse:
        r = self.cache.pin(call.tenant(), _scope(request.scope, request.keys, request.key_width),
                           request.ttl_seconds, request.hint)
        return pb.PinResponse(namespaces=r.namespaces, asked=r.asked, pinned=r.pinned,
                              new_pins=r.new, ttl_seconds=r.ttl_s)

    def unpin(self, request: pb.UnpinRequest, call: Call) -> pb.UnpinResponse:
        n = self.cache.unpin(call.tenant(),
                             _scope(request.scope, request.keys, request.key_width))
        return pb.UnpinResponse(unpinned=n)

    def list_pins(self, request: pb.ListPinsRequest, call: Call) -> pb.ListPinsResponse:
        got = self.cache.pins(call.tenant(), _scope(request.scope))
        return pb.ListPinsResponse(namespaces=[pb.PinnedNamespace(
            tenant=p.tenant, model_id=p.model_id, layout=p.layout_id, blocks=p.blocks,
            first_expiry_seconds=p.first_expiry_s, last_expiry_seconds=p.last_expiry_s)
            for p in got])

    async def prefetch(self, request: pb.PrefetchRequest, call: Call) -> pb.PrefetchResponse:
        r = await self.cache.prefetch_async(
            call.tenant(), _scope(request.scope, request.keys, request.key_width), request.hint)
        return pb.PrefetchResponse(namespaces=r.namespaces, asked=r.asked, in_dram=r.in_dram,
                                   from_ssd=r.from_ssd, from_remote=r.from_remote,
                                   missing=r.missing)

    # -- streams: the bulk calls (both transports), events and sessions (gRPC) ---------------

    async def begin_write(self, header: pb.WriteHeader | Refused, call: Call) -> BulkWrite:
        """A WriteBlocks: its slots claimed (`BulkWrite`); raises `Failed` (recorded)."""
        return await BulkWrite.begin(self.cache, self.outcomes, header, call)

    def begin_read(self, request: pb.ReadBlocksRequest | Refused, call: Call) -> BulkRead:
        """A ReadBlocks (`BulkRead`: the blocks held, then sent in pieces)."""
        return BulkRead(self.cache, self.outcomes, request, call)

    async def events(self, request: pb.WatchEventsRequest | Refused, call: Call
                     ) -> AsyncIterator[tuple[BlockEvent, bool]]:
        """WatchEvents: the caller's block events (every tenant's for an admin), each with
        whether its numbers are node-wide, until the log closes. Raises `Failed` (recorded)
        when the caller is refused."""
        started = time.perf_counter()
        try:
            if isinstance(request, Refused):
                raise RefusedError(request)
            tenant = call.tenant()
        except Exception as exc:
            raise self.outcomes.failure("WatchEvents", exc, started) from None
        node_wide = tenant.admin
        sub = self.cache.events.subscribe(None if node_wide else tenant.name,
                                          request.since_sequence)
        try:
            while True:
                event = await sub.queue.get()
                if event is None:
                    break
                yield event, node_wide
        finally:
            self.cache.events.unsubscribe(sub)
            self.outcomes.record("WatchEvents", OK, started)

    async def session(self, request: pb.OpenSessionRequest | Refused, call: Call
                      ) -> AsyncIterator[str]:
        """OpenSession: the new session's id, then held open until the stream ends (the client
        cancelled, its connection closed, the daemon stops); then every lease granted under it
        ends. Raises `Failed` (recorded) when the caller is refused."""
        started = time.perf_counter()
        try:
            if isinstance(request, Refused):
                raise RefusedError(request)
            tenant = call.tenant()
        except Exception as exc:
            raise self.outcomes.failure("OpenSession", exc, started) from None
        session = self.cache.open_session(tenant)
        try:
            yield session
            await self.closing.wait()
        finally:
            ended = self.cache.close_session(session)
            if ended:
                log.info("session of tenant %s ended with %d lease(s) still held: ended them",
                         tenant.name, ended)
            self.outcomes.record("OpenSession", OK, started)

