"""Eviction and admission policies of the prefix index, one per file, behind a lazy registry.

    base.py          the `Policy` contract, the queues' building blocks, and ``lru`` (the base)
    slru.py          ``slru``
    arc.py           ``vllm-arc``            reuse_filter.py  ``vllm-reuse``
    lfu.py           ``sglang-lfu``, ``lmcache-lfu``
    hicache.py       ``sglang-hicache``      s3fifo.py        ``lmcache-s3fifo``
    sieve.py         ``sieve``
    adaptive/        ``kvtier``: its queue, mini simulations and reuse predictor

`POLICIES` maps each name to where its class lives and where it comes from; `make_policy` imports
a policy's module only when one is made, so a process that runs LRU never loads the others.
`DEFAULT_POLICY` is what the daemon and the simulator use unless told otherwise; docs/benchmarks.md
has the measurements that chose it (``python -m bench.policies``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple, cast

if TYPE_CHECKING:
    from kvtier.index.policies.base import Policy


class PolicyInfo(NamedTuple):
    module: str
    """The module (under `kvtier.index.policies`) that defines the class..."""
    cls: str
    """...and the class's name."""
    source: str
    """Where it comes from, in a few words (the modules' docstrings have the details)."""

    def factory(self) -> type[Policy]:
        """The policy's class (its module imported on first use)."""
        mod = importlib.import_module(f"{__name__}.{self.module}")
        return cast("type[Policy]", getattr(mod, self.cls))


POLICIES: dict[str, PolicyInfo] = {
    "lru": PolicyInfo("base", "Policy", "leaf-first LRU: vLLM CPU offload, SGLang radix cache and "
                      "LMCache LRU under the index's rule"),
    "slru": PolicyInfo("slru", "SlruPolicy", "kvtier segmented LRU (probation / protected 80%)"),
    "vllm-arc": PolicyInfo("arc", "ArcPolicy", "vLLM kv_offload ARCCachePolicy"),
    "vllm-reuse": PolicyInfo("reuse_filter", "ReuseFilterPolicy", "vLLM "
                             "FilterReusedOffloadingManager over LRU: store after 2 lookups"),
    "sglang-lfu": PolicyInfo("lfu", "LfuPolicy", "SGLang LFUStrategy (hit_count, "
                             "last_access_time); the same order as LMCache LFU"),
    "lmcache-lfu": PolicyInfo("lfu", "LfuPolicy", "LMCache LFUCachePolicy (frequency buckets, "
                              "FIFO inside); the same order as SGLang LFU"),
    "sglang-hicache": PolicyInfo("hicache", "HiCachePolicy", "SGLang HiCache "
                                 "write_through_selective: store on the 2nd hit, LRU eviction"),
    "lmcache-s3fifo": PolicyInfo("s3fifo", "S3FifoPolicy", "LMCache S3FIFOCachePolicy (S 10%, M, "
                                 "ghosts)"),
    "sieve": PolicyInfo("sieve", "SievePolicy", "SIEVE (NSDI 2024): FIFO + visited bit + hand"),
    "kvtier": PolicyInfo("adaptive.policy", "AdaptivePolicy", "kvtier adaptive P/M eviction + "
                         "learned reuse predictor for DRAM and SSD admission"),
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
    p = info.factory()(dram_blocks, ssd_blocks, admission_k)
    p.name = name
    return p
