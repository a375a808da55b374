"""Runs the daemon: gRPC on a Unix socket (mode 0600; optional TCP with TLS) and the lookup socket
beside it (`kvtier.daemon.rpc.local_socket`, closed with the gRPC server), health, reflection,
/metrics with the /healthz and /readyz probes (`kvtier.daemon.httpd`), the lease reaper, a
draining shutdown on SIGTERM/SIGINT/SIGQUIT and a live reload on SIGHUP (`kvtier.daemon.reload`).
SIGUSR1 and SIGUSR2, whose default action would end the process without its cleanup, have no
meaning here: each is logged (one WARNING naming the signals kvtier does use) and ignored, from
the start of `run` on, as daemons that give them no job commonly do.

Planner rates (`kvtier.daemon.rates.kept`): the `RateBook` is seeded from the rates this daemon
measured before its last restart (`<data_dir>/rates.json`, kept every minute and at shutdown),
over `<data_dir>/calibration.json` (`kvtier calibrate`) when present, else the built-in defaults;
a file that cannot be read or parsed is logged as a one-line warning and ignored — the daemon
still starts, since the moving estimates replace any seed as samples arrive and a cache that
refuses to start over a stale measurement takes the serving path down with it. The start log
line says which seeded the rates.

Socket path: `kvtier.daemon.sockpath.claim` refuses anything there that is not a socket and paths
Linux cannot bind (one line); only a stale socket is removed. Readiness: `/readyz` is 503 until
the start completes and from the first moment of a drain; sd_notify READY=1 once serving.

Shutdown order (SIGTERM, SIGINT, SIGQUIT): health goes NOT_SERVING and new Acquire/Allocate calls
get UNAVAILABLE; Release/Commit/Abort keep working until every lease has ended or `grace_s` has
passed; then the server stops, leftover leases are ended (pins dropped, allocations aborted), the
rates are kept, the write-back queue is flushed and the storage tiers are closed cleanly (the
segment unlinked), and the sockets are removed.

Start-up: the first log line says where and how much (socket, metrics, DRAM and SSD tiers,
rates, tenants). Lines logged while starting (a reclaimed segment, a damaged SSD store moved
aside, the SSD rebuild) are held and follow it; the first line is stamped when the start began,
so the log stays in timestamp order. The data dir is locked for the daemon's life
(`kvtier.daemon.dirlock`): a second daemon on it is refused, naming the first (pid, socket).
The SSD size it runs with is kept in the data dir (`config.write_kept`), so the next start
without an explicit `ssd_bytes` keeps the tier's size.

Shared memory: the DRAM segment's owner is recorded beside the socket
(`kvtier.tiers.segment_owner`), so a daemon that died without unlinking its segment (SIGKILL, OOM)
has it reclaimed by the next daemon started on the same socket — and a live daemon's segment is
never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import lmdb
import prometheus_client

from kvtier._version import __version__
from kvtier.core.errors import UsageError
from kvtier.core.paths import socket_path_problem
from kvtier.core.units import format_bytes
from kvtier.daemon import fdpass, memory, reload, sdnotify, sharing, sockpath
from kvtier.daemon.auth import Authenticator
from kvtier.daemon.cache.cache import Cache, dram_shares
from kvtier.daemon.cache.namespaces import KEY_WIDTHS
from kvtier.daemon.config import (
    MIN_DEFAULT_SSD_BYTES,
    Config,
    cache_spec,
    free_bytes,
    write_kept,
)
from kvtier.daemon.dirlock import DataDirLock
from kvtier.daemon.fdpass import FdServer
from kvtier.daemon.httpd import HttpEndpoint
from kvtier.daemon.kv_publisher import KvEventPublisher
from kvtier.daemon.metrics import DaemonMetrics
from kvtier.daemon.rates import kept as kept_rates
from kvtier.daemon.rpc.grpc_server import GrpcServer
from kvtier.daemon.rpc.guard import Limits
from kvtier.daemon.rpc.local_socket import LookupServer
from kvtier.daemon.rpc.service import CHUNK_BYTES, Service
from kvtier.tiers import dram_keep, segment_owner
from kvtier.tiers.dram_keep import Keeper
from kvtier.tiers.dram_regions import release_fd, tenant_count_problem

log = logging.getLogger("kvtier.daemon.server")
REAP_INTERVAL_S = 0.25


def _tls_pair(cfg: Config) -> tuple[bytes, bytes]:
    """The TLS (key, certificate) PEM of the TCP listener."""
    try:
        return Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes()
    except OSError as exc:
        raise UsageError(f"TLS key/certificate: {exc}") from None


class _HeldLogs(logging.Handler):
    """Holds every log record while installed as the root logger's only handler."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self._root = logging.getLogger()
        self._saved = self._root.handlers[:]
        self._root.handlers = [self]

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def replay(self, first: Sequence[str] = (), stamp: float | None = None) -> None:
        """Restores the handlers, logs `first` (INFO; stamped `stamp` when given, so the log
        stays in timestamp order), then the held records in order."""
        self._root.handlers = self._saved
        for line in first if log.isEnabledFor(logging.INFO) else ():
            record = log.makeRecord(log.name, logging.INFO, __file__, 0, "%s", (line,), None)
            if stamp is not None:
                record.created = stamp
                record.msecs = (stamp - int(stamp)) * 1000
            log.handle(record)
        for record in self.records:
            logging.getLogger(record.name).handle(record)
        self.records.clear()


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
"""Signals kvtier gives no job whose default action would kill it without its cleanup."""


