"""The gRPC transport: the servicer, built from the method table, and the server around it.

`add_servicer` registers one behaviour per method of `kvtier.core.methods.METHODS` with the
guard's size-checked, non-raising decoding (`kvtier.daemon.rpc.guard`; it replaces the generated
`add_KvTierServicer_to_server`, whose deserializers raise): a unary method answers through
`Service.answer` (the caller from the `authorization` metadata, the session from
`kvtier-session`), ReadBlocks and WriteBlocks go through the one bulk path
(`kvtier.daemon.rpc.bulk`), WatchEvents and OpenSession through the service's streams. A refused
call is aborted with its code and message.

`GrpcServer` is the server: the receive limit is the largest message any method legitimately
carries (`Limits.largest`), health checking and reflection beside the KvTier service, the Unix
socket created 0600 (0660 with a group), TCP optional (TLS with a certificate).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvtier._proto import kvtier_pb2 as pb
from kvtier.core.chunkwire import Chunk
from kvtier.core.errors import InvalidArgument, UsageError
from kvtier.core.methods import METHODS, Method
from kvtier.core.types import Tier
from kvtier.daemon import sharing
from kvtier.daemon.cache.events import BlockEvent
from kvtier.daemon.rpc.calls import Call, Failed
from kvtier.daemon.rpc.guard import Limits, decoded, deserializer
from kvtier.daemon.rpc.service import CHUNK_BYTES, MAX_MESSAGE_BYTES, Service

if TYPE_CHECKING:
    Ctx = grpc.aio.ServicerContext[Any, Any]
else:
    Ctx = grpc.aio.ServicerContext

SERVICE = pb.DESCRIPTOR.services_by_name["KvTier"]
SESSION_METADATA = "kvtier-session"
_TIER_TO_PB = {Tier.HBM: pb.TIER_HBM, Tier.DRAM: pb.TIER_DRAM, Tier.SSD: pb.TIER_SSD,
               Tier.REMOTE: pb.TIER_REMOTE}


def _session(context: Ctx) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == SESSION_METADATA:
            return v if isinstance(v, str) else v.decode("ascii", "replace")
    return ""


def _call(service: Service, context: Ctx) -> Call:
    return Call(lambda: service.tenant_of(context.invocation_metadata()), _session(context))


async def _abort(context: Ctx, failed: Failed) -> Any:
    await context.abort(failed.code, failed.message)
    raise AssertionError("unreachable")  # context.abort raises


def _serialize(msg: Any) -> bytes:
    """A reply; one already in wire form (Lookup's, a ReadBlocks chunk) as is."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _unary(service: Service, m: Method) -> Callable[[Any, Ctx], Awaitable[Any]]:
    async def behavior(request: Any, context: Ctx) -> Any:
        try:
            return await service.answer(m.name, request, _call(service, context))
        except Failed as failed:
            return await _abort(context, failed)
    return behavior


def _read_blocks(service: Service) -> Callable[[Any, Ctx], Awaitable[None]]:
    async def behavior(request: Any, context: Ctx) -> None:
        try:
            async with service.begin_read(request, _call(service, context)) as read:
                ttl = (read.stream.ttl_s if read.stream is not None else 0.0) or None

                async def send(msg: Any) -> None:
                    # a client that takes no piece for the lease's TTL could not go on (nothing
                    # renewed its lease): it holds nothing longer (DEADLINE_EXCEEDED)
                    try:
                        await asyncio.wait_for(context.write(msg), ttl)
                    except TimeoutError:
                        raise read.expired() from None

                if not read.count:
                    await send(pb.BlockChunk(index=0, offset=0, data=b"", count=0))
                for piece in read.pieces(CHUNK_BYTES, chunked=True):
                    await send(piece)
        except Failed as failed:
            await _abort(context, failed)
    return behavior


def _write_blocks(service: Service) -> Callable[[AsyncIterator[Any], Ctx], Awaitable[Any]]:
    async def behavior(requests: AsyncIterator[Any], context: Ctx) -> Any:
        started = time.perf_counter()
        try:
            service.tenant_of(context.invocation_metadata())  # an unknown token: refused at once
            stream = aiter(decoded(requests))
            first = await anext(stream, None)
            if first is None or isinstance(first, Chunk) or not first.HasField("header"):
                raise InvalidArgument("the first WriteBlocks message must be a header")
        except Exception as exc:
            return await _abort(context, service.outcomes.failure("WriteBlocks", exc, started))
        try:
            # the token is checked again by the tokens of the moment when the header arrives
            # and just before the commit: one a reload rotated or revoked meanwhile commits nothing
            write = await service.begin_write(first.header, _call(service, context))
            try:
                async for msg in stream:
                    if isinstance(msg, Chunk):  # read by hand (the guard): data is a view
                        c = msg
                    elif msg.HasField("chunk"):
                        c = msg.chunk
                    else:
                        raise InvalidArgument("only the first WriteBlocks message may be a "
                                              "header")
                    write.feed_chunk(c.index, c.offset, c.data)
                return write.finish()
            except Exception as exc:
                raise write.fail(exc) from None
            finally:
                write.abort()  # a call cancelled mid-payload: its slots freed (else a no-op)
        except Failed as failed:
            return await _abort(context, failed)
    return behavior


def _watch_events(service: Service) -> Callable[[Any, Ctx], AsyncIterator[Any]]:
    async def behavior(request: Any, context: Ctx) -> AsyncIterator[Any]:
        try:
            async for event, node_wide in service.events(request, _call(service, context)):
                yield _event(event, node_wide)
        except Failed as failed:
            await _abort(context, failed)
    return behavior


def _event(event: BlockEvent, node_wide: bool) -> pb.KvEvent:
    msg = pb.KvEvent(sequence=event.node_sequence if node_wide else event.sequence,
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
    return msg


def _open_session(service: Service) -> Callable[[Any, Ctx], AsyncIterator[Any]]:
    async def behavior(request: Any, context: Ctx) -> AsyncIterator[Any]:
        try:
            async for session in service.session(request, _call(service, context)):
                yield pb.SessionEvent(session_id=session)
        except Failed as failed:
            await _abort(context, failed)
    return behavior


_STREAMS = {"ReadBlocks": _read_blocks, "WriteBlocks": _write_blocks,
            "WatchEvents": _watch_events, "OpenSession": _open_session}


def add_servicer(service: Service, server: grpc.aio.Server, limits: Limits) -> None:
    """Registers a behaviour for every method of the table (see the module docstring)."""
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for m in METHODS:
        shape = SERVICE.methods_by_name[m.name]
        decode = deserializer(m.name, getattr(pb, m.request), limits.of(m.name))
        if m.name in _STREAMS:
            behavior: Any = _STREAMS[m.name](service)
        else:
            behavior = _unary(service, m)
        if shape.client_streaming and not shape.server_streaming:
            handlers[m.name] = grpc.stream_unary_rpc_method_handler(
                behavior, request_deserializer=decode, response_serializer=_serialize)
        elif shape.server_streaming and not shape.client_streaming:
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(
                behavior, request_deserializer=decode, response_serializer=_serialize)
        elif not shape.client_streaming:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(
                behavior, request_deserializer=decode, response_serializer=_serialize)
        else:  # pragma: no cover - the service has no bidirectional method
            raise AssertionError(f"unsupported method shape {m.name}")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))


