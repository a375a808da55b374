"""The connector's worker side: copies between the daemon's DRAM slots (mapped shared memory)
and vLLM's paged KV cache, on each TP rank.

    start_load_kv     for each LoadJob: Acquire the job's keys on this rank's layout (a lease), then
                      issue the step's copies slots -> vLLM blocks (`common/loads.py`). With the
                      TransferEngine (`transfer: "engine"`, what "auto" picks) one LOAD job per
                      layer runs on the engine's stream (CUDA: a side stream ordered after vLLM's
                      compute stream; CPU: the engine's copy thread), and
                      `wait_for_layer_load(layer)` waits for that layer only, so layer i's attention
                      overlaps the copy of the layers after it (under a full CUDA graph, whose
                      replay skips `wait_for_layer_load`, every layer is waited for within
                      `start_load_kv`). With `transfer: "torch"` the copy is synchronous torch
                      indexing (slower than the engine's CPU backend on the dev machine:
                      docs/benchmarks.md). Leases are Released once every layer's copy completed, at
                      `get_block_ids_with_load_errors` (after the forward). Blocks the daemon no
                      longer has, pairs whose copy failed (`ok=False`), and every block of a job
                      whose Release fails go to the load-error set, so vLLM recomputes them (a
                      failed Release means the lease expired or the daemon restarted: what was
                      copied may be stale).
    wait_for_save     for each SaveJob: copy the blocks out of vLLM's cache into a staging
                      buffer (`_stage`: one batched gather per chunk; on CUDA a non-blocking
                      device->host copy per chunk into pinned memory on a side stream ordered
                      after the compute stream, and the compute stream waits for it before
                      anything can overwrite those blocks — the CPU does not). With
                      `async_save` the "kvtier-save" thread then Allocates (keys already cached
                      are skipped), copies into the slots and Commits; without it the same on
                      this thread. vLLM's blocks are not read by the host after `wait_for_save`
                      returns, so nothing holds them (a preempted or finished request frees
                      them at once). Runs after the step's forward, so the blocks hold their
                      final KV; errors only lose the store.
    roles             a consumer (`Role.stores` false) stores nothing; a producer's stores are
                      hand-offs: each staged job's Allocate (`handoff`) is made on this thread,
                      within `wait_for_save`, so its keys are pending at the daemon before the
                      step's output reaches the scheduler (a decode engine's lookup sent the
                      moment the request answers waits for them); the copy into the slots and
                      the Commit then run on the save thread as above.
    prefill rate      `bind` (before the forward) to `wait_for_save` (after it) times the steps
                      the scheduler marked as one prompt chunk; rank 0 reports the latest to the
                      daemon's planner (ReportPrefill) at most every `prefill_report_s`.

Hybrid models (`EngineKV.hybrid`): each layer loads and stores its own KV cache group's blocks
(`LoadJob.groups`, `SaveJob.groups`); loads are asynchronous for vLLM: issued after the step's
forward, completed in `transfer_results` (vLLM's `get_transfer_results`, in the same step), and
a request whose blocks were not all pinned or copied is reported failed (`failed_recving`: vLLM
recomputes it from the start). Every hybrid load's request is reported finished exactly once,
whatever happened (a request never reported would wait forever).

Pages: each layer's tensor is vLLM's standardized view [B, H, N, C] (blocks at dim 0); `pages.py`
cuts it into per-block contiguous chunks in the page's logical order (one per layer, or one per
(layer, head) where head groups lie outside the block, as under LHBNC), and `layout.py` draws the
slot. On CUDA the slot buffer is registered with the driver (cudaHostRegister, mapped) so the
engine's kernels and DMA reach it, and the prefill rate is timed with CUDA events.
Threading: vLLM's worker thread, plus the save thread (`common/saver.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from kvtier.client.sync_client import Client, SlotBuffer
from kvtier.integrations.common.link import DaemonLink, unreachable
from kvtier.integrations.common.loads import LayerLoads, Lease, Loads, TorchLoads
from kvtier.integrations.common.saver import PrefillClock, Saver, Staged
from kvtier.integrations.common.verify import check_block, describe
from kvtier.integrations.vllm.layout import EngineKV, Unsupported
from kvtier.integrations.vllm.metadata import KvtierMetadata, LoadJob, SaveJob, VerifyRef
from kvtier.integrations.vllm.pages import Paged, paged, state_pages
from kvtier.integrations.vllm.settings import ConnectorSettings, Role, role_of

log = logging.getLogger("kvtier.integrations.vllm")


class WorkerStats:
    """Totals since start; `take()` returns what changed since the previous call. Thread-safe:
    every counter changes and is read under `lock` (loads count on vLLM's worker thread, stores
    on the save thread, `take` runs on the worker thread)."""

    def __init__(self) -> None:
        self.loaded_blocks = 0
        self.loaded_bytes = 0
        self.failed_blocks = 0
        self.stored_blocks = 0
        self.load_seconds = 0.0
        self.store_seconds = 0.0
        self.verified_blocks = 0
        self.mismatched_blocks = 0
        self.worst: dict[str, tuple[float, float]] = {}
        """Per group kind, the largest errors (relative L2, worst element) of matched blocks."""
        self._reported: dict[str, float] = {}
        self.lock = threading.Lock()

    def totals(self) -> dict[str, float]:
        with self.lock:
            return self._totals()

    def _totals(self) -> dict[str, float]:
        return {"loaded_blocks": self.loaded_blocks, "loaded_bytes": self.loaded_bytes,
                "load_failed_blocks": self.failed_blocks,
                "stored_blocks": self.stored_blocks, "load_seconds": self.load_seconds,
                "store_seconds": self.store_seconds, "verified_blocks": self.verified_blocks,
                "verify_mismatched_blocks": self.mismatched_blocks}

    def loaded(self, blocks: int, nbytes: int, seconds: float) -> None:
        with self.lock:
            self.loaded_blocks += blocks
            self.loaded_bytes += nbytes
            self.load_seconds += seconds

    def failed(self, blocks: int) -> None:
        with self.lock:
            self.failed_blocks += blocks

    def stored(self, blocks: int, seconds: float) -> None:
        with self.lock:
            self.stored_blocks += blocks
            self.store_seconds += seconds

    def verified(self, blocks: int, mismatched: int, worst: dict[str, tuple[float, float]]
                 ) -> None:
        with self.lock:
            self.verified_blocks += blocks
            self.mismatched_blocks += mismatched
            for kind, (l2, mx) in worst.items():
                was = self.worst.get(kind, (0.0, 0.0))
                self.worst[kind] = (max(was[0], l2), max(was[1], mx))

    def take(self) -> dict[str, float]:
        with self.lock:
            now = self._totals()
            delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
            self._reported = now
        return delta


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, kv: EngineKV, rank: int,
                 role: Role | None = None) -> None:
        self.kv = kv
        self.rank = rank
        self.settings = settings
        self.role = role or role_of("kv_both", settings)
        self.link = DaemonLink(settings, kv.decl(), f"worker {rank}")
        self.paged: Paged | None = None
        self.loads: Loads | None = None
        self.layer_index = {name: i for i, name in enumerate(kv.layer_names)}
        self._rows_cache: tuple[int, torch.Tensor] | None = None
        self._errors: set[int] = set()
        self._lease_req: dict[str, str] = {}
        """Hybrid loads in flight: lease id -> request id."""
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._save_stream: Any = None
        self.stats = WorkerStats()
        self.clock = PrefillClock(settings.prefill_report_s if rank == 0 else 0.0)
        self.saver = Saver(self.link, self._store, int(settings.save_buffer_mib * 2**20),
                           settings.async_save, self.clock.retry, self._discard)

    @property
    def layerwise(self) -> bool:
        return isinstance(self.loads, LayerLoads)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        missing = [n for n in self.kv.layer_names if n not in kv_caches]
        if missing:
            raise Unsupported(f"no KV tensor for layer(s) {missing[:3]}")
        tensors = [state_pages(kv_caches[n], self.kv.page_bytes)
                   if self.kv.is_state(self.kv.group_of(i)) else kv_caches[n]
                   for i, n in enumerate(self.kv.layer_names)]
        self.paged = pg = paged(tensors, self.kv.page_bytes)
        cuda = pg.device.type == "cuda"
        self.clock.cuda = cuda
        self.loads = self._make_loads(pg, cuda)
        if cuda:
            self._save_stream = torch.cuda.Stream(device=pg.device)  # type: ignore[no-untyped-call]
        log.info("kvtier worker %d: %d chunks of %d bytes per block (%d per layer), loads "
                 "through %s", self.rank, len(pg.chunks), pg.chunk_bytes, pg.per_layer,
                 "the TransferEngine, layer by layer" if self.layerwise else "torch copies")
        self.link.client()  # connect early (a missing daemon is one warning, not an error)

    def _make_loads(self, pg: Paged, cuda: bool) -> Loads:
        choice = "engine" if self.settings.transfer == "auto" else self.settings.transfer
        if choice == "engine" and cuda:
            from kvtier.gpu import available

            if not available():
                log.warning("kvtier worker %d: the TransferEngine's CUDA backend needs CuPy "
                            "(pip install 'cupy-cuda12x>=13'); loading with torch copies",
                            self.rank)
                choice = "torch"
        groups = [self.kv.group_of(i) for i in range(len(self.kv.layer_names))]
        if choice == "torch":
            return TorchLoads(pg.chunks, pg.per_layer, self._release, groups)
        if cuda:
            import cupy

            # this thread issues every load: CuPy's streams and events on vLLM's device (a TP
            # rank's GPU), not device 0
            cupy.cuda.Device(pg.device.index or 0).use()
        loads = LayerLoads(pg.chunks, pg.per_layer, self._release, layer_groups=groups)
        loads.calibrate()
        return loads

    def _rows(self, buf: SlotBuffer) -> torch.Tensor:
        """The [slots, slot_bytes] tensor over the mapped pool (kept per pool generation)."""
        cached = self._rows_cache
        if cached is None or cached[0] != buf.generation:
            cached = self._rows_cache = (buf.generation, torch.from_numpy(buf.array()))
        return cached[1]

    def bind(self, meta: KvtierMetadata) -> None:
        """vLLM bound this step's metadata: the forward starts."""
        if meta.prefill_tokens:
            self.clock.start()

    # -- loads ---------------------------------------------------------------------------------

    def start_load_kv(self, meta: KvtierMetadata, wait_all: bool = False) -> None:
        """Pins and issues this step's loads; with `wait_all` (or the torch copy) they are
        complete on return, else layer i is once `wait_for_layer_load` of it returned."""
        if self.loads is None:
            for job in meta.loads:
                self._fail_job(job, job.block_ids)
            return
        self._finish_loads()  # a step whose forward never asked (a profile run, say)
        leases: list[Lease] = []
        buf: SlotBuffer | None = None
        for job in meta.loads:
            if not job.block_ids:
                self._recv_done.add(job.req_id)
                continue
            got = self._acquire(job, buf)
            if got is None:
                self._fail_job(job, job.block_ids)
                continue
            lease, buf = got
            if job.groups and len(lease.blocks) < len(job.block_ids):
                self._release(lease.lease_id, 0, 0.0)  # hybrid: a request loads whole or not
                self._fail_job(job, job.block_ids)
                continue
            leases.append(lease)
            if job.groups:
                self._lease_req[lease.lease_id] = job.req_id
            else:
                self._fail(job.block_ids[len(lease.blocks):])
        if not leases or buf is None:
            return
        rows = self._rows(buf)
        if self.layerwise:
            after = None
            if self.clock.cuda:
                self._register_cuda()
                after = torch.cuda.Event()  # type: ignore[no-untyped-call]
                after.record()  # vLLM zeroes new blocks on its stream before the loads
            self.loads.start(rows.numpy(), buf.generation, leases, after)
        else:
            self.loads.start(rows, buf.generation, leases)
        if wait_all or not self.layerwise:
            self._finish_loads()

    def _acquire(self, job: LoadJob, buf: SlotBuffer | None
                 ) -> tuple[Lease, SlotBuffer] | None:
        """Pins the job's keys; its lease over the pinned blocks (from keys[first]) and the slot
        buffer they are in, or None (nothing pinned, or another pool than this step's)."""
        client = self.link.client()
        if client is None:
            return None
        n = len(job.block_ids)
        try:
            got = client.acquire(job.keys)
            pinned = min(n, max(0, got.blocks - job.first))
            if not got.lease_id:
                return None
            mine = client.slot_buffer_for(got.segment)
            if (mine is None or pinned == 0
                    or (buf is not None and mine.generation != buf.generation)):
                client.release(got.lease_id)
                return None
        except Exception as exc:
            self.link.failed(exc, "load")
            return None
        return Lease(got.lease_id, got.slots[job.first:job.first + pinned],
                     job.block_ids[:pinned], tuple(g[:pinned] for g in job.groups)), mine

    def _register_cuda(self) -> None:
        client = self.link.client()
        if client is not None:
            client.register_cuda()  # idempotent; else the engine registers the rows itself

    def _release(self, lease_id: str, nbytes: int, seconds: float) -> bool:
        client = self.link.client()
        if client is None:
            return False
        try:
            client.release(lease_id, nbytes, seconds)
        except Exception as exc:
            self.link.failed(exc, "load")
            return False
        return True

    def _fail(self, blocks: list[int]) -> None:
        self._errors.update(blocks)
        self.stats.failed(len(blocks))

    def _fail_job(self, job: LoadJob, blocks: list[int]) -> None:
        """A job not loaded: its blocks (one group) or its request (hybrid) fail."""
        if not job.groups:
            self._fail(blocks)
            return
        self.stats.failed(len(job.block_ids))
        self._recv_done.add(job.req_id)
        self._recv_failed.add(job.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.loads is not None:
            i = self.layer_index.get(layer_name)
            if i is not None:
                self.loads.wait_layer(i)

    def _finish_loads(self) -> None:
        if self.loads is None:
            return
        done = self.loads.finish()
        hybrid, self._lease_req = self._lease_req, {}
        for lease_id, rid in hybrid.items():  # hybrid: failures are per request
            self._recv_done.add(rid)
            if lease_id in done.failed_leases:
                self._recv_failed.add(rid)
        if self.kv.hybrid:
            self.stats.failed(len(done.failed))
        elif done.failed:
            self._fail(sorted(done.failed))
        self.stats.loaded(done.loaded, done.nbytes, done.seconds)

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """Completes the step's loads; the hybrid loads' requests finished since the last call,
        and those of them that failed (a subset)."""
        self._finish_loads()
        done, failed = self._recv_done, self._recv_failed
        self._recv_done, self._recv_failed = set(), set()
        return done, failed

    def take_load_errors(self) -> set[int]:
        """Completes the step's loads (every layer), releases their leases; the vLLM blocks
        that could not be loaded."""
        self._finish_loads()
        errors, self._errors = self._errors, set()
        return errors

    # -- saves ---------------------------------------------------------------------------------

    def wait_for_save(self, meta: KvtierMetadata) -> None:
        if meta.prefill_tokens:
            self.clock.stop(meta.prefill_tokens, meta.prefill_context)
        report = self.clock.due()
        if report is not None:
            self.saver.report_prefill(*report)
        if (not meta.saves or not self.role.stores or not self.kv.shard.saves
                or self.link.down()):
            return
        for job in meta.saves:
            staged = self._stage(job)
            if self.role.handoff and not self._allocate(staged):
                continue
            self.saver.submit(staged)

    def _allocate(self, staged: Staged) -> bool:
        """A hand-off's Allocate, on vLLM's thread (the module docstring); False when it was
        not made (the request's chain is broken: its later saves are skipped too)."""
        client = self.link.client()
        if client is None or self.saver.broken(staged.req_id):
            return False
        try:
            staged.allocated = client.allocate(staged.keys, staged.parent, handoff=True)
        except Exception as exc:
            self.saver.mark_broken(staged.req_id)
            self.link.failed(exc, "store")
            return False
        return True

    def _discard(self, staged: Staged) -> None:
        """A staged job that will not be stored: the lease of its Allocate, if any, ends."""
        lease = staged.allocated.lease_id if staged.allocated is not None else ""
        client = self.link.client()
        if lease and client is not None:
            client.abort(lease)

    def _stage(self, job: SaveJob) -> Staged:
        """The job's blocks copied out of vLLM's cache, chunk-major: [chunks, blocks,
        chunk_bytes] (CPU; pinned and filled asynchronously on CUDA: `Staged.ready`)."""
        assert self.paged is not None
        pg = self.paged
        n = len(job.block_ids)
        lists = job.groups or (job.block_ids,)
        per_group = [torch.tensor(ids, dtype=torch.long) for ids in lists]
        which = [per_group[self.kv.group_of(c // pg.per_layer) if job.groups else 0]
                 for c in range(len(pg.chunks))]
        if pg.device.type != "cuda":
            out = torch.empty((len(pg.chunks), n, pg.chunk_bytes), dtype=torch.uint8)
            for c, src in enumerate(pg.chunks):
                torch.index_select(src, 0, which[c], out=out[c])
            return Staged(job.req_id, job.keys, job.parent, out, None, job.pin_s, job.chain,
                          verify=job.verify)
        out = torch.empty((len(pg.chunks), n, pg.chunk_bytes), dtype=torch.uint8,
                          pin_memory=True)
        compute = torch.cuda.current_stream(pg.device)
        side = self._save_stream
        side.wait_stream(compute)  # the forward wrote these blocks
        with torch.cuda.stream(side):
            on_device = [ids.to(pg.device, non_blocking=True) for ids in per_group]
            for c, src in enumerate(pg.chunks):
                idx = on_device[self.kv.group_of(c // pg.per_layer) if job.groups else 0]
                out[c].copy_(src.index_select(0, idx), non_blocking=True)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(side)
        compute.wait_event(ready)  # nothing overwrites the blocks before they are copied
        return Staged(job.req_id, job.keys, job.parent, out, ready, job.pin_s, job.chain,
                          verify=job.verify)

    def _store(self, staged: Staged) -> None:
        """Stores one staged job (on the save thread, or inline); raises on failure."""
        client = self.link.client()
        if client is None:
            return
        started = time.perf_counter()
        if staged.ready is not None:
            staged.ready.synchronize()
        if staged.verify is not None:
            self._verify(client, staged, staged.verify)
        # vLLM's worker runs in inference mode, so the slot rows may be an inference tensor
        # (made by a load): in-place writes to it need inference mode on this thread too
        with torch.inference_mode(), client.store_into(staged.keys, staged.parent,
                                                       allocated=staged.allocated) as tx:
            if tx.slot_ids:
                buf = client.slot_buffer()
                if buf is None:
                    raise ConnectionError("the daemon's segment is not mapped")
                rows = self._rows(buf)
                slots = torch.tensor(tx.slot_ids, dtype=torch.long)
                which = torch.tensor([i for i, _ in tx.slots], dtype=torch.long)
                cb = staged.blocks.shape[2]
                for c in range(staged.blocks.shape[0]):
                    rows[slots, c * cb:(c + 1) * cb] = staged.blocks[c][which]
        self.stats.stored(tx.committed, time.perf_counter() - started)
        if staged.pin_s and staged.chain:  # the request's pin hint: its chain, now stored
            try:
                client.pin(staged.chain, staged.pin_s, hint=True)
            except Exception as exc:  # a refused pin costs the pin only, never the store
                self.link.failed(exc, "Pin")

    def _verify(self, client: Client, staged: Staged, ref: VerifyRef) -> None:
        """Shadow verification of a staged save: the blocks the daemon holds under its keys
        compared with the computed ones (`common/verify.py`), the result reported
        (ReportVerification); a mismatch is quarantined by the daemon and logged here. Before
        the store, so a quarantined block's recomputed KV is stored in its place. A failure is
        a verification not made (raised only when the daemon is unreachable)."""
        try:
            got = client.acquire(ref.chain)
        except Exception as exc:
            if unreachable(exc):
                raise
            log.debug("kvtier verify: Acquire failed: %s", exc)
            return
        matched, bad = 0, None
        worst: dict[str, tuple[float, float]] = {}
        try:
            held = min(got.blocks - ref.first, len(staged.keys))
            buf = client.slot_buffer_for(got.segment) if held > 0 else None
            if buf is None:
                return
            rows = self._rows(buf)
            regions = self.kv.verify_regions(ref.state)
            nbytes = self.kv.block_bytes
            for j in range(held):
                computed = staged.blocks[:, j, :].reshape(-1)
                check = check_block(computed, rows[got.slots[ref.first + j], :nbytes], regions)
                for kind, (l2, mx) in check.worst.items():
                    was = worst.get(kind, (0.0, 0.0))
                    worst[kind] = (max(was[0], l2), max(was[1], mx))
                if not check.ok:
                    bad = check.first_bad
                    break
                matched += 1
        finally:
            if got.lease_id:
                client.release(got.lease_id)
        keys = ref.chain[ref.first:ref.first + matched + (bad is not None)]
        detail = "" if bad is None else (f"block {ref.first + matched} of request "
                                         f"{staged.req_id}: {describe(bad)}")
        reply = client.report_verification(keys, matched, bad is not None, detail[:1024])
        self.stats.verified(len(keys), int(bad is not None),
                            {} if bad is not None else worst)
        if bad is not None:
            log.warning("kvtier verify: MISMATCH, model %r, layout %s, %s; the daemon "
                        "quarantined it and its descendants (%d DRAM, %d SSD, %d remote "
                        "copies%s); storing the recomputed KV", self.kv.model_id,
                        self.kv.describe(), detail, reply.quarantined_dram,
                        reply.quarantined_ssd, reply.quarantined_remote,
                        ", the rest once unpinned" if reply.deferred else "")

    def close(self) -> None:
        if self.loads is not None:
            self._finish_loads()
            self.loads.close()
        self.saver.close()
        self.link.close()
