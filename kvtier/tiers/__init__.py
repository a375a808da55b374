"""The storage tiers below the engines' GPU pools: the shared-memory DRAM pool, the SSD store
(`tiers/ssd/`), the mover between them and the SSD wear budget."""
