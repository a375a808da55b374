"""`kvtier top`: a live terminal view of one or more daemons (what it shows: `top_view`)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

from kvtier.commands.top_view import Row, Sample

HELP = "live view of daemons: hit ratio and trend, tier fill, traffic, leases, planner, MRC"

_EPILOG = """\
sources: a daemon socket path or a TCP address HOST:PORT (kvtier serve --tcp; TLS with
--tls-ca) for the Stats RPC (no traffic or planner counters), or its metrics URL
(http://127.0.0.1:9464, everything); default: $KVTIER_SOCKET, else the runtime dir's socket.

examples:
  kvtier top                                    # the local daemon, refreshed every 2 s
  kvtier top http://node1:9464 http://node2:9464
  kvtier top 10.0.0.5:7443 --tls-ca ca.pem      # a daemon's TCP port
  kvtier top --once --json /run/kvtier/kvtier.sock
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("sources", nargs="*", metavar="SOURCE",
                        help="daemon socket paths, TCP addresses HOST:PORT or metrics URLs")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S",
                        help="seconds between readings (default 2)")
    parser.add_argument("--once", action="store_true",
                        help="take two readings --interval apart, print once and exit")
    parser.add_argument("--json", action="store_true", help="with --once semantics, as JSON")
    parser.add_argument("--token", metavar="TOKEN", help="bearer token for sockets and TCP "
                        "(else $KVTIER_TOKEN)")
    parser.add_argument("--tls-ca", metavar="PEM",
                        help="CA certificate of TCP daemons' tls_cert (TLS)")
    parser.add_argument("--timeout", type=float, default=2.0, metavar="S",
                        help="per-reading timeout (default 2)")


def _reader(source: str, token: str | None, timeout: float,
            tls_ca: str | None) -> Callable[[], Sample]:
    from kvtier.commands import top_view

    if source.startswith(("http://", "https://")):
        import urllib.error
        import urllib.parse
        import urllib.request

        url = source if urllib.parse.urlsplit(source).path not in ("", "/") else (
            source.rstrip("/") + "/metrics")

        def read_url() -> Sample:
            t = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    text = r.read().decode()
                return top_view.from_metrics(source, t, text)
            except urllib.error.HTTPError as exc:  # the endpoint answered, with an error
                return top_view.down(source, t, f"HTTP {exc.code}: {exc.reason}", True)
            except (OSError, ValueError) as exc:
                return top_view.down(source, t, str(exc))

        return read_url

    import grpc

    from kvtier._proto import kvtier_pb2 as pb
    from kvtier._proto import kvtier_pb2_grpc as pb_grpc
    from kvtier.commands import target

    where = target.parse(source, tls_ca)
    channel = target.channel(where)
    stub = pb_grpc.KvTierStub(channel)  # type: ignore[no-untyped-call]
    metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def read_socket() -> Sample:
        t = time.monotonic()
        try:
            s = stub.Stats(pb.StatsRequest(), timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            why = f"{code.name}: {exc.details()}"
            if code is grpc.StatusCode.UNAUTHENTICATED:
                why += " (give --token TOKEN or $KVTIER_TOKEN)"
            unreached = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            return top_view.down(source, t, why, answered=not unreached)
        return top_view.from_stats(source, t, s)

    return read_socket


def _where(source: str) -> str:
    """A source as the "no kvtier daemon at ..." line names it."""
    return source.removeprefix("unix:").removeprefix("tcp://")


def run(args: argparse.Namespace) -> int:
    from kvtier.client.sync_client import default_socket
    from kvtier.commands import top_view
    from kvtier.core.errors import UsageError

    if not args.interval > 0:
        raise UsageError(f"--interval must be > 0, got {args.interval}")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout}")
    sources = args.sources or [str(default_socket())]
    for s in sources:
        if "://" in s and not s.startswith(("http://", "https://", "tcp://")):
            raise UsageError(f"{s}: a source is a socket path, HOST:PORT or an http(s):// "
                             "metrics URL")
    token = args.token or os.environ.get("KVTIER_TOKEN")
    readers = [_reader(s, token, args.timeout, args.tls_ca) for s in sources]
    prev: list[Sample | None] = [None] * len(readers)
    trends: list[list[float]] = [[] for _ in readers]

    def tick() -> list[Row]:
        rows = []
        for i, read in enumerate(readers):
            cur = read()
            r = top_view.row(prev[i], cur, trends[i])
            trends[i] = r.trend
            prev[i] = cur
            rows.append(r)
        return rows

    first = tick()
    if not any(r.ok for r in first):  # nothing answers: one line, as `kvtier stats` says it
        from kvtier.client.sync_client import no_daemon

        refused = [s for s in prev if s is not None and s.answered]
        if refused:  # a daemon is there and said no: say what it said
            raise UsageError("; ".join(f"{_where(s.source)}: {s.error}" for s in refused))
        if len(sources) == 1:
            raise UsageError(no_daemon(_where(sources[0])).details)
        raise UsageError(f"no kvtier daemon answers at any of {', '.join(sources)} "
                         "(start one: kvtier serve)")
    if args.once or args.json:
        time.sleep(args.interval)
        rows = tick()
        if args.json:
            print(json.dumps(top_view.to_json(rows), indent=2))
        else:
            from rich.console import Console

            console = Console()
            console.print(top_view.render(rows, args.interval, console.width))
        return 0 if any(r.ok for r in rows) else 1

    from rich.console import Console
    from rich.live import Live

    console = Console()
    try:
        with Live(top_view.render(first, args.interval, console.width), auto_refresh=False,
                  screen=False, console=console) as live:
            while True:
                time.sleep(args.interval)
                live.update(top_view.render(tick(), args.interval, console.width),
                            refresh=True)
    except KeyboardInterrupt:
        return 0
