"""Tier capacities as users write them: a block count, or bytes with a block size.

`1000` or `1000blocks` is 1000 blocks; anything with a byte unit (`64GiB`, `500GB`, `2097152B`)
is bytes (parsed by `kvtier.core.units.parse_size`) and needs the bytes of one trace block, which
`trace_block_bytes` derives from a model preset (`kvtier.core.presets`) or takes as given. A trace
block is `TRACE_BLOCK_TOKENS` (512) tokens; its bytes are what one node's cache holds for all TP
ranks of one replica: one copy of each distinct shard, a replicated one (MLA's latent, KV heads
beyond the KV head count) once (`KVLayout.block_bytes_stored`; tp = 1: bytes_per_token x 512).
"""

from __future__ import annotations

import re

from kvtier.core.errors import UsageError
from kvtier.core.units import parse_size
from kvtier.sim.trace import TRACE_BLOCK_TOKENS

_BLOCKS = re.compile(r"^\s*([0-9]+)\s*(?:blocks?)?\s*$", re.IGNORECASE)


def parse_capacity(text: str, block_bytes: int | None, what: str) -> int:
    """Capacity in blocks. Byte sizes round down to whole blocks; bad input is a `UsageError`."""
    m = _BLOCKS.match(text)
    if m:
        return int(m.group(1))
    size = parse_size(text, what)
    if not size.unit:
        raise UsageError(f"{what}: {text!r} is neither a whole block count nor a size with a unit")
    if block_bytes is None:
        raise UsageError(
            f"{what}: {text!r} is a size in bytes; give --model PRESET (or --block-bytes N) so "
            f"it can be turned into {TRACE_BLOCK_TOKENS}-token blocks, or give a block count"
        )
    return size.bytes // block_bytes


def trace_block_bytes(
    model: str | None, dtype: str, tp_size: int, block_bytes: str | None
) -> int | None:
    """Bytes of one 512-token trace block, from `block_bytes` (a size) or a model preset."""
    if block_bytes is not None:
        if model is not None:
            raise UsageError("give either --model or --block-bytes, not both")
        n = parse_size(block_bytes, "--block-bytes").bytes
        if n < 1:
            raise UsageError("--block-bytes must be at least 1 byte")
        return n
    if model is None:
        return None
    from kvtier.core.layout import DType
    from kvtier.core.presets import get_preset

    if tp_size < 1:
        raise UsageError(f"--tp must be >= 1, got {tp_size}")
    layout = get_preset(model).layout(DType.parse(dtype), TRACE_BLOCK_TOKENS, tp_size)
    n = layout.block_bytes_stored()
    if n < 1:
        raise UsageError(f"{model} stores no per-token KV; byte capacities mean nothing for it")
    return n
