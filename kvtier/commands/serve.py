"""`kvtier serve`: run the daemon (no configuration needed; see kvtier.daemon.config for every
setting)."""

from __future__ import annotations

import argparse
import os

HELP = "run the kvtier daemon (gRPC on a Unix socket, DRAM + SSD tiers, /metrics)"

# flag, what it sets, its default (how it is chosen; the value on this machine is appended)
_FLAGS = (
    ("--socket", "Unix socket path", "$XDG_RUNTIME_DIR/kvtier/kvtier.sock, else /tmp/kvtier-$UID"),
    ("--tcp", "also listen on HOST:PORT (TLS needed beyond loopback)", "off"),
    ("--tls-cert", "PEM certificate for TCP", "none"),
    ("--tls-key", "PEM private key for TCP", "none"),
    ("--dram-bytes", "DRAM pool size, e.g. 4GiB", "min(RAM/8, free /dev/shm / 2, 4 GiB)"),
    ("--slot-bytes", "smallest DRAM slot (smaller blocks round up to it), e.g. 64KiB", "16 KiB"),
    ("--max-block-bytes", "largest block a layout may have (every size up to it is served)",
     "8 MiB"),
    ("--dram-page-bytes", "pages of the DRAM pool that size classes take", "automatic"),
    ("--data-dir", "directory of the SSD tier",
     "$XDG_DATA_HOME/kvtier, else ~/.local/share/kvtier"),
    ("--ssd-bytes", "SSD tier cap, e.g. 64GiB (0 = no SSD tier)",
     "the size kept in <data-dir>/kept.toml, else min(free disk / 4, 16 GiB)"),
    ("--metrics", "HOST:PORT of /metrics ('' = off, port 0 = any)", "127.0.0.1:9464"),
    ("--tokens-file", "TOML file of tenants and tokens (see kvtier.daemon.auth)",
     "none: one tenant 'default', no authentication"),
    ("--lease-ttl-s", "default lease TTL in seconds", "30"),
    ("--max-lease-ttl-s", "largest lease TTL a client may ask for", "600"),
    ("--grace-s", "SIGTERM drain period in seconds", "10"),
    ("--max-blocks-per-request", "largest key chain per request", "4096"),
    ("--ssd-admit-after", "write a block to SSD from its k-th access", "2"),
    ("--policy", "prefix-index eviction/admission policy (kvtier, lru, vllm-arc, ...)", "kvtier"),
    ("--ssd-dwpd", "SSD writes per day in units of --ssd-bytes", "1.0"),
    ("--ssd-write-bytes-per-day", "SSD write budget, e.g. 500GiB", "ssd-bytes x ssd-dwpd"),
    ("--ssd-write-burst-bytes", "SSD writes allowed at once before the daily rate applies",
     "min(a day's budget, max(a quarter day's, 4 write-back queues))"),
    ("--writeback-queue-bytes", "DRAM held by queued write-backs", "min(DRAM / 4, 1 GiB)"),
    ("--log-level", "debug, info, warning or error", "info"),
    ("--kv-events", "publish the node's tier changes as vLLM KV events on this ZMQ endpoint, "
     "e.g. tcp://127.0.0.1:5557", "off"),
    ("--kv-events-replay", "ZMQ endpoint answering replay requests (vLLM's replay_endpoint)",
     "off"),
    ("--kv-events-topic", "topic frame of the KV-event messages", "kvtier"),
    ("--kv-events-hwm", "messages queued per KV-event subscriber before they are dropped",
     "100000"),
    ("--remote-url", "shared remote tier: redis://HOST:PORT/DB, rediss:// (TLS), valkey://",
     "off"),
    ("--remote-mode", "standalone or cluster (Redis/Valkey cluster)", "standalone"),
    ("--remote-username", "remote store ACL user", "none"),
    ("--remote-password", "remote store password (prefer the env var or the TOML file)", "none"),
    ("--remote-tls-ca", "PEM CA bundle to verify the remote store (rediss://)", "system CAs"),
    ("--remote-tls-cert", "PEM client certificate for the remote store (mutual TLS)", "none"),
    ("--remote-tls-key", "PEM client key for the remote store (mutual TLS)", "none"),
    ("--remote-timeout-s", "bounded wait per remote socket operation", "0.25"),
    ("--remote-write-bytes-per-s", "remote write-through rate per second, e.g. 200MB",
     "200 MB"),
    ("--remote-write-burst-bytes", "remote writes allowed at once before the rate applies",
     "one second's rate"),
    ("--remote-queue-bytes", "DRAM held by queued remote writes", "min(DRAM / 8, 256 MiB)"),
    ("--remote-admit-after", "write a block to the remote store from its k-th access", "1"),
    ("--remote-prefix", "remote store key prefix", "kvtier"),
)
_MACHINE_SIZED = ("dram_bytes", "ssd_bytes")  # defaults that depend on this machine


def _setting(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtier.core.units import format_bytes
    from kvtier.daemon.config import defaults, env_var

    here = defaults(os.environ)
    parser.add_argument(
        "--config", metavar="PATH",
        help="TOML config file (default: $KVTIER_CONFIG, else the first kvtier.toml in "
             "$XDG_CONFIG_HOME/kvtier (~/.config/kvtier), then $XDG_CONFIG_DIRS/kvtier "
             "(/etc/xdg/kvtier); none: embedded defaults)",
    )
    parser.add_argument(
        "--print-config", action="store_true",
        help="print the merged configuration as TOML (a file --config reads) and exit "
             "(default: off)",
    )
    for flag, text, default in _FLAGS:
        name = _setting(flag)
        if name in _MACHINE_SIZED:
            default += f"; {format_bytes(int(here[name]))} here"
        parser.add_argument(flag, metavar="VALUE",
                            help=f"{text} (default: {default}; env {env_var(name)})")


def run(args: argparse.Namespace) -> int:
    from kvtier.daemon import config

    flags = {_setting(flag): getattr(args, _setting(flag)) for flag, _, _ in _FLAGS}
    cfg = config.load(flags, config_path=args.config)
    if args.print_config:
        print(config.to_toml(cfg), end="")
        return 0
    from kvtier.daemon.server import serve

    return serve(cfg)
