"""The engine side of the socket: sync and asyncio clients, layout declarations and the mapping
of the daemon's DRAM pool. Imports core, gpu and the protocol only, never daemon or tiers."""
