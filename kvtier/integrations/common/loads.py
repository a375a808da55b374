"""Loads from the daemon's slots into an engine's paged KV cache (daemon slots -> engine
blocks), one step at a time, after the engine's worker pinned each job's blocks (Acquire):
`start` issues the copies, `wait_layer` makes one layer's copy complete, `finish` makes every
copy complete and ends the leases (Release). The engine's side gives its cache as contiguous
per-block chunks in layer order, `per_layer` to a layer (vLLM's are cut by
`integrations/vllm/pages.py`), and a `Release`; vLLM's connector workers use it.

    LayerLoads   through a `kvtier.gpu.transfer.TransferEngine` over the engine's pages
                 (`KVPool.paged`), backend "auto" (CUDA kernels or batched DMA when the cache
                 is on a GPU, the CPU reference backend otherwise): one LOAD job per layer, all
                 the step's pairs, issued in layer order on the engine's load stream (jobs of
                 one direction run in submission order), so layer i is complete while layers
                 after it are still copying; the first job waits for `after` (the engine's
                 compute stream: vLLM zeroes new blocks there before the loads).
                 `wait_layer(i)` waits for job i only.
    TorchLoads   the synchronous torch copy (`dst[blocks] = rows[slots]` per chunk) within
                 `start`; `wait_layer` has nothing to wait for.

Hybrid models: a lease may name, per KV cache group, its own engine blocks (`Lease.groups`, -1
where that group needs none, as outside a sliding window); each layer's job then copies only its
group's pairs (`layer_groups`: the group of each layer).

A lease is released only once every layer's copy of it completed (`finish`). A pair whose copy
failed in any layer (`ok=False`), every block of a lease whose Release failed (the lease expired
or the daemon restarted: what was copied may be stale), and every block of a step that could not
be issued are returned as failed: the engine's worker reports them as load errors (vLLM
recomputes them). Threading: the engine's worker thread only.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvtier.gpu.plan import Calibration, Direction
from kvtier.gpu.transfer import Backend, KVPool, TransferEngine, TransferHandle, TransferJob

log = logging.getLogger("kvtier.integrations.common")

Release = Callable[[str, int, float], bool]
"""release(lease_id, bytes copied, copy seconds) -> whether the daemon ended the lease."""


@dataclass(frozen=True, slots=True)
class Lease:
    """One job's pinned blocks: slot rows `slots` go to engine blocks `blocks`."""

    lease_id: str
    slots: Sequence[int]
    blocks: Sequence[int]
    groups: tuple[Sequence[int], ...] = ()
    """Hybrid: per group, the engine block of each slot (-1: none); empty: `blocks` for all."""


@dataclass(slots=True)
class Finished:
    """What a step's loads did: blocks loaded, engine blocks failed, seconds of copying, and the
    leases not loaded whole (a failed pair or Release)."""

    loaded: int = 0
    failed: set[int] = field(default_factory=set)
    seconds: float = 0.0
    failed_leases: set[str] = field(default_factory=set)
    nbytes: int = 0
    """Bytes copied into the engine's pages (of the leases released)."""


@dataclass(frozen=True, slots=True)
class LayerPairs:
    """One layer's share of a step: pair indices (into the step's pairs, leases back to back),
    their slots and their engine blocks."""

    sel: np.ndarray
    slots: np.ndarray
    blocks: np.ndarray


def layer_pairs(leases: Sequence[Lease], layer_groups: Sequence[int]
                ) -> tuple[list[LayerPairs], np.ndarray]:
    """Each layer's pairs, and the bytes-per-page count of each lease (pages copied)."""
    slots = np.concatenate([np.asarray(lease.slots, dtype=np.int64) for lease in leases])
    groups = max(layer_groups, default=0) + 1
    per_group = []
    for g in range(groups):
        ids = np.concatenate([np.asarray(lease.groups[g] if lease.groups else lease.blocks,
                                         dtype=np.int64) for lease in leases])
        sel = np.flatnonzero(ids >= 0)
        per_group.append(LayerPairs(sel, slots[sel], ids[sel]))
    owner = np.repeat(np.arange(len(leases)), [len(lease.blocks) for lease in leases])
    pages = np.zeros(len(leases), dtype=np.int64)
    out = []
    for g in layer_groups:
        out.append(per_group[g])
        pages += np.bincount(owner[per_group[g].sel], minlength=len(leases))
    return out, pages


class Loads(Protocol):
    def start(self, rows: Any, generation: int, leases: Sequence[Lease],
              after: object | None = None) -> None: ...
    def wait_layer(self, layer: int) -> None: ...
    def finish(self) -> Finished: ...
    def close(self) -> None: ...


