"""SGLang's host KV pool (HiCache L2) as kvtier pages: the geometry a layout is declared from,
and byte views of single pages to copy DRAM slots into and out of.

A kvtier block is one SGLang page, in the byte order of the pool's own flat page
(`get_data_page(index, flat=True)`, the format SGLang's generic storage path reads and writes),
so pages stored by the v1 (zero-copy) path and by the generic path are the same bytes. That
order depends on the pool's memory layout (`layer_first`, `page_first`, ...), its kind (MHA,
MLA), dtype and shape: all of it is in the fingerprint, so a pool of another layout or model
shard never reads them. The pool is only read through its public page API
(`get_data_page`, `page_size`, `layout`, `dtype`); no SGLang import here.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvtier.integrations.common.verify import Region

FORMAT = "kvtier-sglang-page-v1"
U8 = npt.NDArray[np.uint8]


class PageGeometry(NamedTuple):
    kind: str
    """The pool's class name (MHATokenToKVPoolHost, MLATokenToKVPoolHost, ...)."""
    layout: str
    dtype: str
    page_size: int
    page_shape: tuple[int, ...]
    """Shape of one page as `get_data_page(i, flat=False)` gives it."""
    block_bytes: int
    format_tag: str
    """The pool's own `storage_format_tag` ("" when it has none)."""


def geometry(pool: Any) -> PageGeometry:
    page = pool.get_data_page(0, flat=False)
    return PageGeometry(type(pool).__name__, str(pool.layout), str(pool.dtype).removeprefix(
        "torch."), int(pool.page_size), tuple(int(d) for d in page.shape),
        int(page.numel()) * int(page.element_size()),
        str(getattr(pool, "storage_format_tag", None) or ""))


def page_regions(geo: PageGeometry) -> list[Region]:
    """What shadow verification compares in a page: its bytes as the pool's dtype (every
    layer's K and V together; `common/verify.py`)."""
    return [Region(0, "full", 0, geo.block_bytes, geo.dtype)]


def fingerprint(geo: PageGeometry, shard: dict[str, int]) -> bytes:
    """The layout fingerprint: page geometry plus the model shard this rank holds (`shard`:
    TP rank and size, PP rank and layers; for MLA only what differs between stored copies)."""
    doc = {"format": FORMAT, **geo._asdict(), "shard": shard}
    return b"sglang:" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).digest()[:16]


class HostPages:
    """Byte views of the pool's pages. A view aliases the pool's memory (writing it writes the
    page); it is valid while the pool lives."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.geometry = geometry(pool)
        self.page_size = self.geometry.page_size

    def page(self, first_index: int) -> U8:
        """The page whose first token slot is `first_index` (a multiple of the page size), as
        uint8 in flat-page order; a strided view when the layout interleaves pages."""
        t = self.pool.get_data_page(int(first_index), flat=False)
        b = t.view(torch.uint8) if t.element_size() != 1 else t
        out: U8 = b.numpy()
        return out

    def copy_in(self, first_index: int, src: U8) -> None:
        """Writes one page from `src` (block_bytes, flat-page order)."""
        dst = self.page(first_index)
        np.copyto(dst, src.reshape(dst.shape), casting="no")

    def copy_out(self, first_index: int, dst: U8) -> None:
        """Reads one page into `dst` (block_bytes, contiguous)."""
        src = self.page(first_index)
        np.copyto(dst.reshape(src.shape), src, casting="no")

    def firsts(self, host_indices: Any, pages: int) -> list[int]:
        """The first slot of each of `pages` pages in SGLang's `host_indices` (token slots,
        `page_size` per page); ValueError when the count does not match."""
        n = int(host_indices.numel()) if hasattr(host_indices, "numel") else len(host_indices)
        if n != pages * self.page_size:
            raise ValueError(f"kvtier: host_indices has {n} slots for {pages} pages of "
                             f"{self.page_size} tokens")
        flat = host_indices.tolist() if hasattr(host_indices, "tolist") else list(host_indices)
        return [int(flat[i * self.page_size]) for i in range(pages)]
