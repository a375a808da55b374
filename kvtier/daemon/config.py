"""Daemon configuration: embedded defaults < TOML file < environment (KVTIER_*) < flags.

Every setting has a default that works on any machine, so `kvtier serve` needs no configuration.
Environment variable = KVTIER_ + the setting name in upper case (KVTIER_DRAM_BYTES, ...).

    socket                 $XDG_RUNTIME_DIR/kvtier/kvtier.sock, else /tmp/kvtier-$UID/kvtier.sock
    tcp                    "" (off); "HOST:PORT" listens on TCP as well
    tls_cert, tls_key      PEM paths; required for TCP beyond loopback
    dram_bytes             min(RAM / 8, free /dev/shm / 2, 4 GiB), rounded down to whole slots
    slot_bytes             16 KiB: the smallest DRAM slot (smaller blocks are rounded up to it)
    max_block_bytes        8 MiB: the largest block a layout may have; one daemon serves every
                           block size from 1 B to this at once (size classes on pages of the
                           pool, `kvtier.tiers.dram_pages`); at least slot_bytes
    dram_page_bytes        0 = automatic: the pages size classes take (a block larger than a
                           page spans adjacent pages; see `kvtier.tiers.dram.DramSpec.geometry`)
    data_dir               $XDG_DATA_HOME/kvtier, else ~/.local/share/kvtier (the SSD tier)
    ssd_bytes              the size kept in <data_dir>/kept.toml, else (the first start)
                           min(free disk under data_dir / 4, 16 GiB); 0 = no SSD tier
    metrics                127.0.0.1:9464 ("" = off; port 0 = any free port)
    tokens_file            "" = one tenant "default" without authentication (see kvtier.daemon.auth)
    lease_ttl_s            30; a client may ask for up to max_lease_ttl_s (600)
    grace_s                10: on SIGTERM, leases may finish for this long
    max_blocks_per_request 4096
    ssd_admit_after        2: write a DRAM evictee to SSD from its k-th access on
    policy                 kvtier.index.policy_registry.DEFAULT_POLICY: eviction and admission
                           policy of the prefix index (any name of its POLICIES: lru, vllm-arc,
                           sglang-lfu, lmcache-s3fifo, sieve, kvtier, ...)
    ssd_dwpd               1.0: SSD writes per day, in units of ssd_bytes (see below)
    ssd_write_bytes_per_day 0 = ssd_bytes * ssd_dwpd: the long-run SSD write rate (token bucket)
    ssd_write_burst_bytes  0 = min(a day's budget, max(a quarter day's, 4 write-back queues)),
                           at least one largest block: what may be written at once before the
                           rate applies (a block larger than it never reaches SSD)
    writeback_queue_bytes  0 = min(dram_bytes / 4, 1 GiB): DRAM pinned by queued write-backs
    log_level              info (debug, info, warning, error)
    kv_events              "" = off; tcp://HOST:PORT (PORT * = any), ipc://PATH: publish the
                           node's tier changes there for KV-aware routers (vLLM's KV-event
                           format over ZMQ; no authentication: bind loopback or a trusted
                           network). vLLM's rule: `*` in it, `::` or ipc:// binds; any other
                           address is a collector's (llm-d's indexer) that it connects to
    kv_events_replay       "" = no replay; tcp://HOST:PORT: vLLM's replay endpoint (ROUTER)
    kv_events_topic        "kvtier": the topic frame of every message
    kv_events_hwm          100000: messages queued per subscriber before sends to it fail (the
                           batch is counted as dropped; it stays replayable)

Remote tier (off unless `remote_url` is set; see README "Sharing across nodes"):

    remote_url             "" = off; redis://HOST:PORT/DB, rediss:// (TLS), valkey://, unix://PATH
    remote_mode            standalone | cluster (Redis Cluster / Valkey cluster via redis-py)
    remote_username        "" (ACL user; overrides the url's)
    remote_password        "" (prefer KVTIER_REMOTE_PASSWORD or the TOML file to a flag)
    remote_tls_ca          PEM CA bundle to verify the store (rediss:// only)
    remote_tls_cert, remote_tls_key   client certificate + key for mutual TLS (rediss:// only)
    remote_timeout_s       0.25: bounded wait per socket operation (connect, send, receive)
    remote_write_bytes_per_s 0 = 200 MB/s: long-run write-through rate (token bucket)
    remote_write_burst_bytes 0 = max(a second's budget, 16 slots)
    remote_queue_bytes     0 = min(dram_bytes / 8, 256 MiB): DRAM pinned by queued remote writes
    remote_admit_after     1: write a block to the store from its k-th access (1 = at Commit)
    remote_prefix          kvtier: the store's key prefix (keys: PREFIX:TENANT/ns2:LAYOUT:KEY)

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
binary/decimal suffix ("4GiB", "512MB"). Any bad value raises `UsageError` naming the setting and
where it came from (the flag, the variable, or the file). `to_toml` writes a configuration back
as a file `--config` reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kvtier.core.errors import UsageError
from kvtier.core.paths import CONFIG_FILE, SOCKET_NAME, config_dirs, runtime_dir
from kvtier.core.paths import data_dir as default_data_dir
from kvtier.index.policy_registry import DEFAULT_POLICY, POLICIES
from kvtier.tiers.blockfmt import HEADER_SIZE as BLOCK_HEADER_BYTES

GiB = 1 << 30
KiB = 1 << 10
MiB = 1 << 20

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_SUFFIX = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1 << 10, "kib": 1 << 10,
    "m": 10**6, "mb": 10**6, "mi": MiB, "mib": MiB,
    "g": 10**9, "gb": 10**9, "gi": GiB, "gib": GiB,
    "t": 10**12, "tb": 10**12, "ti": 1 << 40, "tib": 1 << 40,
    "p": 10**15, "pb": 10**15, "pi": 1 << 50, "pib": 1 << 50,
}
_LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class Config:
    """A validated daemon configuration. Build it with `load()`."""

    socket: Path
    tcp: str
    tls_cert: str
    tls_key: str
    dram_bytes: int
    slot_bytes: int
    max_block_bytes: int
    dram_page_bytes: int
    data_dir: Path
    ssd_bytes: int
    metrics: str
    tokens_file: str
    lease_ttl_s: float
    max_lease_ttl_s: float
    grace_s: float
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


def parse_bytes(value: object, name: str = "size") -> int:
    """An int or a size string ("4GiB", "512 MB", "1.5g") → bytes. Raises UsageError."""
    if isinstance(value, bool):
        raise UsageError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise UsageError(f"{name}: must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and (m.group(2) or "").lower() in _SUFFIX:
            return int(float(m.group(1)) * _SUFFIX[(m.group(2) or "").lower()])
    raise UsageError(f"{name}: expected a size like 4GiB or 512MB, got {value!r}")


def default_burst(bytes_per_day: int, queue_bytes: int, slot_bytes: int) -> int:
    """The wear bucket's size when not configured: a quarter day of budget, at least four full
    write-back queues, at most one day of budget, and never less than 16 slots (one block with
    its header must always fit)."""
    return max(min(bytes_per_day, max(bytes_per_day // 4, 4 * queue_bytes)), 16 * slot_bytes)


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def default_ssd_bytes(data_dir: Path) -> int:
    """The first start's SSD size: a quarter of the free disk under `data_dir`, at most 16 GiB."""
    return min(_free_bytes(data_dir) // 4, 16 * GiB)


def defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """The embedded defaults, sized for this machine."""
    data_dir = Path(env["KVTIER_DATA_DIR"]) if env.get("KVTIER_DATA_DIR") else (
        default_data_dir(env)
    )
    shm = Path("/dev/shm")
    shm_free = shutil.disk_usage(shm).free if shm.exists() else _ram_bytes()
    dram = min(_ram_bytes() // 8, shm_free // 2, 4 * GiB)
    return {
        "socket": str(runtime_dir(env) / SOCKET_NAME),
        "tcp": "",
        "tls_cert": "",
        "tls_key": "",
        "dram_bytes": dram,
        "slot_bytes": 16 * KiB,
        "max_block_bytes": 8 * MiB,
        "dram_page_bytes": 0,
        "data_dir": str(data_dir),
        "ssd_bytes": default_ssd_bytes(data_dir),
        "metrics": "127.0.0.1:9464",
        "tokens_file": "",
        "lease_ttl_s": 30.0,
        "max_lease_ttl_s": 600.0,
        "grace_s": 10.0,
        "max_blocks_per_request": 4096,
        "ssd_admit_after": 2,
        "policy": DEFAULT_POLICY,
        "ssd_dwpd": 1.0,
        "ssd_write_bytes_per_day": 0,
        "ssd_write_burst_bytes": 0,
        "writeback_queue_bytes": 0,
        "log_level": "info",
        "kv_events": "",
        "kv_events_replay": "",
        "kv_events_topic": "kvtier",
        "kv_events_hwm": 100_000,
        "remote_url": "",
        "remote_mode": "standalone",
        "remote_username": "",
        "remote_password": "",
        "remote_tls_ca": "",
        "remote_tls_cert": "",
        "remote_tls_key": "",
        "remote_timeout_s": 0.25,
        "remote_write_bytes_per_s": 0,
        "remote_write_burst_bytes": 0,
        "remote_queue_bytes": 0,
        "remote_admit_after": 1,
        "remote_prefix": "kvtier",
    }


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_SIZES = {"dram_bytes", "slot_bytes", "max_block_bytes", "dram_page_bytes", "ssd_bytes",
          "ssd_write_bytes_per_day", "ssd_write_burst_bytes", "writeback_queue_bytes",
          "remote_write_bytes_per_s", "remote_write_burst_bytes", "remote_queue_bytes"}
_INTS = {"max_blocks_per_request", "ssd_admit_after", "remote_admit_after", "kv_events_hwm"}
_FLOATS = {"lease_ttl_s", "max_lease_ttl_s", "grace_s", "ssd_dwpd", "remote_timeout_s"}
SECRETS = frozenset({"remote_password"})
"""Settings `to_toml` (`--print-config`) never prints."""


def _coerce(name: str, value: object, origin: str) -> object:
    where = f"{name} (from {origin})"
    if name in _SIZES:
        return parse_bytes(value, where)
    if name in _INTS or name in _FLOATS:
        if isinstance(value, int | float | str) and not isinstance(value, bool):
            try:
                return int(value) if name in _INTS else float(value)
            except ValueError:
                pass
        raise UsageError(f"{where}: expected a number, got {value!r}")
    if not isinstance(value, str):
        raise UsageError(f"{where}: expected a string, got {value!r}")
    return value


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


def load(
    flags: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    config_path: str | None = None,
) -> Config:
    """Merges defaults < TOML < env < flags (flags whose value is None are unset) and validates."""
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    merged: dict[str, object] = dict(defaults(env))
    origin = dict.fromkeys(merged, "defaults")
    path = config_path or env.get("KVTIER_CONFIG")
    if not path:
        found = [d / CONFIG_FILE for d in config_dirs(env) if (d / CONFIG_FILE).is_file()]
        path = str(found[0]) if found else None
    if path:
        for key, value in _read_toml(Path(path)).items():
            _set(merged, origin, key, value, f"config file {path}")
    for key in _FIELDS:
        if env_var(key) in env:
            _set(merged, origin, key, env[env_var(key)], f"environment variable {env_var(key)}")
    for key, value in flags.items():
        _set(merged, origin, key, value, f"flag --{key.replace('_', '-')}")
    if origin["ssd_bytes"] == "defaults":  # sized for the data dir actually configured
        data = Path(str(merged["data_dir"])).expanduser()
        kept = read_kept(data)
        if kept is not None:
            merged["ssd_bytes"], origin["ssd_bytes"] = kept
        else:
            merged["ssd_bytes"] = default_ssd_bytes(data)
    return _validate(merged, origin)


def _zmq_endpoint(text: str) -> bool:
    if text.startswith("ipc://"):
        return len(text) > len("ipc://")
    if not text.startswith("tcp://"):
        return False
    host, sep, port = text[len("tcp://"):].rpartition(":")
    return bool(host and sep and (port == "*" or (port.isdigit() and int(port) <= 65535)))


def env_var(setting: str) -> str:
    """The environment variable of a setting: KVTIER_ + its name in upper case."""
    return f"KVTIER_{setting.upper()}"


def _set(merged: dict[str, object], origin: dict[str, str], key: str, value: object,
         where: str) -> None:
    if key not in _FIELDS:
        raise UsageError(f"unknown setting {key!r} (from {where})")
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


def to_toml(cfg: Config) -> str:
    """`cfg` as a TOML file that `load(config_path=...)` reads back into an equal Config."""
    lines = ["# kvtier serve configuration (kvtier serve --print-config); use with --config"]
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if value and field.name in SECRETS:
            lines.append(f"# {field.name} is set (not printed; give it again to use this file)")
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            value = json.dumps(str(value))  # a JSON string is a valid TOML basic string
        lines.append(f"{field.name} = {value}")
    return "\n".join(lines) + "\n"


def _validate(v: dict[str, object], origin: dict[str, str]) -> Config:
    def bad(name: str, why: str) -> UsageError:
        return UsageError(f"{name} (from {origin[name]}): {why}")

    def i(name: str) -> int:
        return int(cast(int, v[name]))

    def f(name: str) -> float:
        return float(cast(float, v[name]))

    slot = i("slot_bytes")
    if slot < 4096 or slot % 4096:
        raise bad("slot_bytes", f"must be a positive multiple of 4096, got {slot}")
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
    for name in ("lease_ttl_s", "max_lease_ttl_s"):
        if not 0 < f(name) <= 86400:
            raise bad(name, f"must be in (0, 86400] seconds, got {v[name]}")
    if f("lease_ttl_s") > f("max_lease_ttl_s"):
        raise bad("lease_ttl_s", "must not exceed max_lease_ttl_s")
    if f("grace_s") < 0:
        raise bad("grace_s", "must be >= 0")
    if not 1 <= i("max_blocks_per_request") <= 1 << 20:
        raise bad("max_blocks_per_request", "must be in [1, 1048576]")
    if i("ssd_admit_after") < 1:
        raise bad("ssd_admit_after", "must be >= 1")
    if str(v["policy"]) not in POLICIES:
        raise bad("policy", f"must be one of {', '.join(sorted(POLICIES))}, got {v['policy']!r}")
    if not 0 < f("ssd_dwpd") <= 100:
        raise bad("ssd_dwpd", f"must be in (0, 100] drive writes per day, got {v['ssd_dwpd']}")
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
    if str(v["log_level"]).lower() not in _LOG_LEVELS:
        raise bad("log_level", f"must be one of {', '.join(_LOG_LEVELS)}")
    for name in ("metrics", "tcp"):
        text = str(v[name])
        if text:
            _, sep, port = text.rpartition(":")
            if not sep or not port.isdigit() or int(port) > 65535:
                raise bad(name, f"expected HOST:PORT, got {text!r}")
    tcp_host = str(v["tcp"]).rpartition(":")[0]
    loopback = tcp_host in ("127.0.0.1", "localhost", "::1", "[::1]")
    if v["tcp"] and not loopback and not (v["tls_cert"] and v["tls_key"]):
        raise bad("tcp", "listening beyond loopback needs tls_cert and tls_key")
    if bool(v["tls_cert"]) != bool(v["tls_key"]):
        raise bad("tls_cert", "tls_cert and tls_key go together")
    if not str(v["socket"]):
        raise bad("socket", "must not be empty")
    for name in ("kv_events", "kv_events_replay"):
        text = str(v[name])
        if text and not _zmq_endpoint(text):
            raise bad(name, f"expected tcp://HOST:PORT or ipc://PATH, got {text!r}")
    if v["kv_events_replay"] and not v["kv_events"]:
        raise bad("kv_events_replay", "needs kv_events")
    pub = str(v["kv_events"])
    if pub and pub == v["kv_events_replay"] and "*" not in pub:
        raise bad("kv_events_replay", "must differ from kv_events")
    if i("kv_events_hwm") < 1:
        raise bad("kv_events_hwm", f"must be at least 1, got {i('kv_events_hwm')}")
    remote = _validate_remote(v, bad, slot, dram)
    return Config(
        socket=Path(str(v["socket"])).expanduser(),
        tcp=str(v["tcp"]),
        tls_cert=str(v["tls_cert"]),
        tls_key=str(v["tls_key"]),
        dram_bytes=dram,
        slot_bytes=slot,
        max_block_bytes=big,
        dram_page_bytes=page,
        data_dir=Path(str(v["data_dir"])).expanduser(),
        ssd_bytes=i("ssd_bytes"),
        metrics=str(v["metrics"]),
        tokens_file=str(v["tokens_file"]),
        lease_ttl_s=f("lease_ttl_s"),
        max_lease_ttl_s=f("max_lease_ttl_s"),
        grace_s=f("grace_s"),
        max_blocks_per_request=i("max_blocks_per_request"),
        ssd_admit_after=i("ssd_admit_after"),
        policy=str(v["policy"]),
        ssd_dwpd=f("ssd_dwpd"),
        ssd_write_bytes_per_day=per_day,
        ssd_write_burst_bytes=burst,
        writeback_queue_bytes=queue,
        kv_events=str(v["kv_events"]),
        kv_events_replay=str(v["kv_events_replay"]),
        kv_events_topic=str(v["kv_events_topic"]),
        kv_events_hwm=i("kv_events_hwm"),
        log_level=str(v["log_level"]).lower(),
        **remote,
    )


def _validate_remote(
    v: dict[str, object], bad: Callable[[str, str], UsageError], slot: int, dram: int,
) -> dict[str, Any]:
    """The remote_* settings, validated (the URL and TLS combination by `RemoteSpec`)."""
    out: dict[str, Any] = {name: v[name] for name in _FIELDS if name.startswith("remote_")}
    mode = str(v["remote_mode"]).lower()
    if mode not in ("standalone", "cluster"):
        raise bad("remote_mode", f"must be standalone or cluster, got {v['remote_mode']!r}")
    out["remote_mode"] = mode
    out["remote_timeout_s"] = float(cast(float, v["remote_timeout_s"]))
    if int(cast(int, v["remote_admit_after"])) < 1:
        raise bad("remote_admit_after", "must be >= 1")
    rate = int(cast(int, v["remote_write_bytes_per_s"])) or 200_000_000
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
