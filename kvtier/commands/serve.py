"""`kvtier serve`: run the daemon (no configuration needed; see kvtier.daemon.config for every
setting)."""

from __future__ import annotations

import argparse

HELP = "run the kvtier daemon (gRPC on a Unix socket, DRAM + SSD tiers, /metrics)"

_FLAGS = (
    ("--socket", "Unix socket path"),
    ("--tcp", "also listen on HOST:PORT (TLS needed beyond loopback)"),
    ("--tls-cert", "PEM certificate for TCP"),
    ("--tls-key", "PEM private key for TCP"),
    ("--dram-bytes", "DRAM pool size, e.g. 4GiB"),
    ("--slot-bytes", "DRAM slot size (largest block), e.g. 2MiB"),
    ("--data-dir", "directory of the SSD tier"),
    ("--ssd-bytes", "SSD tier cap, e.g. 64GiB (0 = no SSD tier)"),
    ("--metrics", "HOST:PORT of /metrics ('' = off, port 0 = any)"),
    ("--tokens-file", "TOML file of tenants and tokens (see kvtier.daemon.auth)"),
    ("--lease-ttl-s", "default lease TTL in seconds"),
    ("--max-lease-ttl-s", "largest lease TTL a client may ask for"),
    ("--grace-s", "SIGTERM drain period in seconds"),
    ("--max-blocks-per-request", "largest key chain per request"),
    ("--ssd-admit-after", "write a block to SSD from its k-th access"),
    ("--policy", "prefix-index eviction/admission policy (lru, kvtier, vllm-arc, ...)"),
    ("--ssd-dwpd", "SSD writes per day in units of --ssd-bytes (default 1.0)"),
    ("--ssd-write-bytes-per-day", "SSD write budget, e.g. 500GiB (default ssd-bytes x dwpd)"),
    ("--ssd-write-burst-bytes", "SSD writes allowed at once before the daily rate applies"),
    ("--writeback-queue-bytes", "DRAM held by queued write-backs (default min(DRAM/4, 1GiB))"),
    ("--log-level", "debug, info, warning or error"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="PATH",
        help="TOML config file (default $KVTIER_CONFIG, else ~/.config/kvtier/kvtier.toml)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the merged configuration and exit"
    )
    for flag, text in _FLAGS:
        parser.add_argument(flag, metavar="VALUE", help=text)


def run(args: argparse.Namespace) -> int:
    from kvtier.daemon import config
    flags = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
             for flag, _ in _FLAGS}
    cfg = config.load(flags, config_path=args.config)
    if args.print_config:
        for field in cfg.__dataclass_fields__:
            print(f"{field} = {getattr(cfg, field)!s}")
        return 0
    from kvtier.daemon.server import serve

    return serve(cfg)
