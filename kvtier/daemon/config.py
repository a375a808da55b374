"""Daemon configuration: embedded defaults < TOML file < environment (KVTIER_*) < flags.

Every setting is declared once, in `SETTINGS` (name, kind, default, doc, check): its TOML key is
the name, its environment variable KVTIER_ + the name in upper case, its flag --the-name (all
three generated, with `kvtier serve --help` and `--print-config`, from that declaration). Every
setting has a default that works on any machine, so `kvtier serve` needs no configuration;
`kvtier serve --help` lists each with its default (on this machine where it depends on it).
Sizes are read by `kvtier.core.units.parse_bytes`, the one size parser of kvtier.

The remote tier is off unless `remote_url` is set (docs/remote.md).

Write-back sizing. A write-back pins its DRAM slot until written; `writeback_queue_bytes` bounds
those slots, and a write-back that finds the queue full is dropped and counted (the load path
never waits). The default, a quarter of the pool up to 1 GiB, holds a long document at once
(8K tokens of an 8B model at 128 KiB/token is 1 GiB) without pinning most of the pool. The wear
budget is a token bucket: `ssd_write_bytes_per_day` refills it, `ssd_write_burst_bytes` is its
size. Default rate 1 DWPD *of the cache's cap*: a cache holding C bytes of a drive uses C bytes of
writes a day, its proportional share of a drive rated 1 DWPD (read-intensive datacenter NVMe);
since the default cap is at most a quarter of the free disk, that is <= 0.25 writes per day of
the whole drive, under the ~0.3 DWPD of consumer TLC drives (600 TBW per TB over 5 years). The
burst lets a few long documents through at once (defaults: 4 GiB on a 16 GiB cache); it never
exceeds one day's budget, so no 24 h window writes more than two days' budget and the long-run
average stays the rate.

The SSD size is kept. Its default follows the free disk, which the tier's own reservation then
shrinks, so a default recomputed at every start would resize the tier at every start. The daemon
writes the size it runs with to `<data_dir>/kept.toml` (`write_kept`); when no file, variable or
flag sets `ssd_bytes`, that kept size is the default (`--print-config` shows it, from
"kept.toml"). Another size takes an explicit setting, and is then kept in turn. A tier of size 0
(off) is never kept.

The TOML file is `--config PATH`, else $KVTIER_CONFIG, else the first kvtier.toml of the XDG config
directories (`kvtier.core.paths`: ~/.config/kvtier, then /etc/xdg/kvtier); its keys are the setting
names (top level, or under a `[serve]` table). Sizes accept integers or strings with a
binary/decimal unit ("4GiB", "512MB"), as `kvtier.core.units.parse_bytes` reads them everywhere
(an ambiguous "4G" or a bare number under 4096 is refused). Any bad value raises `UsageError`
naming the setting and where it came from (the flag, the variable, or the file). `to_toml`
writes a configuration back as a file `--config` reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import grp
import hashlib
import json
import os
import re
import shutil
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast

from kvtier.core.errors import UsageError
from kvtier.core.paths import CONFIG_FILE, SOCKET_NAME, config_dirs, runtime_dir
from kvtier.core.paths import data_dir as default_data_dir
from kvtier.core.suggest import closest
from kvtier.core.units import exact_size, parse_bytes
from kvtier.index.policies import DEFAULT_POLICY, POLICIES
from kvtier.tiers.blockfmt import HEADER_SIZE as BLOCK_HEADER_BYTES

if TYPE_CHECKING:
    from kvtier.daemon.cache.spec import CacheSpec

__all__ = ["SETTINGS", "Config", "Setting", "Trace", "env_var", "load", "load_traced",
           "parse_bytes", "to_toml"]

GiB = 1 << 30
KiB = 1 << 10
MiB = 1 << 20
LOG_LEVELS = ("debug", "info", "warning", "error")

Kind = Literal["size", "int", "float", "bool", "text"]
Check = Callable[[Any], "str | None"]
"""A check of one value (already of its kind): None when good, else why it is not."""


@dataclass(frozen=True, slots=True)
class Setting:
    """One daemon setting, declared once. TOML key `name`, variable `env_var(name)`, flag
    `flag`; `--help` says `doc` and `default_doc`; `secret` ones are never printed."""

    name: str
    kind: Kind
    default: object | Callable[[Mapping[str, str]], object]
    doc: str
    default_doc: str
    check: Check | None = None
    machine: bool = False  # the default depends on this machine: --help shows its value here
    secret: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def summary(self) -> str:
        """The head of `doc` (up to its first '(', ',', ';' or ': '): what a comment on the
        setting in a shipped config file begins with."""
        return re.split(r"\s*(?:\(|,|;|: )", self.doc, maxsplit=1)[0]

    def default_value(self, env: Mapping[str, str]) -> object:
        return self.default(env) if callable(self.default) else self.default


def _between(low: float, high: float, unit: str = "", low_open: bool = False) -> Check:
    def check(x: float) -> str | None:
        ok = (low < x if low_open else low <= x) and x <= high
        where = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        return None if ok else f"must be in {where}{unit}, got {x:g}"
    return check


def _at_least(low: int) -> Check:
    def check(x: int) -> str | None:
        return None if x >= low else f"must be >= {low}, got {x}"
    return check


def _one_of(names: Callable[[], Any], fold: bool = False) -> Check:
    def check(x: str) -> str | None:
        choices = sorted(names())
        ok = (x.lower() if fold else x) in choices
        return None if ok else f"must be one of {', '.join(choices)}, got {x!r}"
    return check


def _host_port(x: str) -> str | None:
    if not x:
        return None
    _, sep, port = x.rpartition(":")
    ok = sep and port.isdigit() and int(port) <= 65535
    return None if ok else f"expected HOST:PORT, got {x!r}"


def _page_multiple(x: int) -> str | None:
    return None if x >= 4096 and x % 4096 == 0 else f"must be a positive multiple of 4096, got {x}"


def _group(x: str) -> str | None:
    if not x:
        return None
    try:
        grp.getgrnam(x)
    except KeyError:
        return f"no group named {x!r} on this machine (create it, or leave group empty)"
    return None


def _zmq_endpoint(x: str) -> str | None:
    if not x:
        return None  # off
    if x.startswith("ipc://") and len(x) > len("ipc://"):
        return None
    host, sep, port = x.removeprefix("tcp://").rpartition(":")
    if x.startswith("tcp://") and host and sep and (
            port == "*" or (port.isdigit() and int(port) <= 65535)):
        return None
    return f"expected tcp://HOST:PORT or ipc://PATH, got {x!r}"


def _not_empty(x: str) -> str | None:
    return None if x else "must not be empty"


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_bytes(path: Path) -> int:
    """Free bytes of the filesystem that holds `path` (or would: its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


MIN_DEFAULT_SSD_BYTES = 64 * MiB
"""Below this a default SSD tier is off (0): its reservation (1.25 x its size + 64 MiB) would
take most of a small disk, or not fit at all."""


def default_ssd_bytes(data_dir: Path) -> int:
    """The first start's SSD size: a quarter of the free disk under `data_dir`, at most 16 GiB;
    0 (no SSD tier) when that is under `MIN_DEFAULT_SSD_BYTES` (a disk under 256 MiB free)."""
    size = min(free_bytes(data_dir) // 4, 16 * GiB)
    return size if size >= MIN_DEFAULT_SSD_BYTES else 0


def _data_dir(env: Mapping[str, str]) -> Path:
    return Path(env["KVTIER_DATA_DIR"]) if env.get("KVTIER_DATA_DIR") else default_data_dir(env)


def _default_dram(env: Mapping[str, str]) -> int:
    shm = Path("/dev/shm")
    shm_free = shutil.disk_usage(shm).free if shm.exists() else _ram_bytes()
    return min(_ram_bytes() // 8, shm_free // 2, 4 * GiB)


_S = Setting
SETTINGS: tuple[Setting, ...] = (
    _S("socket", "text", lambda env: str(runtime_dir(env) / SOCKET_NAME), "Unix socket path",
       "$XDG_RUNTIME_DIR/kvtier/kvtier.sock, else /tmp/kvtier-$UID/kvtier.sock", _not_empty),
    _S("group", "text", "", "group whose members may use the socket and the DRAM segment "
       "(both 0660)", "none: the daemon's user only (0600)"),  # checked on the merged value
    _S("tcp", "text", "", "also listen on HOST:PORT (TLS needed beyond loopback)", "off",
       _host_port),
    _S("tls_cert", "text", "", "PEM certificate for TCP", "none"),
    _S("tls_key", "text", "", "PEM private key for TCP", "none"),
    _S("dram_bytes", "size", _default_dram, "DRAM pool size, e.g. 4GiB",
       "min(RAM/8, free /dev/shm / 2, 4 GiB), whole slots", machine=True),
    _S("dram_prefault", "bool", False, "allocate the whole DRAM pool at start (its pages then "
       "count against the daemon's memory cgroup, and a full /dev/shm fails the start)",
       "false: pages are taken as blocks are written"),
    _S("keep_dram", "bool", False, "keep the DRAM tier across a restart: a stop leaves the "
       "pool to the next daemon on this socket, which re-adopts its blocks (with a tokens file "
       "the pool's memory must be held by systemd's fd store, else it starts cold)",
       "false: a stop frees the pool"),
    _S("slot_bytes", "size", 16 * KiB, "smallest DRAM slot: smaller blocks round up to it "
       "(not the largest block: see --max-block-bytes)", "16KiB", _page_multiple),
    _S("max_block_bytes", "size", 8 * MiB, "largest block a layout may have (every size up to "
       "it is served at once)", "8MiB"),
    _S("dram_page_bytes", "size", 0, "pages of the DRAM pool that size classes take",
       "0 = automatic"),
    _S("data_dir", "text", lambda env: str(_data_dir(env)), "directory of the SSD tier",
       "$XDG_DATA_HOME/kvtier, else ~/.local/share/kvtier", _not_empty),
    _S("ssd_bytes", "size", lambda env: default_ssd_bytes(_data_dir(env)),
       "SSD tier cap, e.g. 64GiB (0 = no SSD tier)",
       "the size kept in <data-dir>/kept.toml, else min(free disk / 4, 16 GiB), off below "
       "64 MiB", machine=True),
    _S("metrics", "text", "127.0.0.1:9464", "HOST:PORT of /metrics ('' = off, port 0 = any)",
       "127.0.0.1:9464", _host_port),
    _S("tokens_file", "text", "", "TOML file of tenants and tokens (example: deploy/tokens.toml)",
       "none: one tenant 'default', no authentication"),
    _S("lease_ttl_s", "float", 30.0, "default lease TTL in seconds", "30",
       _between(0, 86400, " seconds", low_open=True)),
    _S("max_lease_ttl_s", "float", 600.0, "largest lease TTL a client may ask for", "600",
       _between(0, 86400, " seconds", low_open=True)),
    _S("max_pin_ttl_s", "float", 86400.0, "longest pin an operator or a request's hint may "
       "ask for, in seconds", "86400", _between(0, 30 * 86400, " seconds", low_open=True)),
    _S("grace_s", "float", 10.0, "SIGTERM drain period in seconds", "10",
       _between(0, 86400, " seconds")),
    _S("max_pending_wait_s", "float", 10.0, "longest a Lookup may wait for blocks another "
       "client is still writing (a decode engine waiting for its prefill's stores)", "10",
       _between(0, 600, " seconds")),
    _S("max_blocks_per_request", "int", 4096, "largest key chain per request", "4096",
       _between(1, 1 << 20)),
    _S("ssd_admit_after", "int", 2, "write a block to SSD from its k-th access", "2",
       _at_least(1)),
    _S("policy", "text", DEFAULT_POLICY, "prefix-index eviction/admission policy (kvtier, lru, "
       "vllm-arc, ...; any case)", DEFAULT_POLICY, _one_of(lambda: POLICIES, fold=True)),
    _S("ssd_dwpd", "float", 1.0, "SSD writes per day in units of --ssd-bytes", "1.0",
       _between(0, 100, " drive writes per day", low_open=True)),
    _S("ssd_write_bytes_per_day", "size", 0, "SSD write budget, e.g. 500GiB",
       "0 = ssd-bytes x ssd-dwpd"),
    _S("ssd_write_burst_bytes", "size", 0, "SSD writes allowed at once before the daily rate "
       "applies", "0 = min(a day's budget, max(a quarter day's, 4 write-back queues))"),
    _S("writeback_queue_bytes", "size", 0, "DRAM held by queued write-backs",
       "0 = min(DRAM / 4, 1 GiB)"),
    _S("log_level", "text", "info", "log level: debug, info, warning or error", "info",
       _one_of(lambda: LOG_LEVELS, fold=True)),
    _S("kv_events", "text", "", "publish the node's tier changes as vLLM KV events on this ZMQ "
       "endpoint, e.g. tcp://127.0.0.1:5557 (no authentication: bind loopback or a trusted "
       "network; `*`, `::` or ipc:// binds, any other address is a collector's to connect to)",
       "off", _zmq_endpoint),
    _S("kv_events_replay", "text", "", "ZMQ endpoint answering replay requests (vLLM's "
       "replay_endpoint)", "off", _zmq_endpoint),
    _S("kv_events_topic", "text", "kvtier", "topic frame of the KV-event messages", "kvtier"),
    _S("kv_events_hwm", "int", 100_000, "messages queued per KV-event subscriber before they "
       "are dropped (counted; they stay replayable)", "100000", _at_least(1)),
    _S("remote_url", "text", "", "shared remote tier: redis://HOST:PORT/DB, rediss:// (TLS), "
       "valkey://, unix://PATH", "off"),
    _S("remote_mode", "text", "standalone", "standalone or cluster (Redis/Valkey cluster)",
       "standalone", _one_of(lambda: ("standalone", "cluster"), fold=True)),
    _S("remote_username", "text", "", "remote store ACL user (overrides the url's)", "none"),
    _S("remote_password", "text", "", "remote store password (prefer the env var or the TOML "
       "file)", "none", secret=True),
    _S("remote_tls_ca", "text", "", "PEM CA bundle to verify the remote store (rediss://)",
       "system CAs"),
    _S("remote_tls_cert", "text", "", "PEM client certificate for the remote store (mutual "
       "TLS)", "none"),
    _S("remote_tls_key", "text", "", "PEM client key for the remote store (mutual TLS)", "none"),
    _S("remote_timeout_s", "float", 0.25, "bounded wait per remote socket operation", "0.25",
       _between(0, 3600, " seconds", low_open=True)),
    _S("remote_write_bytes_per_s", "size", 0, "remote write-through rate per second, e.g. "
       "200MB", "0 = 200MB"),
    _S("remote_write_burst_bytes", "size", 0, "remote writes allowed at once before the rate "
       "applies", "0 = max(one second's rate, 16 slots)"),
    _S("remote_queue_bytes", "size", 0, "DRAM held by queued remote writes",
       "0 = min(DRAM / 8, 256 MiB)"),
    _S("remote_admit_after", "int", 1, "write a block to the remote store from its k-th access "
       "(1 = at Commit)", "1", _at_least(1)),
    _S("remote_prefix", "text", "kvtier", "remote store key prefix (keys: "
       "PREFIX:TENANT/ns2:LAYOUT:KEY)", "kvtier"),
)
BY_NAME = {s.name: s for s in SETTINGS}
SECRETS = frozenset(s.name for s in SETTINGS if s.secret)
"""Settings `to_toml` (`--print-config`) never prints."""
OTHER_VARIABLES = frozenset({
    "KVTIER_CONFIG",  # the config file (`load`)
    "KVTIER_TOKEN",  # clients: kvtier stats/top/demo's bearer token
    "KVTIER_TRANSFER_CALIBRATION", "KVTIER_KERNELS_DIR",  # engines' transfer engine, kernels
    "KVTIER_MEMORY_LIMIT_BYTES", "KVTIER_BIN", "KVTIER_PIP_ARGS",  # deploy/: image, install
    # the project's own scripts, tests and benchmarks (bin/, scripts/, tests/, bench/)
    "KVTIER_VENV", "KVTIER_SGLANG_VENV", "KVTIER_BENCH_VENV", "KVTIER_SGLANG_PYTHON",
    "KVTIER_SGLANG", "KVTIER_REQUIRE_ALL", "KVTIER_REQUIRE_PROMETHEUS", "KVTIER_REQUIRE_SGLANG",
    "KVTIER_REQUIRE_REDIS", "KVTIER_NESTED_PYTEST", "KVTIER_TRACES_DIR", "KVTIER_TRACE",
    "KVTIER_TEST_VLLM_LOG", "KVTIER_SGLANG_UNITS_DEBUG", "KVTIER_TORCH_INDEX",
    "KVTIER_TEST_WORKERS", "KVTIER_TEST_ENGINE_FORKS",
    "KVTIER_TEST_PARK",  # a test-only hook: the daemon parks every call of that method
})
"""`KVTIER_*` variables that are not settings but that kvtier, its deploy files or its own
scripts read: `load` refuses any other (a misspelt setting must not be silently ignored)."""
ZERO_DERIVES = frozenset({"writeback_queue_bytes", "ssd_write_bytes_per_day",
                          "ssd_write_burst_bytes", "remote_write_bytes_per_s",
                          "remote_write_burst_bytes", "remote_queue_bytes"})
"""Settings whose 0 (their default) means "derive from the others": `Config` holds the derived
value."""


@dataclass(frozen=True, slots=True)
class Config:
    """A validated daemon configuration, one field per `SETTINGS` entry (in that order). Build
    it with `load()`."""

    socket: Path
    group: str
    tcp: str
    tls_cert: str
    tls_key: str
    dram_bytes: int
    dram_prefault: bool
    keep_dram: bool
    slot_bytes: int
    max_block_bytes: int
    dram_page_bytes: int
    data_dir: Path
    ssd_bytes: int
    metrics: str
    tokens_file: str
    lease_ttl_s: float
    max_lease_ttl_s: float
    max_pin_ttl_s: float
    grace_s: float
    max_pending_wait_s: float
    max_blocks_per_request: int
    ssd_admit_after: int
    policy: str
    ssd_dwpd: float
    ssd_write_bytes_per_day: int
    ssd_write_burst_bytes: int
    writeback_queue_bytes: int
    log_level: str
    kv_events: str
    kv_events_replay: str
    kv_events_topic: str
    kv_events_hwm: int
    remote_url: str
    remote_mode: str
    remote_username: str
    remote_password: str
    remote_tls_ca: str
    remote_tls_cert: str
    remote_tls_key: str
    remote_timeout_s: float
    remote_write_bytes_per_s: int
    remote_write_burst_bytes: int
    remote_queue_bytes: int
    remote_admit_after: int
    remote_prefix: str

    @property
    def slots(self) -> int:
        return self.dram_bytes // self.slot_bytes

    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) of the /metrics endpoint, or None when disabled."""
        if not self.metrics:
            return None
        host, _, port = self.metrics.rpartition(":")
        return host or "127.0.0.1", int(port)


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
assert list(_FIELDS) == [s.name for s in SETTINGS], "Config and SETTINGS must list the same names"


def default_burst(bytes_per_day: int, queue_bytes: int, slot_bytes: int) -> int:
    """The wear bucket's size when not configured: a quarter day of budget, at least four full
    write-back queues, at most one day of budget, and never less than 16 slots (one block with
    its header must always fit)."""
    return max(min(bytes_per_day, max(bytes_per_day // 4, 4 * queue_bytes)), 16 * slot_bytes)


def defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """The embedded defaults, sized for this machine."""
    return {s.name: s.default_value(env) for s in SETTINGS}


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _boolean(value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise UsageError(f"{where}: expected true or false, got {value!r}")


def _coerce(name: str, value: object, origin: str) -> object:
    """`value` as its setting's kind, checked; a `UsageError` naming the setting and `origin`."""
    where = f"{name} (from {origin})"
    setting = BY_NAME[name]
    out: object
    if setting.kind == "size":
        out = parse_bytes(value, where)
    elif setting.kind == "bool":
        out = _boolean(value, where)
    elif setting.kind in ("int", "float"):
        number: int | float | None = None
        if isinstance(value, int | float | str) and not isinstance(value, bool):
            with contextlib.suppress(ValueError):
                number = int(value) if setting.kind == "int" else float(value)
        if number is None:
            raise UsageError(f"{where}: expected a number, got {value!r}")
        out = number
    elif not isinstance(value, str):
        raise UsageError(f"{where}: expected a string, got {value!r}")
    else:
        out = value
    why = setting.check(out) if setting.check else None
    if why:
        raise UsageError(f"{where}: {why}")
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {path}: {exc}") from None
    section = data.get("serve", data)
    if not isinstance(section, dict):
        raise UsageError(f"config file {path}: [serve] must be a table")
    return {k: v for k, v in section.items() if k != "serve"}


class Trace(NamedTuple):
    """Where a loaded configuration's values came from: `origin` per setting ("defaults" when
    nothing set it), and `given`, each set setting's value as given (before any derivation)."""

    origin: dict[str, str]
    given: dict[str, object]


def load(
    flags: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    config_path: str | None = None,
) -> Config:
    """Merges defaults < TOML < env < flags (flags whose value is None are unset) and validates."""
    return load_traced(flags, env, config_path)[0]


def load_traced(
    flags: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    config_path: str | None = None,
    check_group: bool = True,
) -> tuple[Config, Trace]:
    """`load`, and where each value came from (for `to_toml`). `check_group=False` accepts a
    group this machine lacks (a configuration printed here for another machine)."""
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    merged: dict[str, object] = dict(defaults(env))
    origin = dict.fromkeys(merged, "defaults")
    given: dict[str, object] = {}
    path = config_path or env.get("KVTIER_CONFIG")
    if not path:
        found = [d / CONFIG_FILE for d in config_dirs(env) if (d / CONFIG_FILE).is_file()]
        path = str(found[0]) if found else None
    if path:
        for key, value in _read_toml(Path(path)).items():
            _set(merged, origin, key, value, f"config file {path}")
    _refuse_unknown_variables(env)
    for key in _FIELDS:
        if env_var(key) in env:
            _set(merged, origin, key, env[env_var(key)], f"environment variable {env_var(key)}")
    for key, value in flags.items():
        _set(merged, origin, key, value, f"flag --{key.replace('_', '-')}")
    given.update((k, merged[k]) for k, where in origin.items() if where != "defaults")
    if origin["ssd_bytes"] == "defaults":  # sized for the data dir actually configured
        data = Path(str(merged["data_dir"])).expanduser()
        kept = read_kept(data)
        if kept is not None:
            merged["ssd_bytes"], origin["ssd_bytes"] = kept
        else:
            merged["ssd_bytes"] = default_ssd_bytes(data)
    return _validate(merged, origin, check_group), Trace(origin, given)


def _refuse_unknown_variables(env: Mapping[str, str]) -> None:
    """A `KVTIER_*` variable that is neither a setting's nor in `OTHER_VARIABLES` is a
    `UsageError` (a misspelt setting, silently ignored, would leave its default in force)."""
    known = {env_var(name) for name in _FIELDS} | OTHER_VARIABLES
    unknown = sorted(k for k in env if k.startswith("KVTIER_") and k not in known)
    if not unknown:
        return
    near = closest(unknown[0].removeprefix("KVTIER_").lower(), _FIELDS)
    hint = f"; did you mean {env_var(near)}?" if near else ""
    others = f" (and {', '.join(unknown[1:])})" if unknown[1:] else ""
    raise UsageError(f"unknown environment variable {unknown[0]}{others}{hint} (the settings' "
                     "variables are listed by kvtier serve --help; unset it)")


def env_var(setting: str) -> str:
    """The environment variable of a setting: KVTIER_ + its name in upper case."""
    return f"KVTIER_{setting.upper()}"


def _set(merged: dict[str, object], origin: dict[str, str], key: str, value: object,
         where: str) -> None:
    if key not in _FIELDS:
        near = closest(key, _FIELDS)
        hint = f"; did you mean {near!r}?" if near else ""
        raise UsageError(f"unknown setting {key!r} (from {where}){hint}")
    merged[key] = _coerce(key, value, where)
    origin[key] = where


KEPT_FILE = "kept.toml"


def read_kept(data_dir: Path) -> tuple[int, str] | None:
    """The SSD size kept in the data dir and where it came from, or None (none kept yet). A kept
    file that cannot be read is a UsageError naming it: resizing the tier silently is worse."""
    path = data_dir / KEPT_FILE
    if not path.exists():
        return None
    try:
        value = tomllib.loads(path.read_text()).get("ssd_bytes")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{path}: {exc} (remove it to size the SSD tier afresh)") from None
    where = f"{path}, kept from an earlier start"
    return parse_bytes(value, f"ssd_bytes (from {where})"), where


def write_kept(data_dir: Path, ssd_bytes: int) -> None:
    """Keeps the SSD size the daemon runs with (atomically); a size of 0 (no tier) is not kept."""
    if ssd_bytes <= 0:
        return
    path = data_dir / KEPT_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# The SSD tier's size, kept by `kvtier serve` so that it does not follow\n"
                   "# the free disk at every start. Set ssd_bytes explicitly to change it.\n"
                   f"ssd_bytes = {ssd_bytes}\n")
    os.replace(tmp, path)


def to_toml(cfg: Config, trace: Trace | None = None) -> str:
    """`cfg` as a TOML file that `load(config_path=...)` reads back into an equal Config here.

    With `trace` (`load_traced`), what was set (a flag, a variable, the file) is printed as set
    and a fixed default as it is, but a value derived on this machine (its sizes and paths, the
    SSD size kept in its data dir, a budget or queue derived from other settings) is printed
    commented out, marked "# derived: ...": the file then behaves the same on another machine.
    Without `trace` every value is printed."""
    lines = ["# kvtier serve configuration (kvtier serve --print-config); use with --config"]
    if trace is not None:
        lines.append("# Lines marked '# derived:' were worked out on this machine (from its "
                     "memory, disk, paths\n# or other settings) and are left to be worked out "
                     "again where this file is used.")
    for setting in SETTINGS:
        name = setting.name
        value = getattr(cfg, name)
        if value and setting.secret:
            lines.append(f"# {name} is set (not printed; give it again to use this file)")
            continue
        if trace is None:
            lines.append(f"{name} = {_toml_value(setting, value)}  # {setting.doc}")
            continue
        origin = trace.origin[name]
        given = trace.given.get(name)
        if name in ZERO_DERIVES and given == 0 and value != 0:
            lines.append(f"{name} = 0  # {setting.doc} (derived here: "
                         f"{_toml_value(setting, value)})")
        elif name in trace.given and not origin.endswith("kept from an earlier start"):
            lines.append(f"{name} = {_toml_value(setting, value)}  # {setting.doc}")
        elif callable(setting.default) or origin != "defaults" or (
                name in ZERO_DERIVES and value != 0):
            why = origin if origin != "defaults" else setting.default_doc
            lines.append(f"# {name} = {_toml_value(setting, value)}  # derived: {why}")
        else:
            lines.append(f"{name} = {_toml_value(setting, value)}  # {setting.doc}")
        if name == "group" and value and _group(str(value)):
            lines.append(f"# (no group {value!r} on this machine: kvtier serve refuses it here)")
    return "\n".join(lines) + "\n"


def _toml_value(setting: Setting, value: object) -> str:
    if setting.kind == "size":
        return json.dumps(exact_size(int(cast(int, value)))) if value else "0"
    if setting.kind == "bool":
        return "true" if value else "false"
    if setting.kind in ("int", "float"):
        return str(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def _validate(v: dict[str, object], origin: dict[str, str], check_group: bool = True) -> Config:
    def bad(name: str, why: str) -> UsageError:
        return UsageError(f"{name} (from {origin[name]}): {why}")

    def i(name: str) -> int:
        return int(cast(int, v[name]))

    def f(name: str) -> float:
        return float(cast(float, v[name]))

    slot = i("slot_bytes")
    dram = i("dram_bytes")
    if dram < slot:
        raise bad("dram_bytes", f"must hold at least one slot of {slot} bytes, got {dram}")
    dram -= dram % slot
    big = i("max_block_bytes")
    if big < slot:
        raise bad("max_block_bytes", f"must be at least slot_bytes ({slot}), got {big}")
    page = i("dram_page_bytes")
    if page and (page % 4096 or page < slot or page > dram):
        raise bad("dram_page_bytes", f"must be 0 (automatic) or a multiple of 4096 from "
                  f"slot_bytes ({slot}) to dram_bytes ({dram}), got {page}")
    if f("lease_ttl_s") > f("max_lease_ttl_s"):
        raise bad("lease_ttl_s", "must not exceed max_lease_ttl_s")
    queue = i("writeback_queue_bytes") or max(slot, min(dram // 4, GiB) // slot * slot)
    if not slot <= queue <= dram:
        raise bad("writeback_queue_bytes", f"must hold one slot ({slot} bytes) and fit the DRAM "
                  f"pool ({dram} bytes), got {queue}")
    per_day = i("ssd_write_bytes_per_day") or int(i("ssd_bytes") * f("ssd_dwpd"))
    burst = i("ssd_write_burst_bytes") or max(default_burst(per_day, queue, slot),
                                              min(big, dram) + BLOCK_HEADER_BYTES)
    if burst < slot + BLOCK_HEADER_BYTES:  # blocks above an explicit burst never reach SSD
        raise bad("ssd_write_burst_bytes", f"must hold one block ({slot} + "
                  f"{BLOCK_HEADER_BYTES} header bytes), got {burst}")
    tcp_host = str(v["tcp"]).rpartition(":")[0]
    loopback = tcp_host in ("127.0.0.1", "localhost", "::1", "[::1]")
    if v["tcp"] and not loopback and not (v["tls_cert"] and v["tls_key"]):
        raise bad("tcp", "listening beyond loopback needs tls_cert and tls_key")
    if bool(v["tls_cert"]) != bool(v["tls_key"]):
        raise bad("tls_cert", "tls_cert and tls_key go together")
    missing = _group(str(v["group"]))  # the final value only: a file's may be overridden
    if missing and check_group:
        raise bad("group", missing)
    if v["kv_events_replay"] and not v["kv_events"]:
        raise bad("kv_events_replay", "needs kv_events")
    pub = str(v["kv_events"])
    if pub and pub == v["kv_events_replay"] and "*" not in pub:
        raise bad("kv_events_replay", "must differ from kv_events")
    remote = _validate_remote(v, bad, slot, dram)
    return Config(
        socket=Path(str(v["socket"])).expanduser(),
        group=str(v["group"]),
        tcp=str(v["tcp"]),
        tls_cert=str(v["tls_cert"]),
        tls_key=str(v["tls_key"]),
        dram_bytes=dram,
        dram_prefault=bool(v["dram_prefault"]),
        keep_dram=bool(v["keep_dram"]),
        slot_bytes=slot,
        max_block_bytes=big,
        dram_page_bytes=page,
        data_dir=Path(str(v["data_dir"])).expanduser(),
        ssd_bytes=i("ssd_bytes"),
        metrics=str(v["metrics"]),
        tokens_file=str(v["tokens_file"]),
        lease_ttl_s=f("lease_ttl_s"),
        max_lease_ttl_s=f("max_lease_ttl_s"),
        max_pin_ttl_s=f("max_pin_ttl_s"),
        grace_s=f("grace_s"),
        max_pending_wait_s=f("max_pending_wait_s"),
        max_blocks_per_request=i("max_blocks_per_request"),
        ssd_admit_after=i("ssd_admit_after"),
        policy=str(v["policy"]).lower(),
        ssd_dwpd=f("ssd_dwpd"),
        ssd_write_bytes_per_day=per_day,
        ssd_write_burst_bytes=burst,
        writeback_queue_bytes=queue,
        log_level=str(v["log_level"]).lower(),
        kv_events=pub,
        kv_events_replay=str(v["kv_events_replay"]),
        kv_events_topic=str(v["kv_events_topic"]),
        kv_events_hwm=i("kv_events_hwm"),
        **remote,
    )


DEFAULT_REMOTE_WRITE_BYTES_PER_S = 200_000_000
"""`remote_write_bytes_per_s` when unset (0): the remote write-through rate of one node."""


def _validate_remote(
    v: dict[str, object], bad: Callable[[str, str], UsageError], slot: int, dram: int,
) -> dict[str, Any]:
    """The remote_* settings, validated (the URL and TLS combination by `RemoteSpec`)."""
    out: dict[str, Any] = {name: v[name] for name in _FIELDS if name.startswith("remote_")}
    out["remote_mode"] = str(v["remote_mode"]).lower()
    out["remote_timeout_s"] = float(cast(float, v["remote_timeout_s"]))
    rate = int(cast(int, v["remote_write_bytes_per_s"])) or DEFAULT_REMOTE_WRITE_BYTES_PER_S
    out["remote_write_bytes_per_s"] = rate
    burst = int(cast(int, v["remote_write_burst_bytes"])) or max(rate, 16 * slot)
    if burst < slot:
        raise bad("remote_write_burst_bytes", f"must hold one block ({slot} bytes), got {burst}")
    out["remote_write_burst_bytes"] = burst
    queue = int(cast(int, v["remote_queue_bytes"])) or max(
        slot, min(dram // 8, 256 * MiB) // slot * slot)
    if not slot <= queue <= dram:
        raise bad("remote_queue_bytes", f"must hold one slot ({slot} bytes) and fit the DRAM "
                  f"pool ({dram} bytes), got {queue}")
    out["remote_queue_bytes"] = queue
    if v["remote_url"]:
        from kvtier.tiers.remote import RemoteSpec

        try:
            RemoteSpec(**remote_spec_args(out))
        except UsageError as exc:
            name, _, why = str(exc).partition(": ")
            name = name.split(" ")[0]
            raise bad(name if name in _FIELDS else "remote_url", why or str(exc)) from None
    return out


def remote_spec_args(c: Mapping[str, Any]) -> dict[str, Any]:
    """`kvtier.tiers.remote.RemoteSpec` keyword arguments from the remote_* settings."""
    return {
        "url": str(c["remote_url"]), "cluster": c["remote_mode"] == "cluster",
        "username": str(c["remote_username"]), "password": str(c["remote_password"]),
        "tls_ca": str(c["remote_tls_ca"]), "tls_cert": str(c["remote_tls_cert"]),
        "tls_key": str(c["remote_tls_key"]), "timeout_s": float(c["remote_timeout_s"]),
        "prefix": str(c["remote_prefix"]),
    }


def cache_spec(cfg: Config, tenants: int = 0) -> CacheSpec:
    """What the cache is built from (`kvtier.daemon.cache.spec`): the pool named after the socket
    (one daemon per socket; with a tokens file of `tenants` tenants, its pages sized for their
    slices), the SSD store under the data dir (a slot file when every block is one size, else
    LMDB values), the remote tier when configured. (Imported here: `serve --help` and
    `--print-config` need none of the tiers' libraries.)"""
    from kvtier.daemon.cache.spec import (
        STORE_FINGERPRINT,
        CacheSpec,
        RemoteTier,
        RemoteTierSpec,
        SsdTier,
    )
    from kvtier.tiers.dram import DramSpec
    from kvtier.tiers.remote import RemoteSpec
    from kvtier.tiers.ssd.types import SsdSpec

    pool = DramSpec(
        name="kvtier-" + hashlib.sha256(str(cfg.socket).encode()).hexdigest()[:16],
        slot_size=cfg.slot_bytes, slot_count=cfg.slots, replace_stale=True,
        max_block=cfg.max_block_bytes, page_bytes=cfg.dram_page_bytes, group=cfg.group or None,
        prefault=cfg.dram_prefault, isolated=bool(cfg.tokens_file), tenants=tenants,
        keep=cfg.keep_dram,
    )
    ssd = None
    if cfg.ssd_bytes // (cfg.slot_bytes + BLOCK_HEADER_BYTES) > 0:
        ssd = SsdTier(
            SsdSpec(path=str(cfg.data_dir / "ssd"), capacity_bytes=cfg.ssd_bytes,
                    layout_fingerprint=STORE_FINGERPRINT,
                    **({"slot_size": cfg.slot_bytes} if cfg.slot_bytes == cfg.max_block_bytes
                       else {"payload": "lmdb"})),
            cfg.ssd_write_bytes_per_day, cfg.ssd_write_burst_bytes, cfg.writeback_queue_bytes,
        )
    remote = None
    if cfg.remote_url:
        remote = RemoteTier(
            RemoteSpec(**remote_spec_args({f: getattr(cfg, f) for f in cfg.__dataclass_fields__})),
            RemoteTierSpec(cfg.remote_queue_bytes, cfg.remote_write_bytes_per_s,
                           cfg.remote_write_burst_bytes),
            cfg.remote_admit_after, cfg.remote_mode,
        )
    return CacheSpec(pool, ssd, remote, cfg.policy, cfg.ssd_admit_after, cfg.lease_ttl_s,
                     cfg.max_lease_ttl_s, cfg.max_blocks_per_request, cfg.max_pin_ttl_s,
                     cfg.max_pending_wait_s)
