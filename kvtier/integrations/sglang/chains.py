"""SGLang's page keys as kvtier block keys, and the chains they form. Pure.

SGLang names a page by a hex SHA-256 string chained over the pages before it (`get_hash_str`),
so a key already covers its whole prefix: it becomes the kvtier key as its 32 bytes. Any other
string (another key scheme) is hashed to 32 bytes. kvtier's index keeps chains that start at
a prompt's first page: a Lookup, Acquire or Allocate names the chain from there. SGLang's v1
calls pass the keys before a batch (`extra_info.prefix_keys`, with
`hicache_storage_pass_prefix_keys`); its generic calls pass none, so `ChainMemory` remembers
each page's parent from the calls that did carry a prefix (SGLang asks `batch_exists` for a
prompt's pages before it stores them). A page whose chain is not known is never stored: under
a wrong parent it could never be hit, and it would block the right chain (one payload per
key).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from itertools import pairwise

KEY_BYTES = 32


def page_key(key: str) -> bytes:
    if len(key) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.sha256(b"sglang-key\x00" + key.encode()).digest()


def page_keys(keys: Sequence[str]) -> list[bytes]:
    return [page_key(k) for k in keys]


class ChainMemory:
    """key -> parent key for the last `capacity` keys seen (least recently seen dropped first).
    Not thread-safe; the backend calls it under its lock."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._parent: OrderedDict[bytes, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._parent)

    def remember(self, chain: Sequence[bytes], parent: bytes | None = b"") -> None:
        """`chain` is consecutive pages after `parent` (b"": it starts a prompt; None: not
        known, so only the links inside `chain` are learnt)."""
        if not self.capacity or not chain:
            return
        if parent is not None:
            self._put(chain[0], parent)
        for prev, key in pairwise(chain):
            self._put(key, prev)
        while len(self._parent) > self.capacity:
            self._parent.popitem(last=False)

    def _put(self, key: bytes, parent: bytes) -> None:
        self._parent[key] = parent
        self._parent.move_to_end(key)

    def parent(self, key: bytes) -> bytes | None:
        """The remembered parent of `key` (b"": it starts a prompt); None when not known."""
        return self._parent.get(key)

    def prefix(self, key: bytes) -> list[bytes] | None:
        """The pages before `key`, from the prompt's first ([]: `key` starts a prompt); None
        when the chain is not known back to a prompt's first page (never seen, forgotten)."""
        out: list[bytes] = []
        p = self._parent.get(key)
        while p:
            if len(out) > len(self._parent):
                return None  # a cycle: impossible for chained hashes, never looped on
            out.append(p)
            p = self._parent.get(p)
        if p is None:
            return None
        out.reverse()
        return out
