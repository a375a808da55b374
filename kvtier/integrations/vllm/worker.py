"""The connector's worker side: copies between the daemon's DRAM slots (mapped shared memory)
and vLLM's paged KV cache, on each TP rank.

    start_load_kv     for each LoadJob: Acquire the job's keys on this rank's layout (a lease),
                      copy the pinned blocks slots -> vLLM blocks, every layer, then Release
                      (before the forward reads them: the load is synchronous). Blocks the
                      daemon no longer has, and every block of a job whose copy or Release
                      fails, go to the load-error set, so vLLM recomputes them (a failed Release
                      means the lease expired or the daemon restarted: what was copied may be
                      stale).
    wait_for_save     for each SaveJob: with `async_save`, copy the blocks into a staging buffer
                      and hand them to the "kvtier-save" thread, which Allocates (keys already
                      cached are skipped), copies into the slots and Commits. vLLM's blocks are
                      not read after `wait_for_save` returns, so nothing holds them (a preempted
                      or finished request frees them at once). Without it, the same on this
                      thread. Runs after the step's forward, so the blocks hold their final KV;
                      errors only lose the store.
    prefill rate      `bind` (before the forward) to `wait_for_save` (after it) times the steps
                      the scheduler marked as one prompt chunk; rank 0 reports the latest to the
                      daemon's planner (ReportPrefill) at most every `prefill_report_s`.

Pages: each layer's tensor is vLLM's standardized view [B, H, N, C] (blocks at dim 0); it is
viewed as [B, page_bytes] bytes and a block's page is copied whole (`layout.py` draws the slot).
On CUDA the same indexing copies between host memory and the device (torch copies; the batched
TransferEngine path is not wired here), and the prefill rate is timed with CUDA events.
Threading: vLLM's worker thread, plus the save thread (`saver.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from kvtier.client.sync_client import SlotBuffer
from kvtier.integrations.vllm.layout import EngineKV, Unsupported
from kvtier.integrations.vllm.link import DaemonLink
from kvtier.integrations.vllm.metadata import KvtierMetadata, LoadJob, SaveJob
from kvtier.integrations.vllm.saver import PrefillClock, Saver, Staged
from kvtier.integrations.vllm.settings import ConnectorSettings

log = logging.getLogger("kvtier.integrations.vllm")


def page_view(kv: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """`kv` ([B, ...], blocks at dim 0) as [B, page_bytes] bytes sharing its memory."""
    if kv.dim() < 2 or kv[0].numel() * kv.element_size() != page_bytes:
        raise Unsupported(f"a KV tensor of shape {tuple(kv.shape)} ({kv.dtype}) does not have "
                          f"pages of {page_bytes} bytes at dim 0")
    flat = kv.flatten(1)
    if flat.stride(1) != 1 or flat.data_ptr() != kv.data_ptr():
        raise Unsupported(f"KV pages of shape {tuple(kv.shape)} with strides {kv.stride()} are "
                          "not contiguous")
    return flat.view(torch.uint8)


class WorkerStats:
    """Totals since start; `take()` returns what changed since the previous call. Thread-safe."""

    def __init__(self) -> None:
        self.loaded_blocks = 0
        self.failed_blocks = 0
        self.stored_blocks = 0
        self.load_seconds = 0.0
        self.store_seconds = 0.0
        self._reported: dict[str, float] = {}
        self.lock = threading.Lock()

    def totals(self) -> dict[str, float]:
        return {"loaded_blocks": self.loaded_blocks, "load_failed_blocks": self.failed_blocks,
                "stored_blocks": self.stored_blocks, "load_seconds": self.load_seconds,
                "store_seconds": self.store_seconds}

    def stored(self, blocks: int, seconds: float) -> None:
        with self.lock:
            self.stored_blocks += blocks
            self.store_seconds += seconds

    def take(self) -> dict[str, float]:
        with self.lock:
            now = self.totals()
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return delta


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, kv: EngineKV, rank: int) -> None:
        self.kv = kv
        self.rank = rank
        self.settings = settings
        self.link = DaemonLink(settings, kv.decl(), f"worker {rank}")
        self.pages: list[torch.Tensor] = []
        self._rows_cache: tuple[int, torch.Tensor] | None = None
        self._errors: set[int] = set()
        self.stats = WorkerStats()
        self.clock = PrefillClock(settings.prefill_report_s if rank == 0 else 0.0)
        self.saver = Saver(self.link, self._store, int(settings.save_buffer_mib * 2**20),
                           settings.async_save, self.clock.retry)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        missing = [n for n in self.kv.layer_names if n not in kv_caches]
        if missing:
            raise Unsupported(f"no KV tensor for layer(s) {missing[:3]}")
        self.pages = [page_view(kv_caches[n], self.kv.page_bytes) for n in self.kv.layer_names]
        self.clock.cuda = self.pages[0].is_cuda
        self.link.client()  # connect early (a missing daemon is one warning, not an error)

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

    def start_load_kv(self, meta: KvtierMetadata) -> None:
        for job in meta.loads:
            if not job.block_ids:
                continue
            pinned = self._load(job)
            failed = job.block_ids[pinned:]
            self._errors.update(failed)
            self.stats.failed_blocks += len(failed)

    def _load(self, job: LoadJob) -> int:
        """Acquires the job's keys, copies what is pinned (from keys[first]) into its blocks and
        releases; how many of its blocks were loaded (0 on any failure)."""
        started = time.perf_counter()
        client = self.link.client()
        if client is None:
            return 0
        n = len(job.block_ids)
        try:
            got = client.acquire(job.keys)
            pinned = min(n, max(0, got.blocks - job.first))
            if not got.lease_id:
                return 0
            buf = client.slot_buffer_for(got.segment)
            if buf is None or pinned == 0:
                client.release(got.lease_id)
                return 0
            copying = time.perf_counter()  # the DRAM read rate the planner uses: the copy
            rows = self._rows(buf)             # alone, not the Acquire (it may read SSD)
            slots = torch.tensor(got.slots[job.first:job.first + pinned], dtype=torch.long)
            blocks = torch.tensor(job.block_ids[:pinned], dtype=torch.long)
            src = rows[slots]
            page = self.kv.page_bytes
            for i, dst in enumerate(self.pages):
                dst[blocks] = src[:, i * page:(i + 1) * page].to(dst.device)
            seconds = time.perf_counter() - copying
            client.release(got.lease_id, pinned * self.kv.block_bytes, seconds)
        except Exception as exc:
            self.link.failed(exc, "load")
            return 0
        self.stats.loaded_blocks += pinned
        self.stats.load_seconds += time.perf_counter() - started
        return pinned

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # -- saves ---------------------------------------------------------------------------------

    def wait_for_save(self, meta: KvtierMetadata) -> None:
        if meta.prefill_tokens:
            self.clock.stop(meta.prefill_tokens, meta.prefill_context)
        report = self.clock.due()
        if report is not None:
            self.saver.report_prefill(*report)
        if not meta.saves or not self.kv.shard.saves or self.link.down():
            return
        for job in meta.saves:
            self.saver.submit(self._stage(job))

    def _stage(self, job: SaveJob) -> Staged:
        """The job's blocks, every layer, copied out of vLLM's cache: [blocks, block_bytes]."""
        blocks = torch.tensor(job.block_ids, dtype=torch.long)
        page = self.kv.page_bytes
        out = torch.empty((len(job.block_ids), page * len(self.pages)), dtype=torch.uint8)
        for i, src in enumerate(self.pages):
            out[:, i * page:(i + 1) * page] = src[blocks].cpu()
        return Staged(job.req_id, job.keys, job.parent, out)

    def _store(self, staged: Staged) -> None:
        """Stores one staged job (on the save thread, or inline); raises on failure."""
        client = self.link.client()
        if client is None:
            return
        started = time.perf_counter()
        # vLLM's worker runs in inference mode, so the slot rows may be an inference tensor
        # (made by a load): in-place writes to it need inference mode on this thread too
        with torch.inference_mode(), client.store_into(staged.keys, staged.parent) as tx:
            if tx.slot_ids:
                buf = client.slot_buffer()
                if buf is None:
                    raise ConnectionError("the daemon's segment is not mapped")
                rows = self._rows(buf)
                slots = torch.tensor(tx.slot_ids, dtype=torch.long)
                which = torch.tensor([i for i, _ in tx.slots], dtype=torch.long)
                rows[slots, :staged.blocks.shape[1]] = staged.blocks[which]
        self.stats.stored(tx.committed, time.perf_counter() - started)

    def close(self) -> None:
        self.saver.close()
        self.link.close()
