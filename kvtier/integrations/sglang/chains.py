"""SGLang's page keys as kvtier block keys, and the chains they form. Pure.

SGLang names a page by a hex SHA-256 string chained over the pages before it (`get_hash_str`),
so a key already covers its whole prefix: it becomes the kvtier key as its 32 bytes. Any other
string (another key scheme) is hashed to 32 bytes. kvtier's index keeps chains that start at
a prompt's first page: a Lookup, Acquire or Allocate names the chain from there. SGLang's v1
calls pass the keys before a batch (`extra_info.prefix_keys`, with
`hicache_storage_pass_prefix_keys`); its generic calls pass none, so `ChainMemory` remembers
each page's parent from the calls that did carry a prefix (and from the batches themselves).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

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

    def remember(self, chain: Sequence[bytes], parent: bytes = b"") -> None:
        """`chain` is consecutive pages after `parent` (b"": it starts a prompt)."""
        if not self.capacity:
            return
        prev = parent
        for key in chain:
            self._parent[key] = prev
            self._parent.move_to_end(key)
            prev = key
        while len(self._parent) > self.capacity:
            self._parent.popitem(last=False)

    def parent(self, key: bytes) -> bytes:
        """The remembered parent of `key`; b"" when it starts a prompt or is unknown."""
        return self._parent.get(key, b"")

    def prefix(self, key: bytes) -> list[bytes]:
        """The remembered pages before `key`, from the prompt's first; [] when `key` starts a
        prompt or the chain is not known back to its first page (a page was forgotten)."""
        out: list[bytes] = []
        p = self._parent.get(key, b"")
        while p:
            if p not in self._parent or len(out) > len(self._parent):
                return []
            out.append(p)
            p = self._parent[p]
        out.reverse()
        return out
