"""Pure vocabulary and math shared by every layer and both sides of the socket: keys, layouts,
presets, sizing, units, cost model, planner, the DRAM segment contract, paths, errors.
No I/O, RPC, storage or GPU library (.importlinter)."""
