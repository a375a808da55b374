"""The prefix index's vocabulary: the `Block` node, its packed bits, results and errors.

The index's key space is a *namespace* (`ns`): the index is generic in its type, `NsT`, any
hashable `Ns` (int or str). The daemon's is `kvtier.daemon.cache.namespaces.Namespace` (tenant
and layout id, a str), the simulator's a small int; each gets its own type back from every
block, journal entry and result (``PrefixIndex[Namespace]``), never a str it must cast.

Kept apart from the index's logic (`kvtier.index.prefix`, `kvtier.index.state`,
`kvtier.index.evict`, `kvtier.index.hbm`); `kvtier.index.prefix` re-exports all of it. See
`kvtier.index.prefix` for the contract.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from kvtier.core.errors import KvtierError
from kvtier.core.types import BlockKey, Tier

Ns = int | str
"""What may name a namespace of the index; the policies and the history hash it (an int is
its own seed, a str's UTF-8 is hashed)."""
NsT = TypeVar("NsT", bound=Ns)

IN_DRAM = 1 << 1
ON_SSD = 1 << 2
Q_DRAM = 1 << 3
Q_SSD = 1 << 4
STORED = IN_DRAM | ON_SSD
QUEUED = Q_DRAM | Q_SSD


SLOT_SHIFT = 8
FLAG_BITS = (1 << SLOT_SHIFT) - 1
HITS_BITS = 16
HITS_MAX = (1 << HITS_BITS) - 1


@dataclass(slots=True, eq=False)
class Block(Generic[NsT]):
    """One cached block of namespace `ns`. Fields are owned by the index (and its queue links
    by the policy).

    Packed to stay small (~110 bytes + key): `flags` holds the residency/queue bits in its low
    byte and ``dram_slot + 1`` above; `stamp` holds the logical time of the last access above
    16 bits and the access count (saturating at 65535) below; `hbm` is a bit mask of replicas.
    """

    key: BlockKey
    ns: NsT
    parent: Block[NsT] | None = field(repr=False)
    children: int = 0
    flags: int = 0
    hbm: int = 0
    pins: int = 0
    stamp: int = 0
    prev: Block[NsT] | None = field(default=None, repr=False)
    next: Block[NsT] | None = field(default=None, repr=False)

    @property
    def dram_slot(self) -> int | None:
        """The DRAM slot id, or None (not in DRAM, or in DRAM without a tracked slot)."""
        slot = (self.flags >> SLOT_SHIFT) - 1
        return None if slot < 0 else slot

    @property
    def hits(self) -> int:
        """Accesses so far: the commit, then one per lookup hit (saturates at 65535)."""
        return self.stamp & HITS_MAX

    @property
    def last(self) -> int:
        """The index's logical clock at the last access."""
        return self.stamp >> HITS_BITS

    @property
    def in_dram(self) -> bool:
        return bool(self.flags & IN_DRAM)

    @property
    def on_ssd(self) -> bool:
        return bool(self.flags & ON_SSD)

    @property
    def parent_key(self) -> BlockKey | None:
        return None if self.parent is None else self.parent.key


class IndexStateError(KvtierError):
    """An index operation that does not apply to the current state; nothing was changed."""


class UnknownBlock(IndexStateError):
    pass


class MissingParent(IndexStateError):
    pass


class DuplicateBlock(IndexStateError):
    pass


class PinnedBlock(IndexStateError):
    pass


class NotEvictable(IndexStateError):
    """Dropping the block's last tier would strand its children."""


class TierFull(IndexStateError):
    pass


class BadSlot(IndexStateError):
    pass


class Reason(enum.Enum):
    DEMOTED = "demoted"
    """DRAM copy dropped; the block stays on SSD with its children reachable."""
    WRITTEN_BACK = "written_back"
    """Like DEMOTED, but the SSD copy is new: the caller writes the bytes from `dram_slot` first."""
    COPY_DROPPED = "copy_dropped"
    """SSD copy dropped; the block stays in DRAM."""
    DROPPED = "dropped"
    """The block left its last tier; the entry is gone."""


EVICTION_COUNTERS = ("dram_demoted", "dram_written_back", "dram_dropped", "ssd_copy_dropped",
                     "ssd_dropped", "removed")
"""Keys of `IndexStats.evictions`: `<tier>_<reason>` of every eviction/drop, and `removed`."""


class Evicted(NamedTuple, Generic[NsT]):
    """What one eviction/drop did to one block in `tier`. `dram_slot`: the DRAM slot freed; None
    if no slot is involved."""

    ns: NsT
    key: BlockKey
    tier: Tier
    reason: Reason
    dram_slot: int | None


class Op(enum.Enum):
    """What a journal entry (`Change`) did to one block's copy in one tier."""

    ADD = "add"
    """A copy now lives in `tier` (insert, promotion, write-back, demotion's SSD copy)."""
    DROP = "drop"
    """The copy in `tier` is gone (eviction, demotion's DRAM copy, drop, remove)."""
    MOVE = "move"
    """The DRAM copy now lives in another slot (`slot`; the pool moved its bytes)."""


class Change(NamedTuple, Generic[NsT]):
    """One entry of the index's journal (`PrefixIndex.take_changes`), in the order the changes
    happened. `slot`: the DRAM slot taken (ADD), freed (DROP) or moved to (MOVE); None when no
    slot is tracked or the tier is SSD. `parent`: the block's parent key (ADD only; None for a
    root and for DROP/MOVE). `old_slot`: the slot a MOVE left (else None)."""

    op: Op
    ns: NsT
    key: BlockKey
    tier: Tier
    slot: int | None
    parent: BlockKey | None = None
    old_slot: int | None = None


class Drops(NamedTuple, Generic[NsT]):
    """One purge's drops from one tier (`PrefixIndex.take_drops`): the blocks of one namespace that
    left `tier`, and (DRAM) the slots they freed, as one entry instead of a `Change` each."""

    ns: NsT
    tier: Tier
    keys: list[BlockKey]
    slots: list[int]
    whole: bool = False
    """Every block of the namespace left the index (nothing of it is cached any more)."""


class Prefix(NamedTuple, Generic[NsT]):
    """The longest cached prefix of a key chain: its blocks and each one's best tier."""

    blocks: list[Block[NsT]]
    tiers: list[Tier]


class IndexStats(NamedTuple):
    entries: int
    dram_blocks: int
    ssd_blocks: int
    hbm_blocks: int
    pinned_blocks: int
    pins: int
    evictable_dram: int
    evictable_ssd: int
    dram_capacity: int | None
    ssd_capacity: int | None
    block_bytes: int | None
    ssd_writes: int
    """SSD copies added by any call (insert, add_tier, demote, write-back)."""
    evictions: dict[str, int]
    """`EVICTION_COUNTERS` -> count."""
    history_size: int = 0
    """Words of the admission history (`kvtier.index.policies.AdmissionHistory`; 0 = off)."""
    history_entries: int = 0
    """Dropped blocks whose access count the history holds now."""
    history_recalled: int = 0
    """Reinserted blocks that got their count back from the history (since the index began)."""
