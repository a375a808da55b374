"""An operator's connection to a daemon: evict, clear, pin, unpin, list pins, prefetch.

    from kvtier.client.control import Control
    with Control(token=admin_token) as ops:                # default socket, as `kvtier serve`
        ops.evict(model_id="my-org/my-model@rev1", all_tenants=True)   # bad weights: gone
        ops.pin(keys, ttl_s=600, model_id="my-org/my-model@rev1")      # keep a prefix 10 min
        ops.prefetch(keys, model_id="my-org/my-model@rev1")            # SSD/remote -> DRAM
        ops.clear(tenant="alice")                                      # one tenant's blocks

What each call means is the daemon's (`kvtier.v1.KvTier` Evict, Pin, Unpin, ListPins, Prefetch;
docs/operations.md): a tenant's token acts on its own namespaces, `tenant=` another's and
`all_tenants=True` need an admin token; namespaces are narrowed by `model_id` and `layout_id`;
`keys` are block keys (`kvtier.core.keys.block_keys` of a prompt's token ids, the engine's
block hashes), all of one width. Replies are the protocol's messages (`kvtier._proto`), errors
`KvtierRpcError` with the daemon's status code. Unlike `Client`, no layout is registered: a
`Control` names what it acts on. Thread-safe (gRPC channels are).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier.client.sync_client import default_socket, require_daemon, rpc_error


def packed(keys: Sequence[bytes]) -> tuple[bytes, int]:
    """Keys as one packed field and their width (all of one width: 16 or 32 bytes)."""
    if not keys:
        return b"", 0
    width = len(keys[0])
    if width not in (16, 32) or any(len(k) != width for k in keys):
        raise ValueError("block keys are all 16 or all 32 bytes")
    return b"".join(keys), width


def selector(model_id: str = "", layout_id: bytes = b"", tenant: str = "",
             all_tenants: bool = False) -> pb.Selector:
    return pb.Selector(tenant=tenant, all_tenants=all_tenants, model_id=model_id,
                       layout=layout_id)


class Control:
    """See the module docstring. `timeout`: seconds per call (an evict that deletes a
    namespace from a large remote store scans it: give it time)."""

    def __init__(self, socket: str | Path | None = None, *, target: str | None = None,
                 token: str | None = None, timeout: float = 60.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.target = target or f"unix:{Path(socket) if socket else default_socket()}"
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        require_daemon(self.target)
        self._channel = (grpc.secure_channel(self.target, credentials) if credentials
                         else grpc.insecure_channel(self.target))
        self._stub = pb_grpc.KvTierStub(self._channel)  # type: ignore[no-untyped-call]

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise rpc_error(exc, self.target) from None

    def evict(self, keys: Sequence[bytes] = (), *, model_id: str = "", layout_id: bytes = b"",
              tenant: str = "", all_tenants: bool = False,
              local_only: bool = False) -> pb.EvictResponse:
        """Removes blocks from DRAM, SSD and (unless `local_only`) the remote store: with
        `keys`, each key's block and every block under it; without, every block of the
        namespaces of `model_id` / `layout_id`."""
        data, width = packed(keys)
        reply: pb.EvictResponse = self._call(self._stub.Evict, pb.EvictRequest(
            scope=selector(model_id, layout_id, tenant, all_tenants), keys=data,
            key_width=width, local_only=local_only))
        return reply

    def clear(self, *, tenant: str = "", all_tenants: bool = False,
              local_only: bool = False) -> pb.EvictResponse:
        """Removes every block of the caller's tenant (`tenant`: another's, `all_tenants`:
        everything; both need an admin token)."""
        reply: pb.EvictResponse = self._call(self._stub.Evict, pb.EvictRequest(
            scope=selector(tenant=tenant, all_tenants=all_tenants), clear=True,
            local_only=local_only))
        return reply

    def pin(self, keys: Sequence[bytes], ttl_s: float, *, model_id: str = "",
            layout_id: bytes = b"", tenant: str = "") -> pb.PinResponse:
        """Pins the cached prefix of the chain `keys` for `ttl_s` seconds."""
        data, width = packed(keys)
        reply: pb.PinResponse = self._call(self._stub.Pin, pb.PinRequest(
            scope=selector(model_id, layout_id, tenant), keys=data, key_width=width,
            ttl_seconds=ttl_s))
        return reply

    def unpin(self, keys: Sequence[bytes] = (), *, model_id: str = "", layout_id: bytes = b"",
              tenant: str = "", all_tenants: bool = False) -> int:
        """Ends the pins of `keys` (none given: every pin in scope); how many ended."""
        data, width = packed(keys)
        reply: pb.UnpinResponse = self._call(self._stub.Unpin, pb.UnpinRequest(
            scope=selector(model_id, layout_id, tenant, all_tenants), keys=data,
            key_width=width))
        return int(reply.unpinned)

    def pins(self, *, model_id: str = "", layout_id: bytes = b"", tenant: str = "",
             all_tenants: bool = False) -> list[pb.PinnedNamespace]:
        reply: pb.ListPinsResponse = self._call(self._stub.ListPins, pb.ListPinsRequest(
            scope=selector(model_id, layout_id, tenant, all_tenants)))
        return list(reply.namespaces)

    def prefetch(self, keys: Sequence[bytes], *, model_id: str = "", layout_id: bytes = b"",
                 tenant: str = "") -> pb.PrefetchResponse:
        """Brings the cached prefix of the chain `keys` into DRAM."""
        data, width = packed(keys)
        reply: pb.PrefetchResponse = self._call(self._stub.Prefetch, pb.PrefetchRequest(
            scope=selector(model_id, layout_id, tenant), keys=data, key_width=width))
        return reply

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
