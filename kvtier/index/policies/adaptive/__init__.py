"""kvtier's own policy: adaptive recency/frequency eviction, ghosts, and a learned reuse predictor.

The policy's parts, one file each: `kvtier.index.policies.adaptive.queue` (the eviction queue and
its modes), `kvtier.index.policies.adaptive.minisim` (the miniature simulations that pick the
mode), `kvtier.index.policies.adaptive.predictor` (sketch and learned reuse predictor) and
`kvtier.index.policies.adaptive.policy` (`AdaptivePolicy`, which puts them together).
"""
