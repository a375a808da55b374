"""Pages and size classes of the DRAM pool: which byte range each slot id names. Pure metadata
(no mapping, no lock): `kvtier.tiers.dram.DramPool` wraps it with its lock and the segment.

The pool's data area is `page_count` pages of `page_bytes`. A page is free or belongs to one size
class; a class is a slot stride s (a block size rounded up to `min_stride` and to `UNIT`). A
class's slots sit on the grid of its stride over the whole data area — row r at r * s — so a
client views a class as one [rows, s] array with rows s apart (`kvtier.core.segment.slot_array`).
A page of class s holds the rows that lie wholly inside it (the bytes before the first and after
the last are unused; fewer than 2 s per page, none when s divides the page size):

    p*page_bytes                                                        (p+1)*page_bytes
    | head | row r0 | row r0+1 | ... | row r0+k-1 | tail |        r0 = ceil(p*page_bytes / s)

Slot ids are dense: `p * ids_per_page + j` for slot j of page p (`ids_per_page` = the slots a
page of the smallest class holds), so `slot_ids` bounds them for tables sized by slot id.

A class takes a free page when none of its pages has a free slot; a page whose last slot is freed
goes back to the free pages (any class may take it). `alloc` fills the class's fullest page
first, so pages empty out and return. `evacuation` names a page whose live slots fit in the
class's other free slots (the caller moves those blocks, then frees the page).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

UNIT = 256
"""Slot alignment in bytes: every slot starts at a multiple of it, block strides are multiples of
it (the copy paths need nothing coarser; 4 KiB-multiple blocks stay 4 KiB-aligned)."""


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class ClassStats(NamedTuple):
    """One size class: its stride, pages, slots (used / all) and block bytes it could hold."""

    stride: int
    pages: int
    slots_used: int
    slots: int


class PageTable:
    """Slot ids ⇄ pages and classes; free lists per class and page (see the module docstring)."""

    def __init__(self, page_bytes: int, page_count: int, min_stride: int) -> None:
        if min_stride <= 0 or min_stride % UNIT or page_bytes < min_stride or page_count <= 0:
            raise ValueError(f"bad page geometry: {page_count} pages of {page_bytes} B, smallest "
                             f"slot {min_stride} B (a multiple of {UNIT})")
        self.page_bytes = page_bytes
        self.page_count = page_count
        self.min_stride = min_stride
        self.ids_per_page = page_bytes // min_stride
        self.slot_ids = page_count * self.ids_per_page
        self._free_pages = list(range(page_count - 1, -1, -1))
        self._stride = [0] * page_count  # 0: free page
        self._live = [0] * page_count
        self._page_free: dict[int, list[int]] = {}  # page -> its free slot ids (LIFO)
        self._class_pages: dict[int, set[int]] = {}  # stride -> its pages
        self._class_free: dict[int, int] = {}  # stride -> free slots over its pages
        self._allocated = bytearray(self.slot_ids)
        self.used = 0  # allocated slots
        self.used_bytes = 0  # their strides

    # -- geometry -----------------------------------------------------------------------

    def stride_for(self, nbytes: int) -> int:
        """The class a block of `nbytes` goes to (raises for a block no page holds)."""
        stride = max(round_up(nbytes, UNIT), self.min_stride)
        if nbytes <= 0 or stride > self.page_bytes:
            raise ValueError(f"a {nbytes}-byte block does not fit a {self.page_bytes}-byte page")
        return stride

    def per_page(self, stride: int, p: int) -> int:
        """Slots page `p` holds in class `stride` (rows of the stride grid wholly inside it)."""
        return (p + 1) * self.page_bytes // stride - -(-(p * self.page_bytes) // stride)

    def _first_row(self, p: int) -> int:
        return -(-(p * self.page_bytes) // self._stride[p])

    def page_of(self, slot: int) -> int:
        return slot // self.ids_per_page

    def stride_of(self, slot: int) -> int:
        """The stride of an allocated slot's class."""
        self.check(slot)
        return self._stride[slot // self.ids_per_page]

    def location(self, slot: int) -> int:
        """Byte offset of a slot from the start of the data area (slot must be valid)."""
        p, j = divmod(slot, self.ids_per_page)
        stride = self._stride[p]
        if not stride or j >= self.per_page(stride, p):
            raise ValueError(f"slot {slot} is not a slot of an allocated page")
        return (self._first_row(p) + j) * stride

    def slot_at(self, location: int) -> int | None:
        """The slot id starting at `location` (from the data area), None if no slot starts there."""
        p = location // self.page_bytes
        if not 0 <= p < self.page_count or not self._stride[p]:
            return None
        stride = self._stride[p]
        row, rest = divmod(location, stride)
        j = row - self._first_row(p)
        if rest or not 0 <= j < self.per_page(stride, p):
            return None
        return p * self.ids_per_page + j

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.slot_ids and bool(self._allocated[slot])

    def check(self, slot: int) -> None:
        if not 0 <= slot < self.slot_ids:
            raise ValueError(f"slot {slot} out of range 0..{self.slot_ids - 1}")
        if not self._allocated[slot]:
            raise ValueError(f"slot {slot} is not allocated")

    # -- allocation -----------------------------------------------------------------------

    def can_alloc(self, n: int, stride: int) -> bool:
        short = n - self._class_free.get(stride, 0)
        if short <= 0:
            return True
        for k in sorted((self.per_page(stride, p) for p in self._free_pages), reverse=True):
            short -= k
            if short <= 0 or not k:
                break
        return short <= 0

    def room(self, stride: int) -> int:
        """Free slots of class `stride`: its own plus what the free pages would hold."""
        return self._class_free.get(stride, 0) + sum(
            self.per_page(stride, p) for p in self._free_pages)

    def alloc_many(self, n: int, stride: int) -> list[int] | None:
        """`n` slots of class `stride`, all or none (None when they do not fit)."""
        if n <= 0:
            return []
        if not self.can_alloc(n, stride):
            return None
        while self._class_free.get(stride, 0) < n:
            self._take_page(stride)
        pages = sorted((p for p in self._class_pages[stride] if p in self._page_free),
                       key=lambda p: len(self._page_free[p]))
        got: list[int] = []
        for p in pages:
            free = self._page_free[p]
            while free and len(got) < n:
                got.append(free.pop())
            self._live[p] = self.per_page(stride, p) - len(free)
            if not free:
                del self._page_free[p]
            if len(got) == n:
                break
        self._class_free[stride] -= n
        for s in got:
            self._allocated[s] = 1
        self.used += n
        self.used_bytes += n * stride
        return got

    def _take_page(self, stride: int) -> None:
        """Gives the class the free page that holds most of its slots (the lowest such page)."""
        p = max(self._free_pages, key=lambda q: (self.per_page(stride, q), -q))
        self._free_pages.remove(p)
        self._stride[p] = stride
        k = self.per_page(stride, p)
        base = p * self.ids_per_page
        self._page_free[p] = list(range(base + k - 1, base - 1, -1))
        self._live[p] = 0
        self._class_pages.setdefault(stride, set()).add(p)
        self._class_free[stride] = self._class_free.get(stride, 0) + k

    def free(self, slot: int) -> None:
        self.check(slot)
        p = slot // self.ids_per_page
        stride = self._stride[p]
        self._allocated[slot] = 0
        self.used -= 1
        self.used_bytes -= stride
        self._live[p] -= 1
        self._page_free.setdefault(p, []).append(slot)
        self._class_free[stride] += 1
        if not self._live[p]:
            self._release_page(p)

    def _release_page(self, p: int) -> None:
        stride = self._stride[p]
        del self._page_free[p]
        self._class_free[stride] -= self.per_page(stride, p)
        pages = self._class_pages[stride]
        pages.discard(p)
        if not pages:
            del self._class_pages[stride], self._class_free[stride]
        self._stride[p] = 0
        self._free_pages.append(p)

    # -- reclaim ---------------------------------------------------------------------------

    def live_slots(self, p: int) -> list[int]:
        base, stride = p * self.ids_per_page, self._stride[p]
        if not stride:
            return []
        return [s for s in range(base, base + self.per_page(stride, p)) if self._allocated[s]]

    def evacuation(self, stride: int,
                   movable: Callable[[int], bool]) -> tuple[int, list[int]] | None:
        """A page of class `stride` whose live slots are all `movable` and fit in the class's
        free slots on its other pages: (page, its live slots), fewest live first; None if
        none."""
        free = self._class_free.get(stride, 0)
        best: tuple[int, list[int]] | None = None
        for p in sorted(self._class_pages.get(stride, ()), key=lambda q: self._live[q]):
            own_free = self.per_page(stride, p) - self._live[p]
            if self._live[p] > free - own_free:
                break
            live = self.live_slots(p)
            if all(map(movable, live)):
                best = (p, live)
                break
        return best

    def targets(self, stride: int, avoid: int, n: int) -> list[int]:
        """`n` free slots of class `stride` outside page `avoid` (without allocating them)."""
        out: list[int] = []
        for p in self._class_pages.get(stride, ()):
            if p != avoid and p in self._page_free:
                out.extend(self._page_free[p][: n - len(out)])
            if len(out) >= n:
                break
        return out

    def claim(self, slots: Iterable[int]) -> None:
        """Marks specific free slots allocated (the destinations of a move)."""
        for s in slots:
            p = s // self.ids_per_page
            self._page_free[p].remove(s)
            if not self._page_free[p]:
                del self._page_free[p]
            self._live[p] += 1
            self._class_free[self._stride[p]] -= 1
            self._allocated[s] = 1
            self.used += 1
            self.used_bytes += self._stride[p]

    # -- accounting -----------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def classes(self) -> list[ClassStats]:
        return [ClassStats(s, len(pages), sum(self._live[p] for p in pages),
                           sum(self.per_page(s, p) for p in pages))
                for s, pages in sorted(self._class_pages.items())]
