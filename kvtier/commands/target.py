"""Which daemon a reporting command (`kvtier stats`, `kvtier top`) talks to: its Unix socket
(default: `kvtier serve`'s default socket) or its TCP address (`--tcp HOST:PORT`, the name
`kvtier serve --tcp` listens on; TLS when `--tls-ca` names the CA that signed the daemon's
`tls_cert`). Nothing listening is the one line every client prints: "no kvtier daemon at ...".
"""

from __future__ import annotations

import argparse
import os
import socket as _socket
from typing import Any, NamedTuple

from kvtier.core.errors import UsageError


class Target(NamedTuple):
    """A daemon's gRPC target ("unix:PATH" or "HOST:PORT"), how to print it, and its TLS CA."""

    grpc: str
    where: str
    tls_ca: str | None = None

    @property
    def tcp(self) -> bool:
        return not self.grpc.startswith("unix:")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH",
                       help="daemon socket (default $KVTIER_SOCKET, else the runtime dir)")
    where.add_argument("--tcp", metavar="HOST:PORT",
                       help="daemon TCP address (kvtier serve --tcp)")
    parser.add_argument("--tls-ca", metavar="PEM",
                        help="with --tcp: CA certificate of the daemon's tls_cert (TLS)")
    parser.add_argument("--token", metavar="TOKEN", help="bearer token (else $KVTIER_TOKEN)")


def parse(text: str, tls_ca: str | None = None) -> Target:
    """A target from a socket path, `unix:PATH`, `HOST:PORT` or `tcp://HOST:PORT`."""
    if text.startswith("tcp://") or (":" in text and "/" not in text
                                     and not text.startswith("unix:")):
        address = text.removeprefix("tcp://")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"{text}: expected HOST:PORT")
        return Target(address, address, tls_ca)
    if tls_ca:
        raise UsageError("--tls-ca goes with a TCP daemon (--tcp HOST:PORT)")
    path = text.removeprefix("unix:")
    return Target(f"unix:{path}", path)


def from_args(args: argparse.Namespace) -> Target:
    from kvtier.client.sync_client import default_socket

    if args.tcp:
        return parse("tcp://" + args.tcp, args.tls_ca)
    return parse(f"unix:{args.socket or default_socket()}", args.tls_ca)


def token(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    value = args.token or os.environ.get("KVTIER_TOKEN")
    return (("authorization", f"Bearer {value}"),) if value else ()


def probe(target: Target, timeout: float = 1.0) -> None:
    """Raises the one-line "no kvtier daemon at ..." `UsageError` when nothing listens there."""
    from kvtier.client.sync_client import no_daemon

    try:
        if target.tcp:
            host, _, port = target.grpc.rpartition(":")
            _socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        else:
            s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            s.settimeout(timeout)
            try:
                s.connect(target.grpc.removeprefix("unix:"))
            finally:
                s.close()
    except OSError:
        raise UsageError(no_daemon(target.where).details) from None


def channel(target: Target) -> Any:
    """A gRPC channel to the target (TLS with its CA when it has one)."""
    import grpc

    if target.tls_ca:
        try:
            with open(target.tls_ca, "rb") as f:
                ca = f.read()
        except OSError as exc:
            raise UsageError(f"--tls-ca {target.tls_ca}: {exc.strerror or exc}") from None
        return grpc.secure_channel(target.grpc, grpc.ssl_channel_credentials(ca))
    return grpc.insecure_channel(target.grpc)