@dataclass(slots=True)
class _Step:
    leases: list[Lease]
    ok: np.ndarray
    """Per pair of the step (leases' pairs back to back): copied in every layer so far."""
    handles: list[TransferHandle | None]
    t0: float
    pages: np.ndarray
    """Per lease, the pages its copies write (over all layers)."""
    layers: list[LayerPairs] = field(default_factory=list)
    failed: set[int] = field(default_factory=set)
    done_at: float = 0.0
    """When the latest layer's copy ended (the CPU backend's own time; on CUDA when seen): the
    copy time the daemon's planner gets is `done_at - t0`, not the forward the leases spanned."""

    @classmethod
    def of(cls, leases: Sequence[Lease], layer_groups: Sequence[int]) -> _Step | None:
        """A step over the leases that have blocks (None when none has)."""
        kept = [lease for lease in leases if len(lease.blocks)]
        if not kept:
            return None
        pairs, pages = layer_pairs(kept, layer_groups)
        n = sum(len(lease.blocks) for lease in kept)
        return cls(kept, np.zeros(n, dtype=np.bool_), [], time.perf_counter(), pages, pairs)


def _finish_leases(step: _Step, release: Release, page_bytes: int) -> Finished:
    """Release every lease of a step whose copies are all collected."""
    out = Finished(failed={b for b in step.failed if b >= 0},
                   seconds=(step.done_at or time.perf_counter()) - step.t0)
    at = 0
    for k, lease in enumerate(step.leases):
        n = len(lease.blocks)
        ok = step.ok[at:at + n]
        at += n
        good = int(ok.sum())
        nbytes = int(step.pages[k]) * page_bytes * good // n
        if not release(lease.lease_id, nbytes, out.seconds):
            out.failed.update(b for b in lease.blocks if b >= 0)
            out.failed_leases.add(lease.lease_id)
            continue
        out.failed.update(b for b, fine in zip(lease.blocks, ok.tolist(), strict=True)
                          if not fine and b >= 0)
        if good < n:
            out.failed_leases.add(lease.lease_id)
        out.loaded += good
        out.nbytes += nbytes
    return out


