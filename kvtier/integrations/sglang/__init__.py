"""kvtier as SGLang's HiCache L3 storage backend: `--hicache-storage-backend dynamic` with
`module_path` "kvtier.integrations.sglang.backend" and `class_name` "KvtierStorage" (see
`backend.py` and docs/sglang.md).

Only `backend.py` imports SGLang; the other modules here (settings, chains, pool, layout,
store) import without it."""
