"""What every call shares whatever its transport: who makes it (`Call`), how an error answers
(`Outcomes.failure`: a domain error's gRPC status code, an internal error logged), and the
per-method metrics (`kvtier_rpcs_total{method,code}`, `kvtier_rpc_duration_seconds`).

    InvalidArgument → INVALID_ARGUMENT     NotFound → NOT_FOUND
    PermissionDenied → PERMISSION_DENIED   ResourceExhausted → RESOURCE_EXHAUSTED
    FailedPrecondition → FAILED_PRECONDITION   Unauthenticated → UNAUTHENTICATED
    Unavailable → UNAVAILABLE              a request the guard refused → its own code
    anything else → INTERNAL (a bug: logged with its traceback)

A refused request changes nothing; every call, answered or refused, is counted once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import grpc

from kvtier.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvtier.daemon.cache.namespaces import Tenant
from kvtier.daemon.metrics import DaemonMetrics
from kvtier.daemon.rpc.guard import RefusedError

log = logging.getLogger(__name__)

_CODES: dict[type[Exception], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}


class Call(NamedTuple):
    """Who makes a call: `tenant()` authenticates the caller when the handler runs (raises
    `Unauthenticated`); `session`: its `kvtier-session` (gRPC metadata, or the local socket's
    frame), "" without one."""

    tenant: Callable[[], Tenant]
    session: str = ""


class Failed(Exception):
    """A call answered with a gRPC status other than OK (already recorded in the metrics)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Outcomes:
    """Records each call's outcome in the metrics."""

    def __init__(self, metrics: DaemonMetrics) -> None:
        self.metrics = metrics

    def record(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self.metrics.rpcs.labels(method, code.name).inc()
        self.metrics.rpc_seconds.labels(method).observe(time.perf_counter() - started)

    def failure(self, method: str, exc: Exception, started: float) -> Failed:
        """Records a refusal (a domain error, a refused request) or an internal error (a bug:
        logged); the `Failed` that answers it."""
        code = next((c for t, c in _CODES.items() if isinstance(exc, t)), None)
        if isinstance(exc, RefusedError):
            code = exc.refused.code
        if code is None:
            log.error("%s failed", method, exc_info=exc)
            code, message = grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})"
        else:
            message = str(exc)
        self.record(method, code, started)
        return Failed(code, message)

    def cancelled(self, method: str, started: float,
                  message: str = "the client went away mid-payload") -> Failed:
        self.record(method, grpc.StatusCode.CANCELLED, started)
        return Failed(grpc.StatusCode.CANCELLED, message)
