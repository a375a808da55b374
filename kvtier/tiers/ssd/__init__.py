"""The SSD tier: an LMDB index of verified 64-byte headers plus payloads in a preallocated slot
file (`store.SsdStore` is the entry point)."""