def _ignore(sig: signal.Signals) -> None:
    log.warning("%s ignored: kvtier reloads on SIGHUP and drains and stops on SIGTERM, SIGINT "
                "or SIGQUIT", sig.name)


def _release(keeper: Keeper | None) -> None:
    """A start that failed before its pool took them: the memfds given back are closed (the
    holder keeps its own copies for the next start)."""
    if keeper is not None:
        for fd in keeper.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        keeper.fds.clear()


class Daemon:
    """One running daemon. `start()`, then `wait()`; `stop()` drains (also on SIGTERM, SIGINT
    and SIGQUIT); `reload()` on SIGHUP (`kvtier.daemon.reload`)."""

    def __init__(self, cfg: Config, source: reload.ConfigSource | None = None) -> None:
        self.cfg = cfg
        self.source = source
        self._file_values = source.file_values() if source is not None else {}
        self._not_ready: str | None = "starting: the storage tiers are not open yet"
        self._rates_saved = time.monotonic()
        self._stop_task: asyncio.Future[None] | None = None
        self.auth = Authenticator.from_file(cfg.tokens_file)
        self.metrics = DaemonMetrics()
        self.cache: Cache | None = None
        self.server: GrpcServer | None = None
        self.service: Service | None = None
        self.fds: FdServer | None = None  # an isolated pool's fd socket (`kvtier.daemon.fdpass`)
        self.lookups: LookupServer | None = None  # `kvtier.daemon.rpc.local_socket`
        self.metrics_port: int | None = None
        self.http: HttpEndpoint | None = None  # /metrics and the probes
        self._stopping = asyncio.Event()
        self._done = asyncio.Event()
        self._reaper: asyncio.Task[None] | None = None
        self._dir_lock: DataDirLock | None = None
        self.kv_events: KvEventPublisher | None = None

    async def start(self) -> None:
        """Starts serving; the where-and-how-much line is the first line logged."""
        began = time.time()
        held = _HeldLogs()
        try:
            line = await self._start()
        except BaseException:
            held.replay()
            if self._dir_lock is not None:
                self._dir_lock.release()
            raise
        held.replay([line], stamp=began)  # stamped when the start began: before the held lines
        self._not_ready = None
        sdnotify.notify("READY=1\nSTATUS=serving")

    async def _start(self) -> str:
        cfg = self.cfg
        guaranteed = sum(t.dram_guarantee_bytes for t in self.auth.tenants())
        if guaranteed > cfg.dram_bytes:
            raise UsageError(
                f"tokens file {cfg.tokens_file}: the tenants' dram_guarantee add up to "
                f"{format_bytes(guaranteed)}, more than the DRAM pool "
                f"({format_bytes(cfg.dram_bytes)})"
            )
        problem = (tenant_count_problem(len(self.auth.tenants()), cfg.tokens_file)
               if self.auth.required else None)
        if problem:
            raise UsageError(problem)
        problem = socket_path_problem(cfg.socket)
        if problem:
            raise UsageError(problem)
        sharing.prepare_socket_dir(cfg.socket, cfg.group)  # 0750 of the group, if any
        removed = sockpath.claim(cfg.socket)
        if removed:
            log.warning("%s", removed)
        keeper = self._keeper()
        shm_free = shutil.disk_usage("/dev/shm").free
        if keeper is not None and keeper.adopt:  # its own file: counted as free for itself
            rec = segment_owner.read_record(self.segment_record)
            with contextlib.suppress(OSError):
                shm_free += os.stat(rec.path).st_blocks * 512 if rec is not None else 0
        if cfg.dram_bytes > shm_free:
            raise UsageError(
                f"dram_bytes {format_bytes(cfg.dram_bytes)} exceeds the free shared memory in "
                f"/dev/shm ({format_bytes(shm_free)})"
            )
        addr = self.cfg.metrics_address()
        if addr is not None:
            try:
                self.http = HttpEndpoint(*addr, self.metrics.registry,
                                         readiness=lambda: self._not_ready)
                self.metrics_port = self.http.port
            except OSError as exc:
                raise UsageError(f"metrics address {cfg.metrics}: {exc}") from None
        try:
            self._dir_lock = DataDirLock.acquire(cfg.data_dir, cfg.socket)  # before any file in it
            rates = kept_rates.start_rates(cfg.data_dir)
            spec = cache_spec(cfg, tenants=len(self.auth.tenants()))
            self.cache = cache = Cache(spec, self.metrics, rates=rates.book, keeper=keeper)
            cache.tenant_rates.seed(rates.tenants)
            if cache.residency.store is not None:
                write_kept(cfg.data_dir, cfg.ssd_bytes)
        except (OSError, lmdb.Error) as exc:
            self._close_http()
            _release(keeper)
            raise UsageError(f"cannot set up the storage tiers: {exc}") from None
        except BaseException:
            self._close_http()
            _release(keeper)
            raise
        try:
            if cfg.kv_events:
                self.kv_events = KvEventPublisher(cfg.kv_events, cfg.kv_events_replay,
                                                  cfg.kv_events_topic, cfg.kv_events_hwm,
                                                  self.metrics)
                cache.events.sink = self.kv_events.offer
            pool = cache.pool
            pool.set_tenant_keys({name: dram_keep.token_key(d)
                                  for name, d in self.auth.digests().items()})
            if pool.isolated:  # each tenant's slice of the pool, before any call
                cache.set_tenants(self.auth.tenants(), (), (), f"tokens file {cfg.tokens_file}")
            if pool.isolated:  # no file to leak; its memory is handed out on the fd socket
                if not fdpass.make_undumpable():
                    log.warning("the daemon stays dumpable: a process of its user can take its "
                                "tenants' DRAM fds through /proc/%d/fd", os.getpid())
                self.fds = FdServer(cfg.socket, pool, lambda: self.auth, cfg.group)
                self.fds.start()
            else:
                segment_owner.write_record(self.segment_record, segment_owner.this_process(
                    pool.spec.shm_dir, pool.spec.name, pool.generation))
            await self._start_server(cache)
        except BaseException:
            self._close_cache(cache, keep=cfg.keep_dram)  # a failed start loses no DRAM
            self._close_http()
            raise
        self._reaper = asyncio.create_task(self._reap())
        ssd = "off"
        free = free_bytes(cfg.data_dir)
        if not cfg.ssd_bytes and free // 4 < MIN_DEFAULT_SSD_BYTES:
            ssd = (f"off ({format_bytes(free)} free under {cfg.data_dir}: a default tier needs "
                   f"{format_bytes(4 * MIN_DEFAULT_SSD_BYTES)})")
        if cfg.ssd_bytes:
            ssd = (f"{format_bytes(cfg.ssd_bytes)} under {cfg.data_dir} (write-back queue "
                   f"{format_bytes(cfg.writeback_queue_bytes)}, SSD writes "
                   f"{format_bytes(cfg.ssd_write_bytes_per_day)}/day (burst "
                   f"{format_bytes(cfg.ssd_write_burst_bytes)})), "
                   f"{format_bytes(spec.ssd.store.disk_bytes() if spec.ssd else 0)} "
                   "reserved on disk")
        tcp = f" and tcp:{cfg.tcp}{' (TLS)' if cfg.tls_cert else ''}" if cfg.tcp else ""
        metrics = f"http://{addr[0]}:{self.metrics_port}/metrics" if addr else "off"
        events = "off"
        if self.kv_events is not None:
            events = self.kv_events.endpoint + (f" (replay {self.kv_events.replay_endpoint})"
                                                if self.kv_events.replay_endpoint else "")
        slices = cache.pool.slices()  # an isolated pool: each tenant's DRAM is its own
        tenants = ", ".join(t.name + (f" ({format_bytes(slices[t.name])} of DRAM)"
                                      if t.name in slices else "") for t in self.auth.tenants())
        auth = "token auth" if self.auth.required else "no auth"
        return (f"kvtier {__version__} serving on unix:{cfg.socket}{tcp}; metrics {metrics}; "
                f"DRAM pool {format_bytes(cfg.dram_bytes)} (blocks up to "
                f"{format_bytes(cfg.max_block_bytes)} in size classes, slots from "
                f"{format_bytes(cfg.slot_bytes)}; {self._kept_line(cache, keeper)}); SSD tier "
                f"{ssd}; planner rates from {rates.described}; KV events {events}; tenants: "
                f"{tenants} ({auth})")

    def _keeper(self) -> Keeper | None:
        """What this start finds of a DRAM pool a dead daemon kept (`keep_dram`): a named pool
        whose owner is gone may be adopted; the memfds systemd's fd store gave back are the
        pool's with tenants. Without `keep_dram` a dead daemon's segment is reclaimed and fds
        given back are released (and dropped from the store), as before."""
        cfg = self.cfg
        given = sdnotify.listen_fds()
        store = sdnotify.FdStore.from_env()
        ours = {name: fd for name, fd in given if dram_keep.is_ours(name)}
        for name, fd in given:
            if name not in ours:
                os.close(fd)  # not the pool's: nothing of ours to keep or release
        isolated = self.auth.required
        rec = None
        if cfg.keep_dram and not isolated:
            rec = segment_owner.dead_owner(self.segment_record)
            if rec is not None and rec.name != cache_spec(cfg).pool.name:
                rec = None  # another pool (another shm_dir or name): reclaimed below
        if rec is None:
            reclaimed = segment_owner.reclaim(self.segment_record)
            if reclaimed:
                log.warning("%s", reclaimed)
        if not cfg.keep_dram or not isolated:
            for name, fd in ours.items():  # memory of a pool of another kind: freed
                release_fd(fd)
                if store is not None:
                    store.forget(name)
            return Keeper(adopt=rec is not None) if cfg.keep_dram else None
        keys = {name: dram_keep.token_key(d) for name, d in self.auth.digests().items()}
        return Keeper(fds=ours, keys=keys, holder=store)

    def _kept_line(self, cache: Cache, keeper: Keeper | None) -> str:
        """How the DRAM tier outlives this daemon (part of the first log line)."""
        if keeper is None:
            return "not kept at a stop (keep_dram off)"
        if not cache.pool.isolated:
            return "kept for the next daemon on this socket at a stop or a crash (keep_dram)"
        if keeper.holder is None:
            log.warning("keep_dram: nothing holds the tenants' DRAM (memfds) across a restart: "
                        "no systemd fd store ($NOTIFY_SOCKET unset); the DRAM tier starts cold "
                        "at every start (see docs/deployment.md, FileDescriptorStoreMax=)")
            return "not kept: no holder for its memory (keep_dram without an fd store)"
        if not sdnotify.fd_store_size():
            log.warning("keep_dram: $FDSTORE is unset: systemd may keep none of the tenants' "
                        "DRAM memfds (set FileDescriptorStoreMax= in the unit; systemd older "
                        "than 254 does not say)")
        return "kept for the next daemon in systemd's fd store (keep_dram)"

    def _close_http(self) -> None:
        if self.http is not None:
            self.http.close()
            self.http = None

    @property
    def segment_record(self) -> Path:
        return segment_owner.record_path(self.cfg.socket)

    def _close_cache(self, cache: Cache, keep: bool = False) -> None:
        """Closes the fd socket and the tiers (the segment is unlinked), then drops the
        segment's owner record. `keep` (`keep_dram`, a stop): the pool and its owner record
        stay for the next daemon."""
        if self.fds is not None:
            self.fds.close()
            self.fds = None
        blocks = cache.pool.kept_blocks()
        cache.close(keep=keep)
        if self.kv_events is not None:  # after the cache: its last events go out
            self.kv_events.close()
            self.kv_events = None
        if keep:
            log.info("DRAM tier kept for the next daemon: %d blocks", blocks)
        else:
            segment_owner.remove_record(self.segment_record, cache.pool.generation)

    async def _start_server(self, cache: Cache) -> None:
        cfg = self.cfg
        limits = Limits.for_daemon(cfg.max_blocks_per_request, max(KEY_WIDTHS), CHUNK_BYTES)
        self.service = Service(cache, self.auth)
        server = self.server = GrpcServer(self.service, limits)
        await server.start(cfg.socket, cfg.group, cfg.tcp,
                           _tls_pair(cfg) if cfg.tcp and cfg.tls_cert else None)
        lookups = LookupServer(cfg.socket, self.service, limits, cfg.group)
        try:
            if await lookups.start():
                self.lookups = lookups
        except BaseException:
            await server.stop(None)
            raise
        await server.serving()

    async def _reap(self) -> None:
        assert self.cache is not None
        trimmed = time.monotonic()
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            self.cache.expire()
            if time.monotonic() - trimmed >= memory.TRIM_EVERY_S:
                memory.trim()
                trimmed = time.monotonic()
            if time.monotonic() - self._rates_saved >= kept_rates.SAVE_EVERY_S:
                await asyncio.to_thread(self.save_rates)

    def save_rates(self) -> None:
        """Keeps the measured planner rates in the data dir (`kvtier.daemon.rates.kept`)."""
        self._rates_saved = time.monotonic()
        cache = self.cache
        if cache is None:
            return
        try:
            kept_rates.save(self.cfg.data_dir, cache.rates, cache.tenant_rates.books())
        except OSError as exc:
            log.warning("cannot keep the planner rates in %s: %s", self.cfg.data_dir, exc)

    def install_signal_handlers(self) -> None:
        """SIGTERM, SIGINT and SIGQUIT drain; SIGHUP reloads. None of them kills the daemon
        without its cleanup (socket and shared-memory segment removed)."""
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self.reload)

    def _on_stop_signal(self, sig: signal.Signals) -> None:
        if not self._stopping.is_set():
            log.info("%s received", sig.name)
            self._stop_task = asyncio.ensure_future(self.stop())

    def reload(self) -> bool:
        """Re-reads the configuration and the tokens file and applies what can change live
        (see `kvtier.daemon.reload`); whether it applied. Runs on the event loop."""
        if self._stopping.is_set() or self._not_ready is not None:
            log.warning("SIGHUP ignored: the daemon is %s", "draining" if self._stopping.is_set()
                        else "still starting")
            return False
        if self.source is None:
            log.warning("SIGHUP ignored: this daemon was not started from a configuration source")
            return False
        sdnotify.notify("RELOADING=1")
        try:
            done, file_values = reload.prepare(self.source, self.cfg, self.auth,
                                               self._file_values)
            if self.cache is not None and done.auth.required:
                # tags are never reused: tenants that stored since the start count too, and a
                # tenant whose token changed takes a fresh one (`Cache.set_tenants`)
                rekeyed = set(reload.tenant_changes(self.auth, done.auth).rekeyed)
                tags = self.cache.pool.tags_needed({t.name for t in done.auth.tenants()},
                                                   rekeyed)
                problem = tenant_count_problem(tags, done.cfg.tokens_file)
                if problem:
                    raise UsageError(f"{problem} (with the tenants that stored since the start "
                                     "and a fresh tag for each token changed; a restart starts "
                                     "over)")
                self.cache.pool.slice_pages(dram_shares(done.auth.tenants()),
                                            f"tokens file {done.cfg.tokens_file}")
        except UsageError as exc:
            log.error("reload (SIGHUP) refused, nothing changed: %s", exc)
            sdnotify.notify("READY=1")
            return False
        if self.cache is not None:  # regions made from now on carry the new tokens' keys
            self.cache.pool.set_tenant_keys({name: dram_keep.token_key(d)
                                             for name, d in done.auth.digests().items()})
        reload.apply(done, self.cfg, self.cache, self.auth)
        self.cfg, self.auth, self._file_values = done.cfg, done.auth, file_values
        if self.service is not None:
            self.service.auth = done.auth
        log.info("%s", done.summary)
        if done.kept:
            log.warning("%s", done.kept)
        sdnotify.notify("READY=1")
        return True

    async def stop(self) -> None:
        """Drains and shuts down; safe to call more than once (later calls wait for the first)."""
        if self._stopping.is_set():
            await self._done.wait()
            return
        self._stopping.set()
        self._not_ready = "draining: shutting down"
        sdnotify.notify("STOPPING=1")
        cache = self.cache
        log.info("kvtier draining (grace %.1f s)", self.cfg.grace_s)
        if self.server is not None:
            await self.server.draining()
        if cache is not None:
            cache.draining = True
            deadline = time.monotonic() + self.cfg.grace_s
            while cache.active_leases() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                cache.expire()
        if self.service is not None:
            self.service.close_sessions()  # leases of sessions still open end with them
        if self.server is not None:
            await self.server.stop(1.0)
        if self.lookups is not None:
            await self.lookups.close()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if cache is not None:
            left = cache.active_leases()
            self.save_rates()
            self._close_cache(cache, keep=self.cfg.keep_dram)
            log.info("kvtier stopped (%d lease(s) ended at shutdown)", left)
        self._close_http()
        with contextlib.suppress(FileNotFoundError):
            self.cfg.socket.unlink()
        if self._dir_lock is not None:
            self._dir_lock.release()
        self._done.set()

    async def wait(self) -> None:
        await self._done.wait()


async def run(cfg: Config, source: reload.ConfigSource | None = None) -> None:
    daemon = Daemon(cfg, source)
    loop = asyncio.get_running_loop()
    # until the handlers are in place (start-up): a stop signal stops right after the start,
    # a SIGHUP is ignored — none of them may kill the process half-started
    early: list[signal.Signals] = []
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, early.append, sig)
    loop.add_signal_handler(signal.SIGHUP, log.warning, "SIGHUP ignored: the daemon is starting")
    for sig in IGNORED_SIGNALS:  # for the daemon's whole life
        loop.add_signal_handler(sig, _ignore, sig)
    await daemon.start()
    daemon.install_signal_handlers()
    if early:
        daemon._on_stop_signal(early[0])
    await daemon.wait()


def serve(cfg: Config, source: reload.ConfigSource | None = None) -> int:
    """Blocking entry point of `kvtier serve`; returns the exit code."""
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(run(cfg, source))
    return 0
