"""Replay a trace across a fleet: N nodes, an optional shared remote tier, and a router.

Each node is a `kvtier.sim.replay.Node` (its own real index and the daemon's placement planner,
DRAM and SSD at the same `TierConfig`), so a fleet of one node is `replay` exactly. Requests are
served in trace order; for each one the router picks a node, the node serves it (Lookup, Acquire,
Allocate + Commit, Release), and the fleet's bookkeeping is updated:

Shared remote tier (`RemoteStore`, optional): one store below every node, as the daemon's remote
tier with `remote_admit_after` 1 — every node writes each block it commits, a node whose local
prefix ends before the chain does fetches the blocks the store holds after it (`Node`). The
store evicts least-recently-used first at its capacity, where Redis's `allkeys-lru` samples an
approximate LRU; an existence check (EXISTS) is no access, a fetch (GET) and a write (SET) are.
Each node writes through its own byte-rate budget (`remote_write_bytes_per_s`, kvtier serve's
setting; a burst of one second's, at least one block) on the trace's clock, and drops what the
budget refuses, as the daemon does; no write queue: a write the budget allows is in the store at
once. Bytes over the network are the blocks fetched and written, times the block size.

Load (what least-loaded balances and prefix-aware breaks ties on): each node prefills at
`prefill_tokens_per_s`, first come first served. A request adds its missed tokens (prompt tokens
after the blocks it hit) to its node's backlog, which drains at that rate on the trace's clock;
a node's load when a request arrives is its backlog then (queued prefill tokens). Only the
router uses this clock: the caches are served one request at a time, as in `replay`.

Routers:

* ``round-robin``: request i goes to node i mod N. Blind to content and load.
* ``least-loaded``: the node with the smallest backlog; ties to the fewest requests so far, then
  the lowest node number.
* ``prefix-aware``: the router's view of each node is the set of blocks the node holds in DRAM
  or on SSD, learnt from the node's residency events (its index's journal: a block is in the view
  from the event adding its first tier until the event dropping its last, as the daemon's
  BlockStored/BlockRemoved stream says), each event visible `event_lag_s` after the request that
  caused it (events of a request are stamped with its arrival time; with lag 0 the next request
  sees them). Among the eligible nodes it picks the one whose view holds the longest prefix of
  the request's blocks; ties go as least-loaded. Eligible (the load-balance guard): a node whose
  request count after this request stays within `balance` x the mean, i.e. count + 1 <=
  max(balance x (assigned + 1) / N, smallest count + 1), so at every point of the trace the
  busiest node has at most max(balance x mean, smallest + 1) requests and the final imbalance
  (max / mean requests per node) is at most `balance` once the trace has a few requests per node.
  The shared remote tier is in no node's view: it is reachable from every node alike.

Ceilings (`ceilings`): per node, the infinite cache and Belady MIN of the requests routed to it at
the node's own DRAM + SSD capacity (no remote tier); for the fleet, Belady MIN of the whole trace
at the fleet's total capacity (N x (DRAM + SSD) + remote). No fleet beats the latter: the blocks
its nodes and store hold together are at most that many, and a request hits only blocks among
them, so one pooled cache holding their union does at least as well (`kvtier.sim.ceilings`).

Prefill seconds saved (`planner_saving`): the daemon's fetch-vs-recompute planner
(`kvtier.core.planner.plan`) priced on the tiers each request's hits came from, its
`saved_s` summed — what the daemon's `kvtier_plan_saved_prefill_seconds` counts.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvtier.core.costmodel import CostModel
from kvtier.core.planner import PlanRates, Prefix, plan
from kvtier.core.types import Tier
from kvtier.index.types import Op
from kvtier.sim.ceilings import belady, infinite_hits
from kvtier.sim.config import ReplayStats, TierConfig
from kvtier.sim.replay import Node, new_index
from kvtier.sim.trace import TRACE_BLOCK_TOKENS, Request

ROUTINGS = ("round-robin", "least-loaded", "prefix-aware")
DEFAULT_BALANCE = 1.25
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
_PROGRESS_EVERY = 256

Saving = Callable[[Sequence[Tier], int], float]
"""Prefill seconds a request saves: (tiers of its hit blocks, prompt tokens) -> seconds."""


class RemoteStore:
    """The shared remote tier: keys only, least-recently-used out at `capacity` blocks."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"remote capacity must be >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self.reads = self.writes = self.evicted = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def present(self, keys: Sequence[bytes], start: int) -> int:
        """How many of `keys[start:]`, from the first, the store holds (EXISTS: no access)."""
        held, n = self._keys, 0
        for k in keys[start:]:
            if k not in held:
                break
            n += 1
        return n

    def fetch(self, key: bytes) -> None:
        """A read of a held block (GET): it becomes the most recently used."""
        self._keys.move_to_end(key)
        self.reads += 1

    def store(self, key: bytes) -> None:
        """A write (SET): the block is the most recently used; the least recent go for room."""
        self.writes += 1
        keys = self._keys
        if key in keys:
            keys.move_to_end(key)
            return
        if not self.capacity:
            return
        keys[key] = None
        while len(keys) > self.capacity:
            keys.popitem(last=False)
            self.evicted += 1


