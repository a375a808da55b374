"""The connector's worker side: copies between the daemon's DRAM slots (mapped shared memory)
and vLLM's paged KV cache, on each TP rank.

    start_load_kv     for each LoadJob: slots -> vLLM blocks, every layer, then Release the
                      lease (before the forward reads them: the load is synchronous). A copy or
                      Release that fails puts the job's blocks in the load-error set, so vLLM
                      recomputes them (a failed Release means the lease expired or the daemon
                      restarted: what was copied may be stale).
    wait_for_save     for each SaveJob: Allocate (keys already cached are skipped), gather the
                      blocks into the slots, Commit. Runs after the step's forward, so the blocks
                      hold their final KV; errors only lose the store.

Pages: each layer's tensor is vLLM's standardized view [B, H, N, C] (blocks at dim 0); it is
viewed as [B, page_bytes] bytes and a block's page is copied whole (`layout.py` draws the slot).
On CUDA the same indexing copies between host memory and the device (torch copies; the batched
TransferEngine path is not wired here). Threading: vLLM's worker thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvtier._proto import kvtier_pb2 as pb
from kvtier.client.sync_client import SlotBuffer
from kvtier.integrations.vllm.layout import EngineKV, Unsupported
from kvtier.integrations.vllm.link import DaemonLink
from kvtier.integrations.vllm.metadata import KvtierMetadata, LoadJob, SaveJob
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
    """Totals since start; `take()` returns what changed since the previous call."""

    def __init__(self) -> None:
        self.loaded_blocks = 0
        self.failed_blocks = 0
        self.stored_blocks = 0
        self.load_seconds = 0.0
        self.store_seconds = 0.0
        self._reported: dict[str, float] = {}

    def totals(self) -> dict[str, float]:
        return {"loaded_blocks": self.loaded_blocks, "load_failed_blocks": self.failed_blocks,
                "stored_blocks": self.stored_blocks, "load_seconds": self.load_seconds,
                "store_seconds": self.store_seconds}

    def take(self) -> dict[str, float]:
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

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        missing = [n for n in self.kv.layer_names if n not in kv_caches]
        if missing:
            raise Unsupported(f"no KV tensor for layer(s) {missing[:3]}")
        self.pages = [page_view(kv_caches[n], self.kv.page_bytes) for n in self.kv.layer_names]
        self.link.client()  # connect early (a missing daemon is one warning, not an error)

    def _rows(self, buf: SlotBuffer) -> torch.Tensor:
        """The [slots, slot_bytes] tensor over the mapped pool (kept per pool generation)."""
        if self._rows_cache is None or self._rows_cache[0] != buf.generation:
            self._rows_cache = (buf.generation, torch.from_numpy(buf.array()))
        return self._rows_cache[1]

    # -- loads ---------------------------------------------------------------------------------

    def start_load_kv(self, meta: KvtierMetadata) -> None:
        for job in meta.loads:
            self._errors.update(job.failed)
            self.stats.failed_blocks += len(job.failed)
            n = len(job.block_ids) - len(job.failed)
            if n > 0 and not self._load(job, n):
                self._errors.update(job.block_ids[:n])
                self.stats.failed_blocks += n

    def _load(self, job: LoadJob, n: int) -> bool:
        """Copies the job's first n blocks and releases this rank's lease; False on any failure
        (the caller reports the blocks as load errors)."""
        lease = job.leases[self.rank]
        started = time.perf_counter()
        client = self.link.client()
        if client is None:
            return False  # the lease expires on its own
        try:
            buf = client.slot_buffer_for(pb.SegmentInfo.FromString(lease.segment))
            if buf is None:
                client.release(lease.lease_id)
                return False
            rows = self._rows(buf)
            slots = torch.tensor(lease.slots[:n], dtype=torch.long)
            blocks = torch.tensor(job.block_ids[:n], dtype=torch.long)
            src = rows[slots]
            page = self.kv.page_bytes
            for i, dst in enumerate(self.pages):
                dst[blocks] = src[:, i * page:(i + 1) * page].to(dst.device)
            seconds = time.perf_counter() - started
            client.release(lease.lease_id, n * self.kv.block_bytes, seconds)
        except Exception as exc:
            self.link.failed(exc, "load")
            return False
        self.stats.loaded_blocks += n
        self.stats.load_seconds += time.perf_counter() - started
        return True

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # -- saves ---------------------------------------------------------------------------------

    def wait_for_save(self, meta: KvtierMetadata) -> None:
        if not meta.saves or not self.kv.shard.saves:
            return
        for job in meta.saves:
            if not self._save(job):
                return

    def _save(self, job: SaveJob) -> bool:
        """Stores one job; False when the daemon became unreachable (skip the rest)."""
        client = self.link.client()
        if client is None:
            return False
        started = time.perf_counter()
        try:
            with client.store_into(job.keys, job.parent) as tx:
                if tx.slot_ids:
                    buf = client.slot_buffer()
                    if buf is None:
                        raise ConnectionError("the daemon's segment is not mapped")
                    rows = self._rows(buf)
                    slots = torch.tensor(tx.slot_ids, dtype=torch.long)
                    blocks = torch.tensor([job.block_ids[i] for i, _ in tx.slots],
                                          dtype=torch.long)
                    page = self.kv.page_bytes
                    for i, src in enumerate(self.pages):
                        rows[slots, i * page:(i + 1) * page] = src[blocks].cpu()
        except Exception as exc:
            self.link.failed(exc, "store")
            return self.link.client() is not None
        self.stats.stored_blocks += tx.committed
        self.stats.store_seconds += time.perf_counter() - started
        return True

    def close(self) -> None:
        self.link.close()
