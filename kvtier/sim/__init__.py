"""`kvtier simulate`: replay request traces through the real prefix index, offline.

Modules: `trace` (the `Request` record, Mooncake JSONL reader), `workloads` (seeded generators),
`ceilings` (hit rule, infinite cache, Belady MIN), `config` (`TierConfig`, `ReplayStats`),
`replay` (the daemon's flow over `kvtier.index.prefix` and `kvtier.index.placement`),
`capacity` (blocks or bytes), `report` (table and JSON), `sweep` (hit ratio against capacity,
plot), `progress` (tqdm bar). Pure logic except `trace` file reading and `sweep.plot`.
"""
