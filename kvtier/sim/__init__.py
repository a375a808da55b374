"""`kvtier simulate`: replay request traces through the real prefix index, offline.

Modules: `trace` (the `Request` record, Mooncake JSONL reader), `workloads` (seeded generators),
`ceilings` (infinite cache, Belady MIN), `replay` (the tiered flow over `kvtier.index`), `report`
(table and JSON), `sweep` (hit ratio against capacity, plot). Pure logic except `trace` file reading
and `sweep.plot`.
"""