class FleetConfig(NamedTuple):
    """A fleet: `nodes` nodes each with `tiers`, the router, and what it sees and balances."""

    tiers: TierConfig
    nodes: int
    routing: str
    remote_blocks: int = 0
    event_lag_s: float = 0.0
    balance: float = DEFAULT_BALANCE
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    remote_write_bytes_per_s: float | None = None
    block_bytes: int = 0
    """One block's bytes, the cost of a remote write under `remote_write_bytes_per_s` (None:
    no budget, every write is made)."""

    def check(self) -> None:
        """`ValueError` naming the first field out of range."""
        if self.nodes < 1:
            raise ValueError(f"a fleet needs >= 1 node, got {self.nodes}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r} (one of {', '.join(ROUTINGS)})")
        if self.remote_blocks < 0:
            raise ValueError(f"remote capacity must be >= 0 blocks, got {self.remote_blocks}")
        if not (self.event_lag_s >= 0 and math.isfinite(self.event_lag_s)):
            raise ValueError(f"event lag must be a finite number of seconds >= 0, got "
                             f"{self.event_lag_s}")
        if not self.balance >= 1:
            raise ValueError(f"balance must be >= 1 (x the mean), got {self.balance}")
        if self.remote_write_bytes_per_s is not None and not (
                self.remote_write_bytes_per_s > 0 and self.block_bytes > 0):
            raise ValueError("a remote write budget needs a rate > 0 and the block's bytes")
        if not (self.prefill_tokens_per_s > 0 and math.isfinite(self.prefill_tokens_per_s)):
            raise ValueError(f"prefill rate must be > 0 tokens/s, got "
                             f"{self.prefill_tokens_per_s}")


class NodeResult(NamedTuple):
    """One node after the replay: its replay counters, the prompt tokens it had to prefill,
    its largest backlog (seconds of prefill queued when a request arrived, that request's
    included) and the planner's prefill seconds saved (None without a cost model)."""

    stats: ReplayStats
    missed_tokens: int
    peak_backlog_s: float
    saved_s: float | None


class FleetResult(NamedTuple):
    """A fleet replay: per node results, the node each request went to (trace order), the
    remote store's counters (blocks read, written, evicted, and the writes the nodes' budgets
    dropped; None without one)."""

    config: FleetConfig
    nodes: list[NodeResult]
    assignment: list[int]
    remote_reads: int | None
    remote_writes: int | None
    remote_evicted: int | None
    remote_dropped: int | None
    seconds: float
    cpu_seconds: float

    @property
    def requests_per_node(self) -> list[int]:
        return [n.stats.requests for n in self.nodes]

    @property
    def imbalance(self) -> float:
        """Max / mean requests per node (1.0 = even)."""
        counts = self.requests_per_node
        total = sum(counts)
        return max(counts) * len(counts) / total if total else 1.0

    @property
    def work_imbalance(self) -> float:
        """Max / mean prompt tokens prefilled per node."""
        work = [n.missed_tokens for n in self.nodes]
        total = sum(work)
        return max(work) * len(work) / total if total else 1.0


class _View:
    """The router's view of each node's contents, fed by the nodes' residency events after a
    lag: per node, block key -> tiers holding it (a key with none is not in the view)."""

    def __init__(self, nodes: int, lag_ms: float) -> None:
        self.held: list[dict[bytes, int]] = [{} for _ in range(nodes)]
        self.lag_ms = lag_ms
        self._pending: deque[tuple[float, int, list[tuple[bytes, int]]]] = deque()

    def publish(self, node: int, at_ms: float, changes: list[tuple[bytes, int]]) -> None:
        if not changes:
            return
        if self.lag_ms:
            self._pending.append((at_ms + self.lag_ms, node, changes))
        else:
            self._apply(node, changes)

    def advance(self, now_ms: float) -> None:
        """Applies every event visible at `now_ms` (published at least the lag ago)."""
        pending = self._pending
        while pending and pending[0][0] <= now_ms:
            _, node, changes = pending.popleft()
            self._apply(node, changes)

    def _apply(self, node: int, changes: list[tuple[bytes, int]]) -> None:
        held = self.held[node]
        for key, delta in changes:
            n = held.get(key, 0) + delta
            if n > 0:
                held[key] = n
            else:
                held.pop(key, None)

    def prefix(self, node: int, keys: Sequence[bytes]) -> int:
        held, n = self.held[node], 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n


def _events(node: Node) -> list[tuple[bytes, int]]:
    """The node's residency changes since the last call, as (key, +1 added / -1 dropped)."""
    out = []
    for c in node.index.take_changes():
        if c.op is Op.ADD:
            out.append((c.key, 1))
        elif c.op is Op.DROP:
            out.append((c.key, -1))
    return out


