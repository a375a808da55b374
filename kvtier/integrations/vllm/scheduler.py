"""The connector's scheduler side: which prompt blocks kvtier has, and which computed blocks the
workers store. It never waits for the daemon on vLLM's scheduler thread (`async_lookup`).

Per request (vLLM calls, in order):

    get_num_new_matched_tokens   Lookup (with the daemon's plan) of vLLM's own block hashes
                                 (`request.block_hashes`: equal to `kvtier.core.keys.block_keys`),
                                 on a background thread (`common/lookup.py`): until its answer
                                 is in, vLLM is told "not known yet" (None) and asks again next
                                 step.
                                 Answers the tokens beyond `num_computed_tokens` worth fetching,
                                 at most up to the last full block before the prompt's last token.
                                 Side-effect free for vLLM (asking again gives the same answer).
    update_state_after_alloc     records the load (keys, vLLM block ids) for the workers; no RPC:
                                 each worker Acquires its own layout's blocks in `start_load_kv`,
                                 and blocks gone by then are load errors (vLLM recomputes them).
    build_connector_meta         this step's loads, per scheduled request the full blocks that
                                 are computed by the end of the step and not yet stored, and the
                                 step's prefill shape (for the prefill rate the workers measure).
    request_finished             forgets the request (nothing is held: loads release their
                                 leases in the worker during the step, saves copy the blocks
                                 out within it); with a pin hint, pins its cached blocks.

Hints (`common/hints.py`, the request's `kv_transfer_params["kvtier"]`, read once per request):
`prefetch` runs a Prefetch before the request's Lookup (on the lookup thread); `store: false`
gives the request no saves; `pin_s` pins the request's full blocks (prompt and output) for that
long, at `request_finished` what is cached by then (on the lookup thread), and in the workers
after each of its saves commits what the chain holds up to it (`SaveJob.pin_s`, in order with
the saves on the save thread: a block committed after the request finished is pinned too).

Hybrid models (several KV cache groups or a sliding window, `EngineKV.hybrid`): one kvtier block
holds every group's pages for one block, keyed by vLLM's block hash at its end (`hash_step`
hashes per block), so one Lookup answers for every group. A load fills, per group, the blocks
that group needs: a full group all of them, a sliding group the last `window_blocks` before the
hit point that vLLM allocated (it hands the null block for the others, which are never written).
Such loads are asynchronous (vLLM then takes a failure per request and recomputes the whole
prompt: block-level rewinds are refused with several groups, and could not rebuild a window).
A save stores only blocks every group holds (not the null block): blocks vLLM's own prefix cache
had, out of a window, are not stored again (they were stored when computed).

Recurrent state (Mamba / linear attention, `EngineKV.stateful`): a hit must end on a boundary
whose state block (`EngineKV.state_key`) is held (`Lookups` with `ends`); the load fills the
attention groups' blocks up to the cut from the chain and, from the state block, the attention
pages of the cut's last block and each state group's block there (vLLM allocates the state group
one real block, at the cut's last block; the others are the null block). Saves: the chain blocks
as above (the state groups not asked to hold them: their pages there are not meaningful), and
for each block-aligned state vLLM offers (`boundary_state_offloads`: the exact state blocks,
computed by the end of the step) the state block of that boundary.

Roles (`settings.Role`, from vLLM's `kv_role`): a producer answers 0 to every
`get_num_new_matched_tokens` (no Lookup), a consumer's metadata never carries a save; a
consumer's Lookups wait for blocks being written (`common/lookup.py`, `wait_s`).

Shadow verification (`verify_sample`): a sampled request's hit (`sampled`: a fixed function of
its id) is answered 0: vLLM computes the prompt as if nothing were cached, and its saves of the
hit's blocks carry a `VerifyRef`: the worker compares the computed blocks with the daemon's bytes
for the same keys before storing (`worker.py`), and the daemon quarantines a block that differs.

Preemption needs nothing special: a preempted request is allocated again (update_state_after_alloc
resets it), and no lease outlives the step that loads. Leases a worker never released (it died)
expire after their TTL. Any daemon failure: the affected request just gets fewer (or no) tokens
from kvtier. Threading: vLLM's scheduler thread, plus the lookup thread of `common/lookup.py`.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.integrations.common.hints import Hints, parse_hints
from kvtier.integrations.common.link import DaemonLink
from kvtier.integrations.common.lookup import Lookups
from kvtier.integrations.vllm.layout import EngineKV, kv_shard
from kvtier.integrations.vllm.metadata import KvtierMetadata, LoadJob, SaveJob, VerifyRef
from kvtier.integrations.vllm.settings import ConnectorSettings, Role, role_of

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

NULL_BLOCK = 0
"""vLLM's null block (the block pool's first): what a group holds where it keeps nothing."""

MIN_PREFILL_SAMPLE = 128
"""A step's prefill is timed for the planner only when it computes at least this many tokens."""


