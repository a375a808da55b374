"""The engine's paged KV pool: per-layer K and V tensors and a refcounted free-block allocator.

Layout (vLLM flash-attn style, kvtier transfer layout (a)):

    k[layer], v[layer] : [num_blocks, block_tokens, kv_heads, head_dim]

so one block's KV is 2 · layers separate chunks of block_tokens · kv_heads · head_dim elements.
Block ids are row indices into those tensors. A block may be shared by several sequences (a prefix);
it returns to the free list when its last reference is dropped. Not thread-safe: one engine thread
owns the pool.
"""

from __future__ import annotations

import torch

from kvtier.engine.config import ModelConfig


class PoolExhausted(RuntimeError):
    """Not enough free blocks for a request; nothing was allocated."""


class KVPool:
    def __init__(self, config: ModelConfig, num_blocks: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        shape = (num_blocks, config.block_tokens, config.kv_heads, config.head_dim)
        self.block_tokens = config.block_tokens
        self.num_blocks = num_blocks
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.layers)]
        self._refs = [0] * num_blocks
        # LIFO free list: recently freed blocks are reused first (warm in cache).
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks with refcount 1, or PoolExhausted with nothing allocated."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise PoolExhausted(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        """Take one more reference on each (already allocated) block."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
        for b in blocks:
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference on each block; a block with no references left is free again."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def gather_tokens(self, layer: int, blocks: list[int], num_tokens: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [num_tokens, kv_heads, d] of the first `num_tokens` tokens stored in `blocks`."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.k[layer].device)
        k = self.k[layer].index_select(0, idx).flatten(0, 1)[:num_tokens]
        v = self.v[layer].index_select(0, idx).flatten(0, 1)[:num_tokens]
        return k, v
