"""The reference engine: sequences over a paged pool, chunked prefill from a cached prefix, decode.

Bit-exactness (fp32 and bf16 alike): prefill always runs in chunks of exactly `block_tokens`
positions aligned to block boundaries, so chunk j covers positions [j·B, (j+1)·B) (the last chunk
may be shorter). A prefill that resumes after k cached blocks runs chunks k, k+1, ... with the same
shapes, the same inputs and the same kernels as a prefill from scratch runs them; and block j's K/V
is a function of tokens [0, (j+1)·B) only, computed the same way whatever the prompt's length. So
the logits and every stored block equal full recompute bit for bit, on any device whose kernels are
deterministic for a given shape (CPU; CUDA without atomics-based split-K). We do not rely on GEMMs
being row-independent: MKL, for one, gives different last bits for the same row when a matmul has
fewer than 16 rows. Decode runs one position at a time; its K/V differ in the last bits from a
chunked prefill of the same tokens, so only prefill-computed full blocks are offered for storage
(`Sequence.prefilled_blocks`).

    prompt:    |  block 0  |  block 1  |  block 2  | blk 3 ..|
    cached:    |<-- k = 2 loaded ----->|
    computed:                          | chunk 2   | chunk 3 |   -> logits of the last position
    storable:  |<----------- prefilled full blocks ----->|
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvtier.engine.config import ModelConfig
from kvtier.engine.kvpool import KVPool
from kvtier.engine.model import Transformer


@dataclass(slots=True)
class Sequence:
    """One request's state. `token_ids[i]`'s K/V live in `block_table[i // B]` at row i % B.

    `prefilled_blocks`: how many leading full blocks hold prefill-computed (or loaded) K/V.
    """

    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    prefilled_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class PrefillResult(NamedTuple):
    logits: torch.Tensor
    """fp32 [vocab] on CPU: the next-token distribution after the last prompt token."""
    reused_tokens: int
    computed_tokens: int
    seconds: float


class _PrefillSink:
    """Writes each chunk's K/V into the pool and a per-layer staging copy of the whole prompt."""

    def __init__(self, pool: KVPool, seq: Sequence, total: int) -> None:
        self.pool, self.seq = pool, seq
        n0 = seq.num_tokens
        self.k_stage: list[torch.Tensor] = []
        self.v_stage: list[torch.Tensor] = []
        proto = pool.k[0]
        shape = (total, *proto.shape[2:])
        for layer in range(len(pool.k)):
            ks = torch.empty(shape, dtype=proto.dtype, device=proto.device)
            vs = torch.empty(shape, dtype=proto.dtype, device=proto.device)
            if n0:
                k0, v0 = pool.gather_tokens(layer, seq.block_table[: n0 // pool.block_tokens], n0)
                ks[:n0] = k0
                vs[:n0] = v0
            self.k_stage.append(ks)
            self.v_stage.append(vs)
        self.start = n0

    def exchange(self, layer: int, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        s, c = self.start, k.shape[0]
        block = self.seq.block_table[s // self.pool.block_tokens]
        self.pool.k[layer][block, :c] = k
        self.pool.v[layer][block, :c] = v
        self.k_stage[layer][s:s + c] = k
        self.v_stage[layer][s:s + c] = v
        return self.k_stage[layer][: s + c], self.v_stage[layer][: s + c]


class _DecodeSink:
    def __init__(self, pool: KVPool, seq: Sequence) -> None:
        self.pool, self.seq = pool, seq
        self.pos = seq.num_tokens

    def exchange(self, layer: int, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        bt = self.pool.block_tokens
        block, row = self.seq.block_table[self.pos // bt], self.pos % bt
        self.pool.k[layer][block, row] = k[0]
        self.pool.v[layer][block, row] = v[0]
        return self.pool.gather_tokens(layer, self.seq.block_table, self.pos + 1)


class Engine:
    """Model + pool. Single-threaded: one caller drives all sequences of an engine."""

    def __init__(self, config: ModelConfig, num_blocks: int,
                 device: torch.device | str = "cpu") -> None:
        self.config = config
        self.model = Transformer(config, device)
        self.device = self.model.device
        self.pool = KVPool(config, num_blocks, self.device, self.model.dtype)

    @property
    def block_tokens(self) -> int:
        return self.config.block_tokens

    def adopt(self, token_ids: list[int], blocks: list[int]) -> Sequence:
        """A sequence whose prefix K/V the caller has already written into `blocks` (allocated from
        this pool; the sequence takes over those references). len(token_ids) = len(blocks) · B."""
        if len(token_ids) != len(blocks) * self.block_tokens:
            raise ValueError(f"{len(token_ids)} tokens do not fill {len(blocks)} blocks exactly")
        return Sequence(list(token_ids), list(blocks), len(blocks))

    def fork(self, seq: Sequence, num_blocks: int) -> Sequence:
        """A new sequence sharing the first `num_blocks` prefilled blocks of `seq` (no copy)."""
        if not 0 <= num_blocks <= seq.prefilled_blocks:
            raise ValueError(f"can share 0..{seq.prefilled_blocks} blocks, not {num_blocks}")
        shared = seq.block_table[:num_blocks]
        self.pool.share(shared)
        return Sequence(seq.token_ids[: num_blocks * self.block_tokens], shared, num_blocks)

    def release(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table.clear()
        seq.token_ids.clear()
        seq.prefilled_blocks = 0

    def _check_tokens(self, tokens: list[int]) -> None:
        vocab = self.config.vocab_size
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} outside the vocabulary [0, {vocab})")

    def _grow(self, seq: Sequence, total_tokens: int) -> None:
        bt = self.block_tokens
        need = -(-total_tokens // bt) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need))

    def prefill(self, seq: Sequence, prompt: list[int]) -> PrefillResult:
        """Compute the prompt positions after the sequence's cached prefix; logits of the last one.

        Requires: seq.token_ids is a prefix of `prompt` ending on a block boundary and shorter than
        the prompt (at least one position is computed). Raises PoolExhausted (nothing changed) when
        the pool cannot hold the prompt.
        """
        bt, n0 = self.block_tokens, seq.num_tokens
        if n0 % bt or n0 != seq.prefilled_blocks * bt:
            raise ValueError("a cached prefix must be whole prefilled blocks")
        if n0 >= len(prompt):
            raise ValueError(f"cached prefix ({n0} tokens) leaves nothing of a {len(prompt)}-token "
                             "prompt to compute")
        if prompt[:n0] != seq.token_ids:
            raise ValueError("the sequence's cached tokens are not a prefix of the prompt")
        if len(prompt) > self.config.max_positions:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds max_positions "
                             f"{self.config.max_positions}")
        self._check_tokens(prompt[n0:])
        t0 = time.perf_counter()
        self._grow(seq, len(prompt))
        ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
        sink = _PrefillSink(self.pool, seq, len(prompt))
        with torch.inference_mode():
            for start in range(n0, len(prompt), bt):
                sink.start = start
                hidden = self.model.forward(ids[start:start + bt], start, sink)
            logits = self.model.logits(hidden[-1:]).cpu()
        seq.token_ids = list(prompt)
        seq.prefilled_blocks = len(prompt) // bt
        return PrefillResult(logits, n0, len(prompt) - n0, time.perf_counter() - t0)

    def decode(self, seq: Sequence, token: int) -> torch.Tensor:
        """Append one token; fp32 logits [vocab] on CPU for the position after it."""
        self._check_tokens([token])
        if seq.num_tokens == 0:
            raise ValueError("decode needs a prefilled sequence")
        if seq.num_tokens >= self.config.max_positions:
            raise ValueError(f"sequence reached max_positions {self.config.max_positions}")
        self._grow(seq, seq.num_tokens + 1)
        ids = torch.tensor([token], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            hidden = self.model.forward(ids, seq.num_tokens, _DecodeSink(self.pool, seq))
            logits = self.model.logits(hidden).cpu()
        seq.token_ids.append(token)
        return logits

    def greedy(self, seq: Sequence, first: torch.Tensor, max_new_tokens: int
               ) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy continuation from prefill logits `first`: new tokens and each step's logits."""
        tokens: list[int] = []
        steps: list[torch.Tensor] = []
        logits = first
        for _ in range(max_new_tokens):
            tok = int(torch.argmax(logits).item())
            tokens.append(tok)
            if len(tokens) == max_new_tokens or seq.num_tokens >= self.config.max_positions:
                break
            logits = self.decode(seq, tok)
            steps.append(logits)
        return tokens, steps
