"""kvtier's own policy: exactly LRU until miniature simulations resolve that another mode hits more.

The other modes: an S3-FIFO-like probation/main order with a learned reuse predictor, LRU behind a
reuse filter, and LFU. The parts, one file each: `kvtier.index.policies.adaptive.queue` (the
eviction queue and its modes), `kvtier.index.policies.adaptive.minisim` (the miniature simulations
and the switching rule), `kvtier.index.policies.adaptive.predictor` (frequency sketch and reuse
predictor) and `kvtier.index.policies.adaptive.policy` (`AdaptivePolicy`, which puts them
together).
"""
