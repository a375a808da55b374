"""`kvtier simulate`: replay request traces through the real prefix index, offline.

Modules: `trace` (the `Request` record, Mooncake JSONL reader), `workloads` (seeded generators),
`ceilings` (hit rule, infinite cache, Belady MIN), `config` (`TierConfig`, `ReplayStats`),
`replay` (the daemon's flow over `kvtier.index.prefix` and `kvtier.index.placement`: one `Node`),
`fleet` (N nodes, a shared remote tier and a router; `fleet_report` its table, JSON and plot),
`capacity` (blocks or bytes), `report` (table and JSON), `sweep` (hit ratio against capacity,
plot), `progress` (tqdm bar). Pure logic except `trace` file reading and `sweep.plot`.
"""
