"""`kvtier serve`: run the daemon (no configuration needed). Its flags, their help and their
variables are generated from the settings' one declaration, `kvtier.daemon.config.SETTINGS`."""

from __future__ import annotations

import argparse
import os

HELP = "run the kvtier daemon (gRPC on a Unix socket, DRAM + SSD tiers, /metrics)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvtier.core.units import exact_size
    from kvtier.daemon.config import SETTINGS, defaults, env_var

    here = defaults(os.environ)
    parser.add_argument(
        "--config", metavar="PATH",
        help="TOML config file (default: $KVTIER_CONFIG, else the first kvtier.toml in "
             "$XDG_CONFIG_HOME/kvtier (~/.config/kvtier), then $XDG_CONFIG_DIRS/kvtier "
             "(/etc/xdg/kvtier); none: embedded defaults)",
    )
    parser.add_argument(
        "--print-config", action="store_true",
        help="print the merged configuration as TOML (a file --config reads) and exit: what "
             "was set, and fixed defaults; values derived on this machine commented out "
             "(default: off)",
    )
    kept = _kept_here(str(here["data_dir"]))
    for s in SETTINGS:
        default = s.default_doc
        if s.name == "ssd_bytes" and kept is not None:
            default += f"; {exact_size(kept[0])} here (kept in {kept[1]})"
        elif s.machine:
            default += f"; {exact_size(int(here[s.name]))} here"
        metavar = {"size": "SIZE", "int": "N", "float": "X", "bool": "BOOL"}.get(s.kind, "VALUE")
        parser.add_argument(s.flag, dest=s.name, metavar=metavar,
                            help=f"{s.doc} (default: {default}; env {env_var(s.name)})")


def _kept_here(data_dir: str) -> tuple[int, str] | None:
    """The SSD size kept in this machine's default data dir and the file's path (None: none,
    or one that cannot be read: `serve` itself then says why)."""
    from pathlib import Path

    from kvtier.core.errors import UsageError
    from kvtier.daemon.config import KEPT_FILE, read_kept

    where = Path(data_dir).expanduser()
    try:
        kept = read_kept(where)
    except UsageError:
        return None
    return None if kept is None else (kept[0], str(where / KEPT_FILE))


def run(args: argparse.Namespace) -> int:
    from kvtier.daemon import config

    flags = {s.name: getattr(args, s.name) for s in config.SETTINGS}
    if args.print_config:  # for this machine or another: a group only that one has is fine
        cfg, trace = config.load_traced(flags, config_path=args.config, check_group=False)
        print(config.to_toml(cfg, trace), end="")
        return 0
    cfg = config.load(flags, config_path=args.config)
    from kvtier.daemon.reload import ConfigSource
    from kvtier.daemon.server import serve

    return serve(cfg, ConfigSource(flags, args.config))  # SIGHUP loads from the same sources
