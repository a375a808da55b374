"""vLLM's KV cache views, built without vLLM: for the GPU machine, which has no vLLM.

    views = kv_views(raw, layers=32, blocks=96, heads=8, tokens=16, head_size=128,
                     dtype=torch.bfloat16, layout="LBHNC")
    connector_base()   # makes kvtier.integrations.vllm.metadata importable without vLLM

`kv_views` is what vLLM 0.32's `create_kv_cache_views` returns for a `FullAttentionSpec` over one
`KVCacheTensor` laid out by `compute_layout_strides` (no kernel-block split, no page padding):
one [blocks, heads, tokens, 2 * head_size] view per layer, in `layout`'s physical order of the
logical axes [L, B, H, N, C] (C: a token's K and V bytes). tests/test_vllm_views.py checks it
against vLLM's own function (shape, strides, offset, dtype) for every layout, where vLLM is
installed. `connector_base` registers vLLM's `KVConnectorMetadata` (an empty ABC) under its vLLM
module name only when vLLM is not installed; with vLLM it does nothing.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from abc import ABC
from typing import Any

LAYOUTS = {  # vllm.v1.kv_cache_layout.KVCacheLayout: physical order of the axes L, B, H, N, C
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


def page_bytes(heads: int, tokens: int, head_size: int, itemsize: int) -> int:
    """One block of one layer: K and V of `tokens` tokens (vLLM's `page_size_bytes`)."""
    return 2 * heads * tokens * head_size * itemsize


def kv_views(raw: Any, layers: int, blocks: int, heads: int, tokens: int, head_size: int,
             dtype: Any, layout: str) -> list[Any]:
    """Per-layer [blocks, heads, tokens, 2 * head_size] `dtype` views of `raw`, a flat int8
    torch tensor of layers * blocks * page_bytes(...) bytes, in vLLM's `layout`."""
    import torch

    order = LAYOUTS[layout]
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape = (layers, blocks, heads, tokens, 2 * head_size * itemsize)
    if raw.numel() != layers * blocks * page_bytes(heads, tokens, head_size, itemsize):
        raise ValueError(f"raw holds {raw.numel()} bytes, not {shape}")
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    view = torch.as_strided(raw, shape, strides, raw.storage_offset())
    return [view[i].view(dtype) for i in range(layers)]


def connector_base() -> str:
    """"vllm" when vLLM is installed; else registers vLLM's `KVConnectorMetadata` (an empty ABC
    in vLLM too) under its module name so the connector's worker side imports, and says
    "stand-in"."""
    if BASE in sys.modules:
        return "stand-in" if getattr(sys.modules[BASE], "STAND_IN", False) else "vllm"
    if importlib.util.find_spec("vllm") is not None:
        return "vllm"
    install_stand_in()
    return "stand-in"


def install_stand_in() -> None:
    """Registers the stand-in base module (see `connector_base`), vLLM installed or not."""

    class KVConnectorMetadata(ABC):  # noqa: B024  (as in vLLM: a marker base class)
        """Abstract Metadata used to communicate Scheduler KVConnector -> Worker KVConnector."""

    parts = BASE.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so the next part imports under it
        sys.modules[name] = module
        if i > 1:
            setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], module)
    base = sys.modules[BASE]
    base.KVConnectorMetadata = KVConnectorMetadata  # type: ignore[attr-defined]
    base.STAND_IN = True  # type: ignore[attr-defined]
    KVConnectorMetadata.__module__ = BASE
