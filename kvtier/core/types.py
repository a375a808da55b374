"""Small shared vocabulary: tiers and key types. No logic lives here."""

from __future__ import annotations

import enum

BlockKey = bytes
"""A block key: fixed width per hash mode (32 bytes for sha256_cbor, 16 for xxh3_128)."""


class Tier(enum.IntEnum):
    """Where a block's bytes live. Lower value = closer to the GPU = faster."""

    HBM = 0
    DRAM = 1
    SSD = 2
    REMOTE = 3  # the shared store below SSD (Redis/Valkey): other nodes' blocks too

    @property
    def label(self) -> str:
        """Metric label value: 'hbm' | 'dram' | 'ssd' | 'remote'."""
        return self.name.lower()
