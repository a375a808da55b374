"""The connector's scheduler side: which prompt blocks kvtier has, pins them for the step that
loads them, and plans which computed blocks the workers store.

Per request (vLLM calls, in order):

    get_num_new_matched_tokens   Lookup (with the daemon's plan) of vLLM's own block hashes
                                 (`request.block_hashes`: equal to `kvtier.core.keys.block_keys`);
                                 answers the tokens beyond `num_computed_tokens` worth fetching,
                                 at most up to the last full block before the prompt's last token.
                                 Side-effect free (it may be asked again for the same request).
    update_state_after_alloc     Acquire: one lease per TP rank on the blocks to load; blocks the
                                 daemon no longer has become `LoadJob.failed` (vLLM recomputes).
    build_connector_meta         this step's loads, and per scheduled request the full blocks
                                 that are computed by the end of the step and not yet stored.
    request_finished             forgets the request (nothing is held: loads release their
                                 leases in the worker during the step, saves finish within it).

Preemption needs nothing special: a preempted request is allocated again (update_state_after_alloc
resets it), and no lease outlives the step that loads. Leases a worker never released (it died)
expire after their TTL. Any daemon failure: the affected request just gets fewer (or no) tokens
from kvtier. Threading: vLLM's scheduler thread only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.client.sync_client import Client
from kvtier.integrations.vllm.layout import EngineKV, kv_shard
from kvtier.integrations.vllm.link import DaemonLink
from kvtier.integrations.vllm.metadata import KvtierMetadata, LoadJob, RankLease, SaveJob
from kvtier.integrations.vllm.settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass(slots=True)
class _Tracked:
    request: Request
    saved: int
    """Blocks [0, saved) are stored, being loaded, or not to be stored."""
    loaded: tuple[int, list[int]] | None = None
    """(first block, vLLM block ids) of the request's last load."""
    resave: int | None = None
    """A load failed from this block on: once vLLM has rewound the request to it (it
    recomputes from there), the blocks are saved again from there."""


@dataclass(slots=True)
class _Hit:
    computed: int
    keys: list[bytes]
    fetch: int