class GrpcServer:
    """The daemon's gRPC server: `start` listens, `serving` / `draining` set the health status,
    `stop` ends it (see the module docstring)."""

    def __init__(self, service: Service, limits: Limits) -> None:
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", limits.largest),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ])
        self.health = HealthServicer()
        add_servicer(service, self.server, limits)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE.full_name, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )

    async def start(self, socket: Path, group: str, tcp: str = "",
                    tls: tuple[bytes, bytes] | None = None) -> None:
        """Listens on the Unix socket (0600, or 0660 of `group`) and on `tcp` when given
        (TLS with `tls` = (key, certificate) PEM); raises UsageError."""
        old_umask = os.umask(sharing.socket_umask(group))  # created 0600 (0660: group)
        try:
            self.server.add_insecure_port(f"unix:{socket}")
        except RuntimeError:
            raise UsageError(f"socket {socket}: cannot listen on it") from None
        finally:
            os.umask(old_umask)
        if tcp:
            if tls is not None:
                bound = self.server.add_secure_port(tcp, grpc.ssl_server_credentials([tls]))
            else:
                bound = self.server.add_insecure_port(tcp)
            if not bound:
                raise UsageError(f"cannot listen on tcp {tcp}")
        await self.server.start()
        sharing.share_socket(socket, group)

    async def serving(self) -> None:
        for name in ("", SERVICE.full_name):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def draining(self) -> None:
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float | None) -> None:
        await self.server.stop(grace)
