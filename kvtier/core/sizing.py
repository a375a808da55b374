"""Capacity math for a paged KV pool and the host tiers. Pure: no I/O, no printing.

Engine behaviour modelled: vLLM v1's KV cache manager (vLLM 0.32, `vllm/v1/core/kv_cache_utils.py`
`_get_kv_cache_groups_uniform_page_size`, `single_type_kv_cache_manager.py`, `kv_cache_interface.py`
and `platforms/interface.py` `_align_hybrid_block_size`):

- Layers are bucketed by cache kind (full, MLA, each distinct sliding window, recurrent). Every
  bucket is cut into ceil(count / group_size) groups, layer i of the bucket going to group
  i mod n (so the padding spreads over the groups): group_size is the smallest bucket's layer
  count, or the largest's when max < 1.5 x min (vLLM's heuristic). A model with a single kind
  has one group of all its layers.
- A model with recurrent (Mamba / linear-attention) layers gets a block size at least
  a x ceil(state page / (a x attention page per token)), a = max(16, block size) (the attention
  kernel's block alignment), so an attention page holds a state page; the state page is padded
  to it (`hybrid_block_tokens`).
- One page holds `block_tokens` tokens of one group, so all groups share one page size:
  page_bytes = block_tokens x group_size x (per-layer token bytes; the largest if kinds differ).
  For a single-kind model a page is exactly one kvtier block (`KVLayout.block_bytes()`).
- Pages per sequence of n tokens, rounded per sequence and per group (never on a sum):
      full / MLA group      ceil(n / B)
      sliding group (W)     min(ceil(n / B), ceil((W - 1 + f) / B) + 1)
      recurrent group       1 (mamba_cache_mode none) or 2 (align, vLLM's default with prefix
                            caching: the running state and the last block-boundary checkpoint;
                            `MambaSpec.max_memory_usage_bytes`)
  where f is the number of tokens in flight in the step (the prefill chunk at admission, 1 in
  decode). vLLM frees window blocks that fall wholly out of the window before each step
  allocates; "+1" because the window need not start at a block boundary. So a window caps only
  its own layers; full layers of the same model keep growing.
- The pool: usable = device x utilization - weights - reserved; pool pages = floor(usable / page).
Host tiers hold whole kvtier blocks (every attention layer of `block_tokens` tokens, one rank),
one copy of each distinct TP shard.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from kvtier.core.errors import UsageError
from kvtier.core.layout import AttentionKind, KVLayout, LayerSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVGroup(NamedTuple):
    """One vLLM KV-cache group: `layers` real layers of one kind, padded to `group_size`."""

    spec: LayerSpec
    layers: int
    group_size: int


def kv_groups(layout: KVLayout) -> list[KVGroup]:
    """Split the layout's layers into vLLM-style KV cache groups (see module docstring)."""
    buckets = layout.kinds()
    counts = list(buckets.values())
    small, large = min(counts), max(counts)
    size = large if large < small * 1.5 else small
    out: list[KVGroup] = []
    for spec, count in buckets.items():
        n = cdiv(count, size)
        out.extend(KVGroup(spec, len(range(i, count, n)), size) for i in range(n))
    return out


KERNEL_BLOCK_ALIGNMENT = 16
"""Smallest block the attention kernel takes (FlashAttention: MultipleOf(16)); vLLM aligns a
hybrid model's block size to it (`platforms/interface.py` `_align_hybrid_block_size`)."""


def hybrid_block_tokens(layout: KVLayout, kernel_block: int = KERNEL_BLOCK_ALIGNMENT) -> int:
    """The block size vLLM runs a model with recurrent layers at: the layout's own when it has
    no recurrent and attention layers both, else at least a x ceil(state page / (a x attention
    bytes per token and layer)), a = max(kernel_block, block_tokens), rounded to kernel_block."""
    state = max(layout.layer_state_bytes(x) for x in layout.layers)
    attn = max(layout.layer_token_bytes(x) for x in layout.layers)
    b = layout.block_tokens
    if not state or not attn:
        return b
    a = max(kernel_block, b)
    need = kernel_block * cdiv(a * cdiv(state, a * attn), kernel_block)
    return max(b, need)