def replay_fleet(
    requests: Sequence[Request],
    fleet: FleetConfig,
    saving: Saving | None = None,
    progress: Callable[[int], None] | None = None,
) -> FleetResult:
    """Route and serve `requests` over the fleet (module docstring). `saving` prices each
    request's hits in prefill seconds (`planner_saving`); `progress(n)` as in `replay`."""
    fleet.check()
    n_nodes, routing = fleet.nodes, fleet.routing
    remote = RemoteStore(fleet.remote_blocks) if fleet.remote_blocks else None
    aware = routing == "prefix-aware"
    rate = fleet.remote_write_bytes_per_s
    budget = None if remote is None or rate is None else (rate, fleet.block_bytes)
    nodes = [Node(fleet.tiers, new_index(fleet.tiers, journal=aware), remote=remote,
                  remote_budget=budget) for _ in range(n_nodes)]
    view = _View(n_nodes, fleet.event_lag_s * 1000.0) if aware else None
    rate_ms = fleet.prefill_tokens_per_s / 1000.0
    backlog = [0.0] * n_nodes
    peak = [0.0] * n_nodes
    counts = [0] * n_nodes
    missed = [0] * n_nodes
    saved = [0.0] * n_nodes
    assignment: list[int] = []
    last_ms = 0.0
    balance = fleet.balance
    t0, c0 = time.perf_counter(), time.process_time()
    for i, req in enumerate(requests):
        now = req.timestamp
        drained = (now - last_ms) * rate_ms
        if drained > 0:
            for n in range(n_nodes):
                backlog[n] = max(0.0, backlog[n] - drained)
            last_ms = now
        if routing == "round-robin":
            pick = i % n_nodes
        elif view is None:
            pick = min(range(n_nodes), key=lambda n: (backlog[n], counts[n], n))
        else:
            view.advance(now)
            cap = max(balance * (i + 1) / n_nodes, min(counts) + 1)
            keys = [h.to_bytes(8, "big") for h in req.hash_ids]
            pick = min((n for n in range(n_nodes) if counts[n] + 1 <= cap),
                       key=lambda n: (-view.prefix(n, keys), backlog[n], counts[n], n))
        node = nodes[pick]
        served = node.serve(req)
        if view is not None:
            view.publish(pick, now, _events(node))
        hit_tokens = len(served.tiers) * TRACE_BLOCK_TOKENS
        work = max(0, req.input_length - hit_tokens)
        counts[pick] += 1
        missed[pick] += work
        backlog[pick] += work
        peak[pick] = max(peak[pick], backlog[pick])
        if saving is not None and served.tiers:
            saved[pick] += saving(served.tiers, req.input_length)
        assignment.append(pick)
        if progress is not None and (i + 1) % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if progress is not None and len(requests) % _PROGRESS_EVERY:
        progress(len(requests) % _PROGRESS_EVERY)
    per_node = [
        NodeResult(nd.stats(), missed[n], peak[n] / fleet.prefill_tokens_per_s,
                   None if saving is None else saved[n])
        for n, nd in enumerate(nodes)
    ]
    return FleetResult(
        fleet, per_node, assignment,
        None if remote is None else remote.reads,
        None if remote is None else remote.writes,
        None if remote is None else remote.evicted,
        None if remote is None else sum(n.remote_writes_dropped for n in nodes),
        seconds, cpu,
    )


class NodeCeiling(NamedTuple):
    """Prefix hits of the infinite cache and of Belady MIN on one node's requests."""

    infinite_hits: int
    belady_hits: int


def ceilings(requests: Sequence[Request], result: FleetResult) -> tuple[list[NodeCeiling], int]:
    """Per node: infinite and Belady MIN (at the node's DRAM + SSD) on the requests routed to it;
    and Belady MIN of the whole trace at the fleet's total capacity (module docstring)."""
    cfg = result.config
    mine: list[list[Request]] = [[] for _ in range(cfg.nodes)]
    for req, n in zip(requests, result.assignment, strict=True):
        mine[n].append(req)
    cap = cfg.tiers.total_blocks
    per_node = [NodeCeiling(infinite_hits(rs), belady(rs, cap).prefix_hits) for rs in mine]
    pooled = belady(requests, cfg.nodes * cap + cfg.remote_blocks).prefix_hits
    return per_node, pooled


def planner_saving(cost: CostModel, rates: PlanRates, block_bytes: int) -> Saving:
    """Prefill seconds the daemon's planner predicts a request saves (`Plan.saved_s`): its hit
    blocks priced at the tiers they came from (`block_bytes` each, one rank's share), the rest
    of the prompt as the suffix every cut computes."""

    def saved(tiers: Sequence[Tier], prompt_tokens: int) -> float:
        prefix = Prefix.uniform(bytes(tiers), TRACE_BLOCK_TOKENS, block_bytes)
        suffix = max(0, prompt_tokens - len(tiers) * TRACE_BLOCK_TOKENS)
        return plan(prefix, cost, rates, suffix_tokens=suffix).saved_s

    return saved