class LayerLoads:
    """Loads through a TransferEngine, layer by layer (see the module docstring)."""

    def __init__(self, chunks: Sequence[Any], per_layer: int, release: Release, *,
                 backend: str | Backend = "auto", calibration: Calibration | None = None,
                 layer_groups: Sequence[int] = ()) -> None:
        if not chunks or per_layer < 1 or len(chunks) % per_layer:
            raise ValueError(f"{len(chunks)} chunks are not whole layers of {per_layer}")
        self.pool = KVPool.paged(chunks)
        self.geometry = self.pool.geometry()
        self.per_layer = per_layer
        self.layers = len(chunks) // per_layer
        self.layer_groups = list(layer_groups) or [0] * self.layers
        self.release = release
        self.backend = backend
        self.calibration = calibration
        self.block_bytes = self.geometry.payload_bytes
        self.page_bytes = self.block_bytes // self.layers
        self._engine: TransferEngine | None = None
        self._generation: int | None = None
        self._step: _Step | None = None
        self._warned = False

    def calibrate(self) -> None:
        """On CUDA, measure the kernel-vs-DMA choice now (at the engine's start) rather than
        within the first load; a calibration file ($KVTIER_TRANSFER_CALIBRATION) is used as is."""
        if self.calibration is not None or self.pool.device != "cuda":
            return
        env = os.environ.get("KVTIER_TRANSFER_CALIBRATION")
        if env:
            from kvtier.gpu.backend import load_calibration

            self.calibration = load_calibration(env)
            return
        from kvtier.gpu.measure import calibrate_pool

        self.calibration = calibrate_pool(self.geometry)

    def _engine_for(self, rows: Any, generation: int) -> TransferEngine:
        if self._engine is None or self._generation != generation:
            if self._engine is not None:
                self._engine.close()  # the step before was finished: nothing is in flight
                self._engine = None
            self._engine = TransferEngine(self.pool, rows, backend=self.backend,
                                          calibration=self.calibration)
            self._generation = generation
            cal = getattr(self._engine.backend, "calibration", None)
            if cal is not None:
                self.calibration = cal  # measured once, kept across pool generations
        return self._engine

    def start(self, rows: Any, generation: int, leases: Sequence[Lease],
              after: object | None = None) -> None:
        """Issues the copies of `leases` from slot buffer `rows` (the daemon's pool
        `generation`), layer by layer. A step still unfinished is finished first."""
        if self._step is not None:
            raise RuntimeError("the previous step's loads are not finished")
        step = _Step.of(leases, self.layer_groups)
        if step is None:
            return
        pairs = step.layers
        self._step = step
        try:
            engine = self._engine_for(rows, generation)
            step.t0 = time.perf_counter()  # the copy's clock starts at the first submit
            for i, lp in enumerate(pairs):
                if not lp.sel.size:  # this layer's group needs none of the step's blocks
                    step.handles.append(None)
                    continue
                lo = i * self.per_layer
                step.handles.append(engine.submit(TransferJob(
                    Direction.LOAD, lp.slots, lp.blocks, after=after,
                    chunks=(lo, lo + self.per_layer))))
                after = None  # the first job waits for the engine's stream; the rest follow it
        except Exception as exc:  # nothing issued is trusted: the step's blocks are recomputed
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
            log.log(level, "kvtier: loads not issued (%s: %s); recomputing them",
                    type(exc).__name__, exc)
            step.failed.update(int(b) for lease in step.leases for b in lease.blocks)
            step.handles = [h for h in step.handles if h is not None]
            self._drain(step)
            return
        step.ok[:] = True

    def _collect(self, step: _Step, i: int) -> None:
        """Waits for layer i's job, then takes every other finished one (so each layer's end
        is seen about when it happened, not when the forward reached it)."""
        handle = step.handles[i]
        if handle is None:
            return
        assert self._engine is not None
        try:
            results = [self._engine.wait(handle)]
            step.handles[i] = None
            results += self._engine.poll()
        except Exception as exc:
            log.warning("kvtier: waiting for a layer's load failed: %s", exc)
            step.handles[i] = None
            step.ok[:] = False
            return
        for res in results:  # submitted together at t0 (within microseconds)
            step.done_at = max(step.done_at, step.t0 + res.seconds)
            layer = i if res.handle == handle else step.handles.index(res.handle)
            step.handles[layer] = None
            if not res.all_ok:
                log.warning("kvtier: %d of %d blocks failed to load in layer %d (%s); "
                            "recomputing them", int((~res.ok).sum()), res.ok.size, layer,
                            res.error)
            sel = step.layers[layer].sel
            step.ok[sel] &= res.ok

    def _drain(self, step: _Step) -> None:
        """Waits for every issued job of a step that failed midway (their results are void)."""
        for i in range(len(step.handles)):
            self._collect(step, i)
        step.ok[:] = False

    def wait_layer(self, layer: int) -> None:
        """Blocks until layer `layer`'s copy of this step completed (no-op without loads)."""
        step = self._step
        if step is not None and 0 <= layer < len(step.handles):
            self._collect(step, layer)

    def finish(self) -> Finished:
        """Completes every copy of the step, releases its leases; what it did."""
        step, self._step = self._step, None
        if step is None:
            return Finished()
        for i in range(len(step.handles)):
            self._collect(step, i)
        return _finish_leases(step, self.release, self.page_bytes)

    def close(self) -> None:
        if self._step is not None:
            self.finish()
        if self._engine is not None:
            self._engine.close()
            self._engine = None


class TorchLoads:
    """The synchronous torch copy (see the module docstring); chunks are torch tensors."""

    def __init__(self, chunks: Sequence[Any], per_layer: int, release: Release,
                 layer_groups: Sequence[int] = ()) -> None:
        import torch

        self.chunks = list(chunks)
        self.per_layer = per_layer
        self.chunk_bytes = int(self.chunks[0].shape[1])
        self.block_bytes = self.chunk_bytes * len(self.chunks)
        self.layer_groups = list(layer_groups) or [0] * (len(self.chunks) // per_layer)
        self.release = release
        self._torch = torch
        self._step: _Step | None = None

    def start(self, rows: Any, generation: int, leases: Sequence[Lease],
              after: object | None = None) -> None:
        torch = self._torch
        if self._step is not None:
            raise RuntimeError("the previous step's loads are not finished")
        step = _Step.of(leases, self.layer_groups)
        if step is None:
            return
        pairs = step.layers
        self._step = step
        try:
            src_rows = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(rows)
            cb = self.chunk_bytes
            for c, dst in enumerate(self.chunks):
                lp = pairs[c // self.per_layer]
                if not lp.sel.size:
                    continue
                src = src_rows[torch.from_numpy(lp.slots), c * cb:(c + 1) * cb]
                dst[torch.from_numpy(lp.blocks).to(dst.device)] = src.to(dst.device)
        except Exception as exc:
            log.warning("kvtier: load copy failed (%s: %s); recomputing its blocks",
                        type(exc).__name__, exc)
            return
        step.done_at = time.perf_counter()
        step.ok[:] = True

    def wait_layer(self, layer: int) -> None:
        return  # `start` copied every layer

    def finish(self) -> Finished:
        step, self._step = self._step, None
        if step is None:
            return Finished()
        return _finish_leases(step, self.release, self.block_bytes // len(self.layer_groups))

    def close(self) -> None:
        if self._step is not None:
            self.finish()
