"""vLLM's per-layer KV tensors cut into the chunks a slot holds back to back (`layout.py`).

vLLM 0.32 hands the connector one view per layer, standardized as [B, H, N, C] (blocks at dim
0) over whatever physical layout its attention backends chose (`VLLM_KV_CACHE_LAYOUT`,
`vllm.v1.kv_cache_layout.KVCacheLayout`). A page (one block of one layer) is stored in its
logical [H, N, C] order, so the bytes do not depend on the physical layout:

    LBHNC, BLHNC    the page is one contiguous run per block: one chunk per layer
    LHBNC, BHLNC    head groups lie outside the block (H has a stride above B's): the page is H
                    runs of [N, C], one chunk per (layer, head), H chunks back to back
    LBNHC, BLNHC    tokens outside heads: a page in [H, N, C] order is H x N runs of one token's
                    C bytes; not copied (`Unsupported`, the connector does nothing) — the
                    connector asks vLLM for LBHNC (`get_required_kvcache_layout`), which every
                    backend without its own requirement (flash_attn, triton, flashinfer off
                    Blackwell, the CPU backend) accepts

A recurrent-state layer (Mamba / linear attention) comes as one tensor of its state bytes per
block ([B, 1, 1, state_bytes], int8, vLLM 0.32) with the block stride of the shared page:
`state_pages` views it as the whole page ([B, page_bytes]: the state and vLLM's padding after
it, which nothing reads), so every layer's page has one size.

Each chunk is a uint8 [B, chunk_bytes] view sharing the cache's memory, with one block stride:
what `kvtier.gpu.transfer.KVPool.paged` takes. Pure (torch views only, no copies).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.integrations.vllm.layout import Unsupported

PREFERRED_LAYOUT = "LBHNC"
"""What the connector asks vLLM for: every page one contiguous run in logical order."""


@dataclass(frozen=True, slots=True)
class Paged:
    """Every layer's chunks, layer after layer: layer i is chunks[i * per_layer:(i + 1) *
    per_layer], at slot bytes [i * page_bytes, (i + 1) * page_bytes)."""

    chunks: tuple[torch.Tensor, ...]
    per_layer: int
    chunk_bytes: int

    def layer_range(self, i: int) -> tuple[int, int]:
        return i * self.per_layer, (i + 1) * self.per_layer

    @property
    def device(self) -> torch.device:
        return self.chunks[0].device


def _contiguous_tail(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """The first dim d >= 1 such that dims d.. are C-contiguous (dims of size 1 ignored)."""
    expected = 1
    for d in range(len(shape) - 1, 0, -1):
        if shape[d] == 1:
            continue
        if stride[d] != expected:
            return d + 1
        expected *= shape[d]
    return 1


def _pick(raw: torch.Tensor, idx: tuple[int, ...]) -> torch.Tensor:
    """raw[:, idx[0], idx[1], ...] (a view)."""
    out = raw
    for i in idx:
        out = out.select(1, i)
    return out


def layer_chunks(kv: torch.Tensor, page_bytes: int) -> list[torch.Tensor]:
    """One layer's KV view ([B, ...], blocks at dim 0) as chunks of per-block contiguous bytes,
    in the page's logical order; `Unsupported` when that takes more than splitting dim 1."""
    if kv.dim() < 2 or kv[0].numel() * kv.element_size() != page_bytes:
        raise Unsupported(f"a KV tensor of shape {tuple(kv.shape)} ({kv.dtype}) does not have "
                          f"pages of {page_bytes} bytes at dim 0")
    if kv.stride(-1) != 1 and kv.shape[-1] != 1:
        raise Unsupported(f"KV tensor of shape {tuple(kv.shape)} with strides {kv.stride()}: "
                          "its last dim is not contiguous")
    raw = kv.view(torch.uint8)  # the last dim in bytes; a view, never a copy
    shape, stride = tuple(raw.shape), tuple(raw.stride())
    tail = _contiguous_tail(shape, stride)
    if tail > 2:
        raise Unsupported(
            f"KV pages of shape {tuple(kv.shape)} with strides {kv.stride()} are not one "
            f"contiguous run per block or per head group (tokens outside heads, a layout like "
            f"LBNHC): kvtier copies pages in [H, N, C] order; run vLLM with "
            f"VLLM_KV_CACHE_LAYOUT={PREFERRED_LAYOUT}")
    outer = [range(n) for n in shape[1:tail]]
    chunks = [_pick(raw, idx).flatten(1) for idx in itertools.product(*outer)]
    for c in chunks:  # flatten of per-block contiguous dims is a view; check it stayed one
        if c.stride(1) != 1 or c.untyped_storage().data_ptr() != kv.untyped_storage().data_ptr():
            raise Unsupported(f"KV tensor of shape {tuple(kv.shape)} with strides "
                              f"{kv.stride()} cannot be viewed as per-block chunks")
    return chunks


def state_pages(kv: Any, page_bytes: int) -> torch.Tensor:
    """A state layer's cache as [B, page_bytes] uint8 over the same memory (see the module);
    `Unsupported` unless it is one tensor whose blocks are `page_bytes` apart and whose state
    fits in a page."""
    if not isinstance(kv, torch.Tensor):
        raise Unsupported(f"a state layer's cache is {type(kv).__name__}, not one tensor (a "
                          "vLLM without one state view per layer)")
    raw = kv.view(torch.uint8) if kv.dtype in (torch.int8, torch.uint8) else kv
    if raw.dtype != torch.uint8 or raw.dim() < 1:
        raise Unsupported(f"a state layer's cache of dtype {kv.dtype} is not raw bytes")
    state = raw[0].numel()
    if raw.stride(0) != page_bytes or state > page_bytes or not raw[0].is_contiguous():
        raise Unsupported(f"a state layer's cache {tuple(kv.shape)} with strides "
                          f"{kv.stride()} is not one run of at most {page_bytes} bytes per "
                          f"{page_bytes}-byte block")
    blocks = raw.shape[0]
    if raw.storage_offset() + blocks * page_bytes > raw.untyped_storage().nbytes():
        raise Unsupported("a state layer's last page runs past its buffer")
    return raw.as_strided((blocks, page_bytes), (page_bytes, 1), raw.storage_offset())


def paged(kv_caches: list[torch.Tensor], page_bytes: int) -> Paged:
    """Every layer's chunks (`layer_chunks`); `Unsupported` when the layers differ in shape,
    device or block stride (then no one pool geometry describes them)."""
    per = [layer_chunks(kv, page_bytes) for kv in kv_caches]
    first = per[0][0]
    for i, chunks in enumerate(per):
        if len(chunks) != len(per[0]):
            raise Unsupported(f"layer {i}'s page is {len(chunks)} runs, layer 0's "
                              f"{len(per[0])}")
        for c in chunks:
            if (c.shape, c.stride(0), c.device) != (first.shape, first.stride(0), first.device):
                raise Unsupported(f"layer {i}'s KV chunks ({tuple(c.shape)}, block stride "
                                  f"{c.stride(0)}, {c.device}) differ from layer 0's "
                                  f"({tuple(first.shape)}, {first.stride(0)}, {first.device})")
    if len(per[0]) * first.shape[1] != page_bytes:
        raise Unsupported(f"{len(per[0])} chunks of {first.shape[1]} bytes do not make a "
                          f"{page_bytes}-byte page")
    return Paged(tuple(c for chunks in per for c in chunks), len(per[0]), int(first.shape[1]))