def page_bytes(layout: KVLayout) -> int:
    """Bytes of one pool page on this rank (one group's layers x block_tokens tokens)."""
    groups = kv_groups(layout)
    size = groups[0].group_size
    per_layer = max(layout.layer_token_bytes(g.spec) for g in groups)
    attention = layout.block_tokens * size * per_layer
    state = max(layout.layer_state_bytes(g.spec) * size for g in groups)
    return max(attention, state)


def group_pages(
    layout: KVLayout, spec: LayerSpec, tokens: int, in_flight: int, state_pages: int = 1
) -> int:
    """Pages one group of kind `spec` holds for a sequence of `tokens` tokens (`state_pages` for
    a recurrent group: 1 in mamba_cache_mode none, 2 in align)."""
    b = layout.block_tokens
    if spec.kind is AttentionKind.RECURRENT:
        return state_pages
    need = cdiv(tokens, b)
    if spec.kind is AttentionKind.SLIDING:
        return min(need, cdiv(spec.window - 1 + in_flight, b) + 1)
    return need


def sequence_pages(
    layout: KVLayout, tokens: int, in_flight: int = 1, state_pages: int = 1
) -> int:
    """Pool pages one sequence of `tokens` tokens holds, `in_flight` of them in this step."""
    if tokens < 0 or in_flight < 1:
        raise UsageError("token counts must be >= 0 and tokens in flight >= 1")
    return sum(
        group_pages(layout, g.spec, tokens, in_flight, state_pages) for g in kv_groups(layout)
    )


def pages_needed(layout: KVLayout, lengths: Iterable[int], in_flight: int = 1) -> int:
    """Pages for a batch of sequences: each sequence rounded up on its own, then summed."""
    return sum(sequence_pages(layout, n, in_flight) for n in lengths)


def blocks_for_tokens(tokens: int, block_tokens: int) -> int:
    """Blocks holding `tokens` tokens of one sequence: ceil(tokens / block_tokens)."""
    return cdiv(tokens, block_tokens)


