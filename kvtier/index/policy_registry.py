"""Policy names -> policies, for the index, the daemon's ``--policy`` and ``kvtier simulate``.

`kvtier.index.policies` has the contract (`Policy`) and the base LRU; `kvtier.index.policy_peers`
the peers' policies with where each comes from; `kvtier.index.policy_adaptive` kvtier's own.
`DEFAULT_POLICY` is what the daemon and the simulator use unless told otherwise; docs/benchmarks.md
has the measurements that chose it (``python -m bench.policies``).
"""

from __future__ import annotations

from typing import NamedTuple

from kvtier.index.policies import Policy, SlruPolicy
from kvtier.index.policy_adaptive import AdaptivePolicy
from kvtier.index.policy_peers import (
    ArcPolicy,
    HiCachePolicy,
    LfuPolicy,
    ReuseFilterPolicy,
    S3FifoPolicy,
    SievePolicy,
)


class PolicyInfo(NamedTuple):
    factory: type[Policy]
    source: str
    """Where it comes from, in a few words (the module docstrings have the details)."""


POLICIES: dict[str, PolicyInfo] = {
    "lru": PolicyInfo(Policy, "leaf-first LRU: vLLM CPU offload, SGLang radix cache and LMCache "
                      "LRU under the index's rule"),
    "slru": PolicyInfo(SlruPolicy, "kvtier segmented LRU (probation / protected 80%)"),
    "vllm-arc": PolicyInfo(ArcPolicy, "vLLM kv_offload ARCCachePolicy"),
    "vllm-reuse": PolicyInfo(ReuseFilterPolicy, "vLLM FilterReusedOffloadingManager over LRU: "
                             "store after 2 lookups"),
    "sglang-lfu": PolicyInfo(LfuPolicy, "SGLang LFUStrategy (hit_count, last_access_time); "
                             "the same order as LMCache LFU"),
    "lmcache-lfu": PolicyInfo(LfuPolicy, "LMCache LFUCachePolicy (frequency buckets, FIFO "
                              "inside); the same order as SGLang LFU"),
    "sglang-hicache": PolicyInfo(HiCachePolicy, "SGLang HiCache write_through_selective: store "
                                 "on the 2nd hit, LRU eviction"),
    "lmcache-s3fifo": PolicyInfo(S3FifoPolicy, "LMCache S3FIFOCachePolicy (S 10%, M, ghosts)"),
    "sieve": PolicyInfo(SievePolicy, "SIEVE (NSDI 2024): FIFO + visited bit + hand"),
    "kvtier": PolicyInfo(AdaptivePolicy, "kvtier adaptive P/M eviction + learned reuse "
                         "predictor for DRAM and SSD admission"),
}
"""Every selectable policy. `lmcache-lfu` is `sglang-lfu` (one queue); the bench runs it once."""

PEERS = ("lru", "vllm-arc", "vllm-reuse", "sglang-lfu", "sglang-hicache", "lmcache-s3fifo",
         "sieve")
"""The peers' policies that kvtier's is measured against (LRU stands for all three LRUs)."""

DEFAULT_POLICY = "kvtier"
"""Chosen by `bench.policies` (docs/benchmarks.md, "Policies, second pass"): never more than 0.7%
below LRU in any cell, the best geometric mean over LRU of all policies, and in the daemon a
1,024-block Lookup within a few percent of LRU's (`bench.daemon --quick`, KVTIER_POLICY=lru vs
kvtier). `lru` and the peers' policies stay selectable (`--policy`)."""


def make_policy(name: str, dram_blocks: int | None, ssd_blocks: int | None,
                admission_k: int) -> Policy:
    info = POLICIES.get(name)
    if info is None:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown eviction policy {name!r} (known: {known})")
    p = info.factory(dram_blocks, ssd_blocks, admission_k)
    p.name = name
    return p
