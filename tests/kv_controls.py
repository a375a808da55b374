"""Negative controls for the engine tests: wrong bytes stored under the right keys.

An end-to-end test that compares an engine's output with a reference proves the loaded KV right
only if wrong KV would change the output. These helpers make wrong KV from right KV, block by
block, in the connector's slot layout (`kvtier.integrations.vllm.layout`: the layers' pages back
to back; a page holds K then V):

    other_prompt    another prompt's blocks (right format, wrong content)
    layers_swapped  the first two layers' pages exchanged
    k_v_swapped     the two halves of every page (K and V) exchanged
    random          random bytes of the same size (bf16 noise of a plausible scale)

The test stores them into a daemon under the right keys (`plant`, on a daemon that does not hold
those keys yet: a fresh or restarted one) and asserts that the engine then answers differently
from the reference (`differs`), beside the check that the right bytes answer the same.

TOLERANCE is the largest first-token logprob distance
(`tests.support.vllm_engine.logprob_distance`) a right load may show. Measured on the tests'
model (2 layers, hidden 256, std 0.02 weights) with the steps of `test_vllm_connector.py`'s
controls, 2026-12-01: a right load from kvtier moved the first token's top-5 logprobs by 0.0 at
300, 700 and 2100 tokens (bit-identical: the loaded pages are the computed ones); the same
prompt with its first 16 tokens changed moved them by 0.135, 0.086, 0.058 (300, 700, 2100
tokens), another prompt ending in the same token by 0.43-0.12; the four wrong-KV variants at 700
tokens by 0.20-0.57 (and every greedy token differed). 0.02 sits below every changed context and
above every right load.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvtier.client.decl import LayoutDecl
from kvtier.client.sync_client import Client
from tests.support.vllm_engine import LOGPROB_TOLERANCE, logprob_distance

VARIANTS = ("other_prompt", "layers_swapped", "k_v_swapped", "random")
TOLERANCE = LOGPROB_TOLERANCE


def read_blocks(socket: Path, layout: LayoutDecl, keys: Sequence[bytes]) -> list[bytes]:
    """The daemon's bytes of every key (all must be stored)."""
    with Client(socket, layout=layout) as kv, kv.load(keys) as got:
        assert len(got.views) == len(keys), f"{len(got.views)} of {len(keys)} blocks stored"
        return [bytes(v) for v in got.views]


def plant(socket: Path, layout: LayoutDecl, keys: Sequence[bytes], blocks: Sequence[bytes]
          ) -> None:
    """Stores `blocks` under `keys` (the daemon must not hold them yet: it keeps what it has)."""
    with Client(socket, layout=layout) as kv:
        kv.store(list(keys), [np.frombuffer(b, np.uint8) for b in blocks])
        assert kv.lookup(list(keys)).hit_blocks == len(keys), "planted blocks not all stored"


def corrupt(kind: str, blocks: Sequence[bytes], other: Sequence[bytes], page_bytes: int,
            seed: int = 0) -> list[bytes]:
    """`blocks` made wrong in the way `kind` (one of VARIANTS) names; `other`: another prompt's
    blocks, at least as many (for "other_prompt")."""
    if kind == "other_prompt":
        assert len(other) >= len(blocks)
        return [bytes(b) for b in other[: len(blocks)]]
    if kind == "layers_swapped":
        p = page_bytes
        return [b[p: 2 * p] + b[:p] + b[2 * p:] for b in blocks]
    if kind == "k_v_swapped":
        h = page_bytes // 2
        return [b"".join(b[i + h: i + 2 * h] + b[i: i + h] for i in range(0, len(b), page_bytes))
                for b in blocks]
    if kind == "random":
        rng = np.random.default_rng(random.Random(seed).getrandbits(32))
        out = []
        for b in blocks:
            like = np.frombuffer(b, np.uint16).view(np.dtype("<u2"))
            scale = float(np.std(_bf16_to_f32(like))) or 1.0
            noise = rng.standard_normal(like.size).astype(np.float32) * scale
            out.append((noise.view(np.uint32) >> 16).astype(np.uint16).tobytes())
        return out
    raise ValueError(f"unknown variant {kind!r}; one of {VARIANTS}")


def _bf16_to_f32(u16: np.ndarray) -> np.ndarray:  # type: ignore[type-arg]
    return (u16.astype(np.uint32) << 16).view(np.float32)


def differs(got_tokens: Sequence[int], got_logprobs: dict[int, float],
            ref_tokens: Sequence[int], ref_logprobs: dict[int, float]) -> bool:
    """Whether an output is not the reference's: other greedy tokens, or first-token logprobs
    further than TOLERANCE."""
    return (list(got_tokens) != list(ref_tokens)
            or logprob_distance(got_logprobs, ref_logprobs) > TOLERANCE)


def same(got_tokens: Sequence[int], got_logprobs: dict[int, float],
         ref_tokens: Sequence[int], ref_logprobs: dict[int, float]) -> bool:
    """Whether an output is the reference's: the same greedy tokens and first-token logprobs
    within TOLERANCE."""
    return not differs(got_tokens, got_logprobs, ref_tokens, ref_logprobs)


def same_up_to_ties(got_tokens: Sequence[int], got_steps: Sequence[dict[int, float]],
                    ref_tokens: Sequence[int], ref_steps: Sequence[dict[int, float]]) -> bool:
    """Whether a long greedy output is the reference's up to bf16 numerics of another batch
    split, chunking or preemption: at every step up to the first differing token (the same
    context on both sides) the top logprobs within TOLERANCE, and at that token a tie: each
    side's choice within TOLERANCE of the other side's top logprob. (Random-weights models have
    many near-ties: the same KV computed in other splits flips one and the outputs part there;
    wrong KV moves the logprobs past TOLERANCE at the first step.)"""
    n = len(ref_tokens)
    if len(got_tokens) != n or len(got_steps) != n or len(ref_steps) != n or n == 0:
        return False
    part = next((j for j in range(n) if got_tokens[j] != ref_tokens[j]), n)
    if any(logprob_distance(got_steps[j], ref_steps[j]) > TOLERANCE
           for j in range(min(part + 1, n))):
        return False
    if part == n:
        return True
    g, r = got_steps[part], ref_steps[part]
    return (max(r.values()) - r.get(got_tokens[part], -float("inf")) <= TOLERANCE
            and max(g.values()) - g.get(ref_tokens[part], -float("inf")) <= TOLERANCE)


def early_tokens_changed(tokens: Sequence[int], n: int = 16, seed: int = 7) -> list[int]:
    """`tokens` with its first `n` replaced (the oracle check: another context)."""
    rng = random.Random(seed)
    out = list(tokens)
    for i in range(n):
        out[i] = 3 + (out[i] - 3 + rng.randrange(1, 990)) % 997
    return out
