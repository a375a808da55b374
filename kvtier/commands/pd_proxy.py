"""`kvtier pd-proxy`: prefill on one vLLM server, decode on another, behind one endpoint
(`kvtier.integrations.vllm.pd_proxy`)."""

from __future__ import annotations

import argparse

HELP = "one OpenAI endpoint that prefills on kv_producer servers and decodes on kv_consumer ones"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill server (kv_producer), http://HOST:PORT; repeat for more")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode server (kv_consumer), http://HOST:PORT; repeat for more")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on "
                        "(default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any)")
    parser.add_argument("--timeout-s", type=float, default=600.0, metavar="S",
                        help="bound on each request to a server (default 600)")


def run(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from kvtier.core.errors import UsageError
    from kvtier.integrations.vllm.pd_proxy import health, serve

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {args.port}")
    if not args.timeout_s > 0:
        raise UsageError(f"--timeout-s must be > 0, got {args.timeout_s}")
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    try:
        proxy = serve(args.prefill, args.decode, args.host, args.port, args.timeout_s)
    except ValueError as exc:
        raise UsageError(f"--prefill/--decode: {exc}") from None
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
    log = logging.getLogger("kvtier.pd_proxy")
    for side, servers in health((proxy.prefill, proxy.decode), 2.0).items():
        for url, state in servers.items():
            if state != "ok":
                log.warning("%s server %s not ready yet: %s", side, url, state)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    print(f"kvtier pd-proxy on {proxy.url}: prefill {', '.join(proxy.prefill.urls)}; "
          f"decode {', '.join(proxy.decode.urls)}", flush=True)
    stop.wait()
    proxy.shutdown()
    proxy.server_close()
    return 0