class CostLog:
    """Seconds the scheduler side spent per request (lookup + acquire), for the benchmark."""

    def __init__(self) -> None:
        self.per_request: dict[str, float] = {}

    def add(self, req_id: str, seconds: float) -> None:
        self.per_request[req_id] = self.per_request.get(req_id, 0.0) + seconds


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, kv: EngineKV, tp_size: int,
                 total_kv_heads: int, replicated: bool) -> None:
        self.settings = settings
        self.bt = kv.block_tokens
        self.rank_shard = [kv_shard(tp_size, r, total_kv_heads, replicated).number
                           for r in range(tp_size)]
        shards = sorted(set(self.rank_shard))
        self.links = {s: DaemonLink(settings, kv.for_shard(
            kv_shard(tp_size, self.rank_shard.index(s), total_kv_heads, replicated)).decl(),
            "scheduler") for s in shards}
        self._tracked: dict[str, _Tracked] = {}
        self._hits: dict[str, _Hit] = {}
        self._loads: list[LoadJob] = []
        self.cost = CostLog()

    def _clients(self) -> dict[int, Client] | None:
        out = {}
        for shard, link in self.links.items():
            c = link.client()
            if c is None:
                return None
            out[shard] = c
        return out

    def _failed(self, exc: BaseException, what: str) -> None:
        for link in self.links.values():
            link.failed(exc, what)

    # -- vLLM's scheduler-side calls ---------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        started = time.perf_counter()
        try:
            return self._match(request, num_computed_tokens), False
        finally:
            self.cost.add(request.request_id, time.perf_counter() - started)

    def _match(self, request: Request, num_computed: int) -> int:
        self._hits.pop(request.request_id, None)
        hashes = request.block_hashes
        usable = min(len(hashes), (request.num_tokens - 1) // self.bt)
        if usable * self.bt <= num_computed:
            return 0
        clients = self._clients()
        if clients is None:
            return 0
        keys: list[bytes] = list(hashes[:usable])  # BlockHash is bytes: no copy
        fetch = usable
        try:
            for client in clients.values():
                found = client.lookup(keys, prompt_tokens=request.num_tokens,
                                      plan=self.settings.use_plan)
                fetch = min(fetch, found.fetch_blocks)
        except Exception as exc:
            self._failed(exc, "Lookup")
            return 0
        if fetch * self.bt <= num_computed:
            return 0
        self._hits[request.request_id] = _Hit(num_computed, keys, fetch)
        return fetch * self.bt - num_computed

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        hit = self._hits.pop(rid, None)
        tracked = self._tracked[rid] = _Tracked(request, 0)
        if num_external_tokens <= 0 or hit is None:
            return
        started = time.perf_counter()
        first = hit.computed // self.bt
        last = min(hit.fetch, first + num_external_tokens // self.bt)
        block_ids = list(blocks.get_block_ids()[0][first:last])
        tracked.saved = last  # not saved in the load's own step, whether or not it loads
        job = self._acquire(rid, hit.keys[:last], first, block_ids)
        tracked.loaded = (first, block_ids)
        if job.failed:
            tracked.resave = last - len(job.failed)
        self._loads.append(job)
        self.cost.add(rid, time.perf_counter() - started)

    def _acquire(self, rid: str, keys: Sequence[bytes], first: int, block_ids: list[int]
                 ) -> LoadJob:
        """Leases on keys[first:] for every rank (acquired from keys[0]: a prefix)."""
        clients = self._clients()
        job = LoadJob(rid, block_ids, [])
        if clients is None:
            job.failed = list(block_ids)
            return job
        pinned = len(block_ids)
        try:
            for shard in self.rank_shard:
                got = clients[shard].acquire(keys)
                job.leases.append(RankLease(got.lease_id, got.slots[first:],
                                            got.segment.SerializeToString()))
                pinned = min(pinned, max(0, got.blocks - first))
        except Exception as exc:
            self._failed(exc, "Acquire")
            self._release(clients, job)
            job.leases, pinned = [], 0
        job.failed = block_ids[pinned:]
        return job

    def _release(self, clients: dict[int, Client], job: LoadJob) -> None:
        for rank, lease in enumerate(job.leases):
            if lease.lease_id:
                try:
                    clients[self.rank_shard[rank]].release(lease.lease_id)
                except Exception as exc:
                    self._failed(exc, "Release")

    def update_connector_output(self, invalid_block_ids: set[int]) -> None:
        """The workers' report of a step: blocks that failed to load are saved again once
        vLLM has recomputed them."""
        if not invalid_block_ids:
            return
        for t in self._tracked.values():
            if t.loaded is None:
                continue
            first, ids = t.loaded
            bad = [i for i, b in enumerate(ids) if b in invalid_block_ids]
            if bad:
                t.resave = min(first + bad[0], t.resave if t.resave is not None else 1 << 62)

    def build_connector_meta(self, out: SchedulerOutput) -> KvtierMetadata:
        for t in self._tracked.values():
            if t.resave is not None and t.request.num_computed_tokens <= t.resave * self.bt:
                t.saved = min(t.saved, t.resave)  # vLLM rewound the request: recomputing
                t.resave = None
        meta = KvtierMetadata(loads=self._loads)
        self._loads = []
        if self.settings.store:
            meta.saves = self._saves(out)
        return meta

    def _saves(self, out: SchedulerOutput) -> list[SaveJob]:
        saves = []
        state = out.kv_connector_block_state
        for rid, n in out.num_scheduled_tokens.items():
            t = self._tracked.get(rid)
            if t is None:
                continue
            r = t.request
            full = min((r.num_computed_tokens + n) // self.bt, len(r.block_hashes))
            if full <= t.saved:
                continue
            ids = state.get_block_ids(rid) if state is not None else None
            if ids is None or len(ids[0]) < full:
                continue
            keys = [bytes(h) for h in r.block_hashes[t.saved:full]]
            parent = bytes(r.block_hashes[t.saved - 1]) if t.saved else b""
            saves.append(SaveJob(rid, list(ids[0][t.saved:full]), keys, parent))
            t.saved = full
        return saves

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        return False, None

    def close(self) -> None:
        for link in self.links.values():
            link.close()