@dataclass(frozen=True, slots=True)
class GpuPool:
    """The engine's memory budget on one rank. Sizes in bytes; 0 < utilization <= 1."""

    device_bytes: int
    utilization: float
    weights_bytes: int
    reserved_bytes: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.utilization <= 1:
            raise UsageError(f"utilization must be in (0, 1], got {self.utilization}")
        for name in ("device_bytes", "weights_bytes", "reserved_bytes"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0")

    @property
    def budget_bytes(self) -> int:
        """device x utilization, rounded down to a byte."""
        return int(self.device_bytes * self.utilization)

    @property
    def usable_bytes(self) -> int:
        """budget - weights - reserved; negative when the model does not fit at all."""
        return self.budget_bytes - self.weights_bytes - self.reserved_bytes


@dataclass(frozen=True, slots=True)
class Workload:
    """`concurrency` identical requests: a prompt, then up to `max_output` generated tokens.

    `prefill_chunk` is tokens scheduled per prefill step (vLLM max_num_batched_tokens); 0 means
    the whole prompt in one step. `concurrency_cap` is the scheduler's limit (max_num_seqs).
    """

    concurrency: int
    prompt_tokens: int
    max_output_tokens: int
    prefill_chunk: int = 0
    concurrency_cap: int = 0

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.prompt_tokens < 1:
            raise UsageError("concurrency and prompt tokens must be >= 1")
        if min(self.max_output_tokens, self.prefill_chunk, self.concurrency_cap) < 0:
            raise UsageError("max output tokens, prefill chunk and concurrency cap must be >= 0")

    @property
    def admission_in_flight(self) -> int:
        chunk = self.prefill_chunk or self.prompt_tokens
        return max(1, min(chunk, self.prompt_tokens))


class WorkloadPlan(NamedTuple):
    admission_pages_per_seq: int
    full_pages_per_seq: int
    admission_pages: int
    full_growth_pages: int
    admission_fits: bool
    full_growth_fits: bool
    concurrency_ceiling: int
    pages_left_at_cap: int
    full_pages_if_summed: int


def plan_workload(
    layout: KVLayout, pool_pages: int, load: Workload, state_pages: int = 1
) -> WorkloadPlan:
    """Pages the workload needs at admission and at full length, and what the pool allows.

    Admission: every sequence holds its prompt, with the prefill chunk in flight (window
    layers hold up to W - 1 + chunk tokens then). Full growth: prompt + max output tokens in
    decode (one token in flight). The concurrency ceiling is how many full-length sequences
    fit, floor(pool / full pages per sequence); a window layer's extra during one sequence's
    prefill is transient and bounded by the engine's per-step token budget, so it is reported
    (admission) but not charged to every sequence. Pages left at the cap may be negative (a
    shortfall). `full_pages_if_summed` is what rounding the summed tokens (wrongly) would claim.
    """
    full_len = load.prompt_tokens + load.max_output_tokens
    adm = sequence_pages(layout, load.prompt_tokens, load.admission_in_flight, state_pages)
    full = sequence_pages(layout, full_len, 1, state_pages)
    cap = load.concurrency_cap or load.concurrency
    ceiling = pool_pages // full if full else 0
    summed = 0
    for g in kv_groups(layout):
        if g.spec.kind in (AttentionKind.FULL, AttentionKind.MLA):
            summed += group_pages(layout, g.spec, full_len * load.concurrency, 1)
        else:
            summed += group_pages(layout, g.spec, full_len, 1, state_pages) * load.concurrency
    return WorkloadPlan(
        admission_pages_per_seq=adm,
        full_pages_per_seq=full,
        admission_pages=adm * load.concurrency,
        full_growth_pages=full * load.concurrency,
        admission_fits=adm * load.concurrency <= pool_pages,
        full_growth_fits=full * load.concurrency <= pool_pages,
        concurrency_ceiling=ceiling,
        pages_left_at_cap=pool_pages - cap * full,
        full_pages_if_summed=summed,
    )


class TierCapacity(NamedTuple):
    """What a host tier of `capacity_bytes` holds in kvtier blocks.

    `blocks`: blocks of one rank's layout (block_bytes each). `tokens`: tokens whose KV for the
    whole TP group fits, in whole blocks, counting what kvtier stores: one copy of each distinct
    shard (`KVLayout.block_bytes_stored`; a replicated shard, MLA's latent or heads beyond the
    KV head count, is stored once, not once per rank).
    """

    capacity_bytes: int
    blocks: int
    tokens: int


def tier_capacity(layout: KVLayout, capacity_bytes: int) -> TierCapacity:
    if capacity_bytes < 0:
        raise UsageError("tier size must be >= 0")
    block = layout.block_bytes()
    if block == 0:
        return TierCapacity(capacity_bytes, 0, 0)
    group_blocks = capacity_bytes // layout.block_bytes_stored()
    return TierCapacity(capacity_bytes, capacity_bytes // block, group_blocks * layout.block_tokens)


class WindowSaving(NamedTuple):
    """What windows save on one rank for one sequence of `tokens` tokens in decode (attention
    KV only; recurrent state is apart). Bytes are whole pages.

    `all_full_bytes`: every attention layer holds every token (one group, no padding).
    `hybrid_bytes`: vLLM's hybrid KV cache manager (the groups above, their padding, each window
    capping its own group). `hybrid_off_bytes`: the manager off (a connector without
    `SupportsHMA`, `--disable-hybrid-kv-cache-manager`, Llama 4's chunked attention by default):
    sliding layers mixed with full ones are then allocated as full (`unify_hybrid_kv_cache_specs`),
    an all-sliding model keeps its window, and a model with recurrent layers does not start
    (None). `layer_ratio`: sliding / attention layers, the most any window can save.
    """

    tokens: int
    all_full_bytes: int
    hybrid_bytes: int
    hybrid_off_bytes: int | None
    layer_ratio: float

    @property
    def hybrid_saving(self) -> float:
        return 1 - self.hybrid_bytes / self.all_full_bytes if self.all_full_bytes else 0.0

    @property
    def hybrid_off_saving(self) -> float | None:
        if self.hybrid_off_bytes is None or not self.all_full_bytes:
            return None
        return 1 - self.hybrid_off_bytes / self.all_full_bytes


def window_saving(layout: KVLayout, tokens: int) -> WindowSaving:
    if tokens < 1:
        raise UsageError("the context for the window saving must be >= 1 token")
    attention = [x for x in layout.layers if x.kind is not AttentionKind.RECURRENT]
    per_token = sum(layout.layer_token_bytes(x) for x in attention)
    b = layout.block_tokens
    all_full = cdiv(tokens, b) * b * per_token
    page = page_bytes(layout)
    hybrid = sum(
        group_pages(layout, g.spec, tokens, 1) * page
        for g in kv_groups(layout)
        if g.spec.kind is not AttentionKind.RECURRENT
    )
    kinds = {x.kind for x in layout.layers}
    sliding = sum(1 for x in attention if x.kind is AttentionKind.SLIDING)
    off: int | None
    if AttentionKind.RECURRENT in kinds:
        off = None
    elif AttentionKind.SLIDING in kinds and len(kinds) > 1:
        off = all_full
    else:
        off = hybrid
    ratio = sliding / len(attention) if attention else 0.0
    return WindowSaving(tokens, all_full, hybrid, off, ratio)


class Sampling(NamedTuple):
    """`samples` completions of one prompt (vLLM `n` / parallel sampling), pages on one rank.

    vLLM v1 fans the request out into `samples` children that share the prompt's blocks through
    prefix caching: a child can hit at most `prompt - 1` tokens (`kv_cache_manager.py`:
    max_cache_hit_length = num_tokens - 1), so `shared_blocks` = floor((prompt - 1) / B) per
    full/MLA group, and every child keeps its own copy of the last prompt block and recomputes
    `recomputed_tokens` = prompt - shared x B of it. A copy-on-write engine instead shares
    floor(prompt / B) blocks and copies the partly filled last block when a sample writes its
    first decode token into it (`cow_copies` = samples - 1 blocks, none when the prompt ends on a
    block boundary). Sliding and recurrent groups are counted per sample (not shared).
    """

    samples: int
    unshared_pages: int
    shared_pages: int
    shared_blocks: int
    recomputed_tokens: int
    cow_shared_blocks: int
    cow_pages: int
    cow_copies: int

    @property
    def saving(self) -> float:
        return 1 - self.shared_pages / self.unshared_pages if self.unshared_pages else 0.0


def parallel_sampling(
    layout: KVLayout, prompt: int, output: int, samples: int, state_pages: int = 1
) -> Sampling:
    if prompt < 1 or output < 0 or samples < 1:
        raise UsageError("parallel sampling needs prompt >= 1, output >= 0 and samples >= 1")
    b = layout.block_tokens
    full_len = prompt + output
    shared = (prompt - 1) // b
    cow_shared = prompt // b
    unshared = with_prefix = with_cow = 0
    for g in kv_groups(layout):
        own = group_pages(layout, g.spec, full_len, 1, state_pages)
        unshared += samples * own
        if g.spec.kind in (AttentionKind.FULL, AttentionKind.MLA):
            with_prefix += shared + samples * (own - shared)
            with_cow += cow_shared + samples * (own - cow_shared)
        else:
            with_prefix += samples * own
            with_cow += samples * own
    copies = (samples - 1) if prompt % b else 0
    return Sampling(
        samples,
        unshared,
        with_prefix,
        shared,
        prompt - shared * b,
        cow_shared,
        with_cow,
        copies,
    )
