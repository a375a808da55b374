"""Shadow verification's comparison: an engine's recomputed KV block against the bytes kvtier
holds under the same key, page by page, within the engine's own numerical spread. Pure (torch
tensors in memory only).

A block is a list of `Region`s (one per layer page, or per state tensor of a state layer), each
with its kind — "full" (full attention), "swa" (sliding window), "state" (linear-attention /
Mamba state), "hybrid" (an attention layer of a model that also has state layers) — and its
element dtype. Each region is compared as floats:

    rel_l2    ||computed - stored||_2 / ||stored||_2       (the page's relative error)
    rel_max   max |computed - stored| / max |stored|        (its worst element, page-scaled)

and the region matches when both are within its kind's `Tolerance` (a non-finite value where
the other side differs is a mismatch). Bytes of integer or unknown dtypes must be equal.

KV of the same prefix computed in another batch split, chunk size or after preemption is not
bit-identical in bf16: the engine sums in another order, and the difference grows with depth.
`TOLERANCES` come from that spread, measured on the test models (`bench/verify_spread.py`,
docs/benchmarks.md "Shadow verification"), with a margin; wrong KV (other weights, another
context, swapped layers) lands orders of magnitude above them.

"hybrid" has its own, wider tolerance: a linear-attention layer's output changes with the batch
split (its chunked scan restarts at other tokens), and the attention layers after it compute
their KV from that output, so right KV spreads ~20x more there than in a dense model, with
single elements off by nearly half the page's largest value. Its relative L2 bound still lies
~9x under wrong KV's smallest; its worst-element bound only catches gross corruption (a block
with one wrong token among 160 may be within it: a limit of verification on such models).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

KINDS = ("full", "swa", "state", "hybrid")


class Region(NamedTuple):
    """Bytes [start, stop) of a block: one layer's page (or one state tensor of it)."""

    layer: int
    kind: str
    start: int
    stop: int
    dtype: str
    """torch dtype name of its elements ("bfloat16", "float32", ...)."""


@dataclass(frozen=True, slots=True)
class Tolerance:
    rel_l2: float
    rel_max: float


TOLERANCES: Mapping[str, Tolerance] = {
    "full": Tolerance(rel_l2=0.05, rel_max=0.25),
    "swa": Tolerance(rel_l2=0.05, rel_max=0.25),
    "state": Tolerance(rel_l2=0.05, rel_max=0.25),
    "hybrid": Tolerance(rel_l2=0.15, rel_max=1.0),
}
"""Per group kind (module docstring): the measured spread times a margin."""


class RegionError(NamedTuple):
    region: Region
    rel_l2: float
    rel_max: float
    max_abs: float


class BlockCheck(NamedTuple):
    """One block compared: whether every region matched, the first region that did not (None
    when all did), and per kind the largest errors seen (rel_l2, rel_max) over its regions."""

    ok: bool
    first_bad: RegionError | None
    worst: dict[str, tuple[float, float]]


_FLOATS = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "float64": torch.float64, "float8_e4m3fn": torch.float8_e4m3fn,
           "float8_e5m2": torch.float8_e5m2}


def region_error(computed: torch.Tensor, stored: torch.Tensor, region: Region) -> RegionError:
    """Errors of one region of two blocks (uint8 tensors of the block's bytes)."""
    a_raw = computed[region.start:region.stop]
    b_raw = stored[region.start:region.stop]
    dtype = _FLOATS.get(region.dtype)
    if dtype is None or (region.stop - region.start) % dtype.itemsize:
        same = bool(torch.equal(a_raw, b_raw))
        e = 0.0 if same else math.inf
        return RegionError(region, e, e, e)
    a = a_raw.view(dtype).float()
    b = b_raw.view(dtype).float()
    diff = a - b
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not bool(finite.all()):
        # a non-finite value is a mismatch unless both sides hold the same one
        agree = bool(torch.equal(a[~finite].nan_to_num(0.5), b[~finite].nan_to_num(0.5)))
        if not agree:
            return RegionError(region, math.inf, math.inf, math.inf)
        a, b, diff = a[finite], b[finite], diff[finite]
    if diff.numel() == 0:
        return RegionError(region, 0.0, 0.0, 0.0)
    max_abs = float(diff.abs().max())
    if max_abs == 0.0:
        return RegionError(region, 0.0, 0.0, 0.0)
    scale_l2 = float(torch.linalg.vector_norm(b))
    scale_max = float(b.abs().max())
    rel_l2 = float(torch.linalg.vector_norm(diff)) / scale_l2 if scale_l2 > 0 else math.inf
    rel_max = max_abs / scale_max if scale_max > 0 else math.inf
    return RegionError(region, rel_l2, rel_max, max_abs)


def check_block(computed: torch.Tensor, stored: torch.Tensor, regions: Sequence[Region],
                tolerances: Mapping[str, Tolerance] = TOLERANCES) -> BlockCheck:
    """Compares every region of one block (uint8 tensors, at least as long as the last region's
    end); see the module docstring."""
    worst: dict[str, tuple[float, float]] = {}
    first_bad: RegionError | None = None
    for r in regions:
        e = region_error(computed, stored, r)
        w = worst.get(r.kind, (0.0, 0.0))
        worst[r.kind] = (max(w[0], e.rel_l2), max(w[1], e.rel_max))
        tol = tolerances[r.kind]
        if first_bad is None and not (e.rel_l2 <= tol.rel_l2 and e.rel_max <= tol.rel_max):
            first_bad = e
    return BlockCheck(first_bad is None, first_bad, worst)


def describe(e: RegionError, tolerances: Mapping[str, Tolerance] = TOLERANCES) -> str:
    """One line for the logs: where a block differs and by how much."""
    tol = tolerances[e.region.kind]
    return (f"layer {e.region.layer} ({e.region.kind}, {e.region.dtype}): relative error "
            f"{e.rel_l2:.3g} (tolerance {tol.rel_l2:g}), worst element {e.rel_max:.3g} of the "
            f"page's largest (tolerance {tol.rel_max:g}), max abs {e.max_abs:.3g}")
