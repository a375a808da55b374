"""The prefix index the daemon and the simulator run: (namespace, key) -> block, residency per
tier, leaf-first eviction and admission policies. Pure (.importlinter)."""