@dataclass(slots=True)
class _Tracked:
    request: Request
    saved: int
    """Blocks [0, saved) are stored, being loaded, or not to be stored. When vLLM rewinds the
    request below it (a load failed: it recomputes from the first bad block), it drops to the
    rewound point, so the recomputed blocks are saved again."""
    verify: _Verify | None = None
    """Shadow verification: the hit this request did not load, compared at its saves."""


@dataclass(slots=True)
class _Verify:
    keys: list[bytes]
    """The hit's chain keys (blocks [0, fetch))."""
    fetch: int


@dataclass(slots=True)
class _Hit:
    computed: int
    keys: list[bytes]
    fetch: int


class CostLog:
    """Seconds the scheduler side spent on vLLM's thread per live request (forgotten when it
    finishes)."""

    def __init__(self) -> None:
        self.per_request: dict[str, float] = {}

    def add(self, req_id: str, seconds: float) -> None:
        self.per_request[req_id] = self.per_request.get(req_id, 0.0) + seconds


LOOKUP_THREADS_WAITING = 4
"""Lookup threads of a connector whose Lookups may wait (a consumer's)."""


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, kv: EngineKV, tp_size: int,
                 total_kv_heads: int, replicated: bool, role: Role | None = None) -> None:
        self.settings = settings
        self.role = role = role or role_of("kv_both", settings)
        self.kv = kv
        self.bt = kv.block_tokens
        self.step = kv.hash_step()
        rank_shard = [kv_shard(tp_size, r, total_kv_heads, replicated).number
                      for r in range(tp_size)]
        self.links = [DaemonLink(settings, kv.for_shard(
            kv_shard(tp_size, rank_shard.index(s), total_kv_heads, replicated)).decl(),
            "scheduler") for s in sorted(set(rank_shard))]
        self.lookups = Lookups(self.links, role.use_plan, settings.async_lookup, role.wait_s,
                               LOOKUP_THREADS_WAITING if role.wait_s else 1)
        self._tracked: dict[str, _Tracked] = {}
        self._hints: dict[str, Hints] = {}
        self._hits: dict[str, _Hit] = {}
        self._verify: dict[str, _Verify] = {}
        self._loads: list[LoadJob] = []
        self.cost = CostLog()

    # -- vLLM's scheduler-side calls ---------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if not self.role.loads:
            return 0, False
        started = time.perf_counter()
        try:
            n = self._match(request, num_computed_tokens)
            return n, bool(n) and self.kv.hybrid  # hybrid loads are asynchronous
        finally:
            self.cost.add(request.request_id, time.perf_counter() - started)

    def _match(self, request: Request, num_computed: int) -> int | None:
        rid = request.request_id
        self._hits.pop(rid, None)
        self._verify.pop(rid, None)
        usable = min(len(request.block_hashes) // self.step, (request.num_tokens - 1) // self.bt)
        if usable * self.bt <= num_computed:
            return 0
        keys = self._keys(request, 0, usable)
        ends = [self.kv.state_key(k) for k in keys] if self.kv.stateful else None
        fetch = self.lookups.fetch_blocks(rid, keys, request.num_tokens, ends,
                                          prefetch=self.hints(request).prefetch)
        if fetch is None:
            return None  # the Lookup is running: vLLM asks again next step
        if fetch * self.bt <= num_computed:
            return 0
        if self.sampled(rid):  # shadow verification: computed, and compared at its saves
            self._verify[rid] = _Verify(keys[:fetch], fetch)
            return 0
        if ends is not None:  # the hit's last block is the state block of its boundary
            keys = [*keys[:fetch - 1], ends[fetch - 1]]
        self._hits[rid] = _Hit(num_computed, keys, fetch)
        return fetch * self.bt - num_computed

    def hints(self, request: Request) -> Hints:
        """The request's kvtier hints (`common/hints.py`), read once per request."""
        h = self._hints.get(request.request_id)
        if h is None:
            h = self._hints[request.request_id] = parse_hints(
                request.kv_transfer_params, f"request {request.request_id}")
        return h

    def sampled(self, req_id: str) -> bool:
        """Whether request `req_id`'s hit is verified instead of loaded: a fixed function of the
        id (vLLM asking again, or after preemption, gets the same answer), true for a
        `verify_sample` fraction of ids."""
        rate = self.settings.verify_sample
        if rate <= 0.0:
            return False
        digest = hashlib.sha256(b"kvtier-verify\0" + req_id.encode()).digest()
        return int.from_bytes(digest[:8], "big") < rate * 2**64

    def _keys(self, request: Request, start: int, stop: int) -> list[bytes]:
        """The kvtier keys of blocks [start, stop): vLLM's hash at each block's end."""
        hashes = request.block_hashes
        if self.step == 1:
            return [bytes(h) for h in hashes[start:stop]]
        return [bytes(hashes[(i + 1) * self.step - 1]) for i in range(start, stop)]

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        hit = self._hits.pop(rid, None)
        verify = self._verify.pop(rid, None)
        self.lookups.forget(rid)  # a later ask (after preemption) looks up afresh
        tracked = self._tracked.get(rid)
        if tracked is None or tracked.request is not request:
            # (kept when vLLM allocates again for the same request: after its asynchronous
            # load, or after preemption, whose rewind `build_connector_meta` catches)
            tracked = self._tracked[rid] = _Tracked(request, 0)
        if verify is not None:
            tracked.verify = verify
        if num_external_tokens <= 0 or hit is None:
            return
        started = time.perf_counter()
        first = hit.computed // self.bt
        last = min(hit.fetch, first + num_external_tokens // self.bt)
        tracked.saved = last  # not saved in the load's own step, whether or not it loads
        if self.kv.hybrid:
            groups = self._load_groups(blocks, first, last)
            keys = hit.keys[:last]
            if self.kv.stateful and last != hit.fetch:
                keys = []  # no state at that cut: the load fails, vLLM computes the request
            job = LoadJob(rid, groups[0], keys, first, groups)
        else:
            job = LoadJob(rid, list(blocks.get_block_ids()[0][first:last]), hit.keys[:last],
                          first)
        self._loads.append(job)
        self.cost.add(rid, time.perf_counter() - started)

    def _load_groups(self, blocks: KVCacheBlocks, first: int, last: int
                     ) -> tuple[list[int], ...]:
        """Per group, the vLLM block to fill for each of blocks [first, last), -1 for none: a
        sliding group fills only its window before `last`, and never vLLM's null block."""
        out = []
        for g, group in enumerate(blocks.blocks[:len(self.kv.windows)]):
            win = 1 if self.kv.is_state(g) else self.kv.window_blocks(g)
            lo = max(first, last - win) if win else first
            out.append([-1 if j < lo or group[j].is_null else group[j].block_id
                        for j in range(first, last)])
        return tuple(out)

    def build_connector_meta(self, out: SchedulerOutput) -> KvtierMetadata:
        for t in self._tracked.values():
            computed = t.request.num_computed_tokens // self.bt
            if computed < t.saved:
                t.saved = computed  # rewound after a load error: recomputing from there
        meta = KvtierMetadata(loads=self._loads)
        self._loads = []
        if self.role.stores:
            meta.saves = self._saves(out)
        if not meta.loads and len(out.num_scheduled_tokens) == 1:
            self._prefill_shape(out, meta)
        return meta

    def _prefill_shape(self, out: SchedulerOutput, meta: KvtierMetadata) -> None:
        """A step that computes one request's prompt chunk and nothing else: its size and
        context, so the workers can time it (the planner's prefill rate)."""
        ((rid, n),) = out.num_scheduled_tokens.items()
        t = self._tracked.get(rid)
        if t is None or n < MIN_PREFILL_SAMPLE:
            return
        r = t.request
        if r.num_computed_tokens + n <= r.num_prompt_tokens:
            meta.prefill_tokens, meta.prefill_context = n, r.num_computed_tokens

    def _saves(self, out: SchedulerOutput) -> list[SaveJob]:
        saves = []
        state = out.kv_connector_block_state
        for rid, n in out.num_scheduled_tokens.items():
            t = self._tracked.get(rid)
            if t is None:
                continue
            r = t.request
            hints = self.hints(r)
            if not hints.store:
                continue  # the request's hint: store nothing of it
            full = min((r.num_computed_tokens + n) // self.bt, len(r.block_hashes))
            if full <= t.saved:
                continue
            ids = state.get_block_ids(rid) if state is not None else None
            if ids is None or any(len(g) < full for g in ids[:len(self.kv.windows)]):
                continue
            start = t.saved
            groups: tuple[list[int], ...] = ()
            if self.kv.hybrid:
                groups = tuple(list(g[start:full]) for g in ids[:len(self.kv.windows)])
                # a block some group holds as vLLM's null block (out of a window, from vLLM's
                # own prefix cache) cannot be stored: store from after the last such block
                # (state groups: their pages in chain blocks are never loaded)
                attn = [g for i, g in enumerate(groups) if not self.kv.is_state(i)]
                held = [all(g[j] != NULL_BLOCK for g in attn) for j in range(full - start)]
                skip = next((j + 1 for j in range(len(held) - 1, -1, -1) if not held[j]), 0)
                start += skip
                groups = tuple(g[skip:] for g in groups)
            t.saved = full
            if start == full:
                continue
            keys = self._keys(r, start, full)
            parent = self._keys(r, start - 1, start)[0] if start else b""
            pin = (hints.pin_s, self._keys(r, 0, full)) if hints.pin_s else (0.0, [])
            v = t.verify
            check = (VerifyRef(v.keys[:min(full, v.fetch)], start)
                     if v is not None and start < v.fetch else None)
            saves.append(SaveJob(rid, groups[0] if groups else list(ids[0][start:full]), keys,
                                 parent, groups, *pin, verify=check))
        if self.kv.stateful and state is not None:
            saves += self._state_saves(out, state)
        return saves

    def _state_saves(self, out: SchedulerOutput, state: Any) -> list[SaveJob]:
        """The state blocks of the block-aligned boundaries whose states vLLM offers this step
        (every state group's, computed by the end of the step), after the step's chain saves
        (their parent is the chain block before the boundary's block)."""
        saves = []
        groups = len(self.kv.windows)
        for rid, entries in state.boundary_state_offloads.items():
            t = self._tracked.get(rid)
            ids = state.get_block_ids(rid)
            if t is None or ids is None or not self.hints(t.request).store:
                continue
            r = t.request
            done = r.num_computed_tokens + out.num_scheduled_tokens.get(rid, 0)
            for c, held in state_boundaries(entries, self.bt, groups).items():
                if (c > len(r.block_hashes) // self.step or c * self.bt > done
                        or set(held) != {g for g in range(groups) if self.kv.is_state(g)}):
                    continue
                per = tuple([held[g]] if self.kv.is_state(g) else [ids[g][c - 1]]
                            for g in range(groups))
                if any(p[0] == NULL_BLOCK for p in per):
                    continue
                key = self.kv.state_key(self._keys(r, c - 1, c)[0])
                parent = self._keys(r, c - 2, c - 1)[0] if c > 1 else b""
                v = t.verify
                check = (VerifyRef([*v.keys[:c - 1], key], c - 1, state=True)
                         if v is not None and c <= v.fetch else None)
                saves.append(SaveJob(rid, per[0], [key], parent, per, verify=check))
        return saves

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        hints = self._hints.pop(request.request_id, None)
        if hints is not None and hints.pin_s:
            # what is cached now (its saves pin what they store after it: `SaveJob.pin_s`)
            keys = self._keys(request, 0, len(request.block_hashes) // self.step)
            if keys:
                self.lookups.submit(lambda: self.lookups.pin(keys, hints.pin_s))
        self._tracked.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        self._verify.pop(request.request_id, None)
        self.lookups.forget(request.request_id)
        self.cost.per_request.pop(request.request_id, None)
        return False, None

    def close(self) -> None:
        self.lookups.close()
        for link in self.links:
            link.close()


def state_boundaries(entries: list[tuple[int, int, int]], block_tokens: int, groups: int
                     ) -> dict[int, dict[int, int]]:
    """vLLM's boundary-state offers of one request ((group, block id, boundary tokens)) by
    block-aligned boundary (in blocks): {boundary: {group: block id}}; offers at a boundary
    inside a block (vLLM's partial tails) and of groups beyond `groups` are dropped."""
    out: dict[int, dict[int, int]] = {}
    for g, block, tokens in entries:
        if tokens > 0 and tokens % block_tokens == 0 and 0 <= g < groups:
            out.setdefault(tokens // block_tokens, {})[g] = block
    return out
