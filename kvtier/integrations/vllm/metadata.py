"""What the scheduler-side connector hands the workers each step (pickled with the step).

    LoadJob   fill `block_ids` (vLLM blocks) with the blocks of keys[first:]: each rank
              Acquires `keys` (a prefix from the prompt's first block) on its own layout,
              copies what it pinned and reports the rest through
              `get_block_ids_with_load_errors`, so vLLM recomputes them.
              Hybrid models (`groups` given): per KV cache group its own vLLM blocks
              (-1 where the group needs none: outside a sliding window); the load is
              asynchronous and succeeds or fails per request (`get_finished`).
    SaveJob   store vLLM blocks `block_ids` under `keys` (a chain after `parent`), computed by
              the end of this step; hybrid models: per group its blocks (`groups`); with the
              request's pin hint, then pin its chain up to them (`pin_s`, `chain`). With
              `verify` (shadow verification: a hit the scheduler did not load), first compare
              them with the bytes the daemon holds for the same keys.
    prefill_tokens / prefill_context
              the step's scheduled prompt tokens and the cached context they attend to (summed
              over requests), for the prefill rate the workers measure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(slots=True)
class LoadJob:
    req_id: str
    block_ids: list[int]
    """vLLM blocks of keys[first], keys[first + 1], ..."""
    keys: list[bytes]
    first: int
    groups: tuple[list[int], ...] = ()
    """Hybrid: per KV cache group, its vLLM block for each of keys[first:], -1 for none
    (`block_ids` is then group 0's list: one entry per block)."""


@dataclass(slots=True)
class VerifyRef:
    """What a save compares (`worker.py`): Acquire `chain` (from the prompt's first block);
    the job's block j is chain position `first + j` (those the daemon holds). `state`: the job
    is a state block (its state layers' states are compared too)."""

    chain: list[bytes]
    first: int
    state: bool = False


@dataclass(slots=True)
class SaveJob:
    req_id: str
    block_ids: list[int]
    keys: list[bytes]
    parent: bytes
    groups: tuple[list[int], ...] = ()
    """Hybrid: per KV cache group, its vLLM block for each key (every one a real block)."""
    pin_s: float = 0.0
    """The request's pin hint: once these blocks are committed, pin `chain` this long."""
    chain: list[bytes] = field(default_factory=list)
    """With `pin_s`: the request's keys from its first block to this job's last."""
    verify: VerifyRef | None = None


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    prefill_tokens: int = 0
    prefill_context: int = 0
