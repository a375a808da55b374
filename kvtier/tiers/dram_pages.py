"""Pages and size classes of the DRAM pool: which byte range each slot id names. Pure metadata
(no mapping, no lock): `kvtier.tiers.dram.DramPool` wraps it with its lock and the segment.

The pool's data area is `page_count` pages of `page_bytes`. A page is free or belongs to one size
class; a class is a slot stride s (a block size rounded up to `min_stride` and to `UNIT`). A
class's slots sit on the grid of its stride over the whole data area — row r at r * s — so a
client views a class as one [rows, s] array with rows s apart (`kvtier.core.segment.slot_array`).
A page of class s holds the rows that start in it and lie wholly inside it, plus the row that
starts in it and crosses into the next page when that page belongs to the same class (a run of
adjacent pages of one class is one extent: only its two ends lose bytes, fewer than 2 s in all;
none when s divides the page size):

    p*page_bytes                                          (p+1)*page_bytes
    | head | row r0 | row r0+1 | ... | row r0+k-1 | row r0+k ...|...  (page p+1, same class)
                                                    the link row: slot j = k of page p
    r0 = ceil(p*page_bytes / s), k = the rows wholly inside page p

Slot ids are dense: `p * ids_per_page + j` for slot j of page p (`ids_per_page` = the rows of the
smallest class that may start in a page), so `slot_ids` bounds them for tables sized by slot id.

A class takes a free page when none of its pages has a free slot, preferring one next to its own
pages (whose link rows then count); a page whose own slots are all free, and whose left
neighbour's link row (which lies partly on it) is free too, goes back to the free pages (any class
may take it; the neighbour's link row stops being a slot). `alloc` fills the class's fullest page
first, so pages empty out and return. `evacuation` names a page whose live slots, and the link
row lying on it, fit in the class's other free slots (the caller moves those blocks, then the
page is free).

A class whose stride exceeds the page ("wide": pages smaller than the largest block, as in
small pools) is the same rule carried further: each of its rows crosses into one or more
following pages, so every row is a link row, a slot only while all the pages it lies on belong
to the class; a page holds the rows that start in it (at most one) and carries the row from an
earlier page that lies on it, and goes back when no allocated row lies on it. Such a class takes
the free pages of one row at a time (`_pick_run`: fewest to take, then the highest row, so wide
classes grow from the top of the data area and the others from the bottom), and `relocation`
clears a row for it by moving the blocks of other classes lying on the row's pages into their
classes' free slots off the row, taking free pages off the row where those do not suffice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

UNIT = 256
"""Slot alignment in bytes: every slot starts at a multiple of it, block strides are multiples of
it (the copy paths need nothing coarser; 4 KiB-multiple blocks stay 4 KiB-aligned)."""


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def geometric(cls: int) -> int:
    """The stride of class `cls`: a class is named by its stride, plus a tag below `UNIT` when
    classes of one stride must keep apart (a tenant's own classes in an isolated pool,
    `kvtier.tiers.dram_regions`); pages, rows and bytes follow the stride alone."""
    return cls - cls % UNIT


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
        self.ids_per_page = -(-page_bytes // min_stride)
        self.slot_ids = page_count * self.ids_per_page
        self._free_pages = list(range(page_count - 1, -1, -1))
        self._stride = [0] * page_count  # 0: free page
        self._per_page: dict[tuple[int, int], int] = {}  # `per_page`'s answers, this layout
        self._live = [0] * page_count
        self._page_free: dict[int, list[int]] = {}  # page -> its free slot ids (LIFO)
        self._class_pages: dict[int, set[int]] = {}  # stride -> its pages
        self._class_free: dict[int, int] = {}  # stride -> free slots over its pages
        self._allocated = bytearray(self.slot_ids)
        self.used = 0  # allocated slots
        self.used_bytes = 0  # their strides
        # told (page, class stride) when a free page joins a class and (page, 0) when it goes
        # back: the pool backs each page with its class's memory (`kvtier.tiers.dram_regions`)
        self.backing: Callable[[int, int], None] | None = None

    # -- geometry -----------------------------------------------------------------------

    def stride_for(self, nbytes: int) -> int:
        """The class a block of `nbytes` goes to (raises for a block the data area cannot
        hold; a block larger than a page spans adjacent pages of its class)."""
        stride = max(round_up(nbytes, UNIT), self.min_stride)
        if nbytes <= 0 or stride > self.page_bytes * self.page_count:
            raise ValueError(f"a {nbytes}-byte block does not fit {self.page_count} pages of "
                             f"{self.page_bytes} B")
        return stride

    def inside(self, stride: int, p: int) -> int:
        """Rows of the `stride` grid that lie wholly inside page `p`."""
        stride = geometric(stride)
        return max(0, (p + 1) * self.page_bytes // stride - -(-(p * self.page_bytes) // stride))

    def _tail(self, stride: int, p: int) -> int:
        """The last page of the row of the `stride` grid that starts in page `p` and ends past
        it (inside the data area); -1 when there is none."""
        stride = geometric(stride)
        end = (p + 1) * self.page_bytes
        row = -(-end // stride) - 1  # the last row starting before the end of page p
        if row * stride < p * self.page_bytes or (row + 1) * stride <= end \
                or (row + 1) * stride > self.page_bytes * self.page_count:
            return -1
        return ((row + 1) * stride - 1) // self.page_bytes

    def _crosses(self, stride: int, p: int) -> bool:
        """Whether a row of the `stride` grid starts in page `p` and ends in a later page."""
        return self._tail(stride, p) >= 0

    def _linked(self, p: int) -> bool:
        """Whether page `p`'s link row is a slot: a row starts in p and ends in a later page,
        and p and every page it reaches are pages of one class."""
        s = self._stride[p]
        last = self._tail(s, p) if s else -1
        return last >= 0 and all(self._stride[q] == s for q in range(p + 1, last + 1))

    def _over(self, p: int) -> int:
        """The page where the link row lying on page `p` but starting before it starts (that
        row a slot of p's class), -1 when none."""
        s = self._stride[p]
        g = geometric(s)
        if not s or p * self.page_bytes % g == 0:
            return -1
        p0 = p * self.page_bytes // g * g // self.page_bytes
        return p0 if self._stride[p0] == s and self._linked(p0) else -1

    def _link_slot(self, p: int) -> int:
        return p * self.ids_per_page + self.inside(self._stride[p], p)

    def per_page(self, stride: int, p: int) -> int:
        """Slots page `p` holds in class `stride`: rows wholly inside it, and its link row when
        p is a page of that class linked to the next one. Remembered until a page changes
        class (`_own`, `_release_page`): every slot's location and free asks it."""
        n = self._per_page.get((stride, p))
        if n is None:
            n = self._per_page[stride, p] = self.inside(stride, p) + (
                self._stride[p] == stride and self._linked(p))
        return n

    def _borrowed(self, p: int) -> bool:
        """Whether the link row of an earlier page that lies partly on page `p` is allocated."""
        p0 = self._over(p)
        return p0 >= 0 and bool(self._allocated[self._link_slot(p0)])

    def page_class(self, p: int) -> int:
        """The stride of page `p`'s class, 0 for a free page."""
        return self._stride[p]

    def _first_row(self, p: int) -> int:
        return -(-(p * self.page_bytes) // geometric(self._stride[p]))

    def page_of(self, slot: int) -> int:
        return slot // self.ids_per_page

    def stride_of(self, slot: int) -> int:
        """The stride of an allocated slot's class (the bytes it spans)."""
        self.check(slot)
        return geometric(self._stride[slot // self.ids_per_page])

    def location(self, slot: int) -> int:
        """Byte offset of a slot from the start of the data area (slot must be valid)."""
        p, j = divmod(slot, self.ids_per_page)
        stride = self._stride[p]
        if not stride or j >= self.per_page(stride, p):
            raise ValueError(f"slot {slot} is not a slot of an allocated page")
        g = stride - stride % UNIT  # `geometric` and `_first_row` inline: every reply's offsets
        return (-(-(p * self.page_bytes) // g) + j) * g

    def slot_at(self, location: int) -> int | None:
        """The slot id starting at `location` (from the data area), None if no slot starts there."""
        p = location // self.page_bytes
        if not 0 <= p < self.page_count or not self._stride[p]:
            return None
        stride = self._stride[p]
        row, rest = divmod(location, geometric(stride))
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

    def _wide(self, stride: int) -> bool:
        """Whether class `stride`'s rows are larger than a page (each spans 2+ pages)."""
        return geometric(stride) > self.page_bytes

    def _span(self, stride: int, row: int) -> range:
        """The pages row `row` of the `stride` grid lies on."""
        stride = geometric(stride)
        return range(row * stride // self.page_bytes,
                     ((row + 1) * stride - 1) // self.page_bytes + 1)

    def _gain(self, stride: int, q: int, st: list[int]) -> tuple[int, int, int]:
        """(slots class `stride` gains by taking free page q — link rows with its pages on
        either side included —, how many of q's neighbours are its pages, -q) under page
        classes `st`."""
        left = q > 0 and st[q - 1] == stride
        right = q + 1 < self.page_count and st[q + 1] == stride
        links = (left and self._crosses(stride, q - 1)) + (right and self._crosses(stride, q))
        return self.inside(stride, q) + links, left + right, -q

    def _pick(self, stride: int, free: list[int], st: list[int]) -> list[int] | None:
        """The free pages `_take_page` gives class `stride`: the page that adds most slots
        (its link rows with the class's pages on either side included), next to its own pages
        if it can, the lowest; when no single page adds a slot (a stride over half a page: a
        page may hold no whole row), or for a wide class, the pages of one row
        (`_pick_run`). None when no free pages make a slot."""
        if not self._wide(stride):
            p = max(free, key=lambda q: self._gain(stride, q, st), default=None)
            if p is not None and self._gain(stride, p, st)[0]:
                return [p]
            if 2 * geometric(stride) <= self.page_bytes:
                return None
        return self._pick_run(stride, st)

    def _pick_run(self, stride: int, st: list[int]) -> list[int] | None:
        """The free pages a wide class (rows larger than a page) takes for one more row under
        page classes `st`: of the rows whose pages are all free or its own (not all its own),
        the one that needs fewest free pages, the highest — wide classes fill the data area
        from its top, the others from its bottom, so their pages mix less. None if none."""
        best: tuple[int, int] | None = None
        for r in range(self.page_bytes * self.page_count // geometric(stride)):
            span = self._span(stride, r)
            if any(st[q] not in (0, stride) for q in span):
                continue
            need = sum(not st[q] for q in span)
            if need and (best is None or (-need, r) > best):
                best = (-need, r)
        if best is None:
            return None
        return [q for q in self._span(stride, best[1]) if not st[q]]

    def _run_gain(self, stride: int, run: list[int], st: list[int]) -> int:
        """Rows of class `stride` that become slots when it takes the free pages `run`."""
        new, page, g = set(run), self.page_bytes, geometric(stride)
        rows: set[int] = set()
        for q in run:
            rows.update(range(q * page // g, ((q + 1) * page - 1) // g + 1))
        return sum((r + 1) * g <= page * self.page_count
                   and all(st[q] == stride or q in new for q in self._span(stride, r))
                   for r in rows)

    def _could_take(self, stride: int, need: int) -> int:
        """Slots class `stride` would gain by taking free pages as `alloc_many` does, until
        `need` (or every page that holds a row) is taken."""
        st, free, got = list(self._stride), list(self._free_pages), 0
        while got < need:
            run = self._pick(stride, free, st)
            if run is None:
                break
            got += self._gain(stride, run[0], st)[0] if len(run) == 1 and not self._wide(
                stride) else self._run_gain(stride, run, st)
            for q in run:
                free.remove(q)
                st[q] = stride
        return got

    def can_alloc(self, n: int, stride: int) -> bool:
        short = n - self._class_free.get(stride, 0)
        return short <= 0 or self._could_take(stride, short) >= short

    def room(self, stride: int) -> int:
        """Free slots of class `stride`: its own plus what the free pages would hold."""
        return self._class_free.get(stride, 0) + self._could_take(stride, self.slot_ids)

    def alloc_many(self, n: int, stride: int) -> list[int] | None:
        """`n` slots of class `stride`, all or none (None when they do not fit)."""
        if n <= 0:
            return []
        if not self.can_alloc(n, stride):
            return None
        taken: list[int] = []
        while self._class_free.get(stride, 0) < n:
            taken.extend(self._take_page(stride))
        pages = sorted((p for p in self._class_pages[stride] if p in self._page_free),
                       key=lambda p: len(self._page_free[p]))
        got: list[int] = []
        for p in pages:
            free = self._page_free[p]
            take = min(len(free), n - len(got))
            got.extend(free.pop() for _ in range(take))
            self._live[p] += take
            if not free:
                del self._page_free[p]
            if len(got) == n:
                break
        self._class_free[stride] -= n
        for s in got:
            self._allocated[s] = 1
        self.used += n
        self.used_bytes += n * geometric(stride)
        self._untake(stride, taken)
        return got

    def _untake(self, stride: int, pages: list[int]) -> None:
        """Gives back those of `pages` (just taken by class `stride`) that no allocated row
        lies on (a run taken for a wide row that fuller pages' slots made unneeded)."""
        for q in pages:
            if self._stride[q] == stride and not self._live[q] and not self._borrowed(q):
                self._release_page(q)

    def _take_page(self, stride: int) -> list[int]:
        """Gives the class the free page that adds most of its slots (link rows with its pages
        on either side included), next to its own pages if it can, the lowest such page; only
        pages that hold a whole row of it (`can_alloc` counts those). A wide class takes the
        free pages of one row (`_pick_run`)."""
        run = self._pick(stride, self._free_pages, self._stride)
        assert run is not None, "can_alloc was checked"
        for q in run:
            self._own(stride, q)
        return run

    def _own(self, stride: int, p: int) -> None:
        """Free page `p` becomes a page of class `stride`: the rows that now lie on pages of
        the class only (those starting in p, and the link row from an earlier page lying on p)
        become free slots."""
        if self.backing is not None:
            self.backing(p, stride)
        self._free_pages.remove(p)
        self._stride[p] = stride
        self._per_page.clear()
        k = self.per_page(stride, p)
        base = p * self.ids_per_page
        if k:
            self._page_free[p] = list(range(base + k - 1, base - 1, -1))
        self._live[p] = 0
        self._class_pages.setdefault(stride, set()).add(p)
        self._class_free[stride] = self._class_free.get(stride, 0) + k
        p0 = self._over(p)
        if p0 >= 0:  # an earlier page's link row is a slot now
            self._page_free.setdefault(p0, []).insert(0, self._link_slot(p0))
            self._class_free[stride] += 1

    def free(self, slot: int) -> int:
        """Frees an allocated slot; returns the bytes it spanned (its `stride_of`)."""
        self.check(slot)
        p = slot // self.ids_per_page
        stride = self._stride[p]
        nbytes = geometric(stride)
        loc = self.location(slot)
        span = range(loc // self.page_bytes, (loc + nbytes - 1) // self.page_bytes + 1)
        self._allocated[slot] = 0
        self.used -= 1
        self.used_bytes -= nbytes
        self._live[p] -= 1
        self._page_free.setdefault(p, []).append(slot)
        self._class_free[stride] += 1
        for q in span:  # its pages go back when no allocated row lies on them any more
            if self._stride[q] == stride and not self._live[q] and not self._borrowed(q):
                self._release_page(q)
        return nbytes

    def free_many(self, slots: list[int]) -> int:
        """`free` of each slot, in order (the same pages go back), with the lookups hoisted out
        of the loop: an operator's evict frees ~10^5 slots at once. Checks them all first
        (allocated, each once) and frees none when one fails; returns the bytes they spanned."""
        alloc = self._allocated
        if not slots:
            return 0
        if len(set(slots)) != len(slots):
            raise ValueError("a slot repeats")
        if min(slots) < 0 or max(slots) >= self.slot_ids or not all(map(alloc.__getitem__,
                                                                        slots)):
            bad = next(s for s in slots if not self.is_allocated(s))
            self.check(bad)
        ipp, page, st, live = self.ids_per_page, self.page_bytes, self._stride, self._live
        page_free, class_free = self._page_free, self._class_free
        inside: dict[int, int] = {}  # page -> its rows wholly inside it (a page's class stays
        # within this call: a page goes back only once its last slot is freed)
        total = 0
        for slot in slots:
            p, j = divmod(slot, ipp)
            stride = st[p]
            g = stride - stride % UNIT
            alloc[slot] = 0
            live[p] -= 1
            free = page_free.get(p)
            if free is None:
                page_free[p] = [slot]
            else:
                free.append(slot)
            class_free[stride] += 1
            total += g
            k = inside.get(p)
            if k is None:
                k = inside[p] = self.inside(stride, p)
            if j < k:  # wholly inside page p: the only page it lies on
                if not live[p] and not self._borrowed(p):
                    self._release_page(p)
                continue
            loc = (-(-(p * page) // g) + j) * g  # a link row (or a wide class's row)
            for q in range(loc // page, (loc + g - 1) // page + 1):
                if st[q] == stride and not live[q] and not self._borrowed(q):
                    self._release_page(q)
        self.used -= len(slots)
        self.used_bytes -= total
        return total

    def _release_page(self, p: int) -> None:
        stride = self._stride[p]
        self._page_free.pop(p, None)
        self._class_free[stride] -= self.per_page(stride, p)
        p0 = self._over(p)
        if p0 >= 0:  # the (free) link row of an earlier page that lies on p goes
            t = self._link_slot(p0)
            left = self._page_free[p0]
            left.remove(t)
            if not left:
                del self._page_free[p0]
            self._class_free[stride] -= 1
        pages = self._class_pages[stride]
        pages.discard(p)
        if not pages:
            del self._class_pages[stride], self._class_free[stride]
        self._stride[p] = 0
        self._per_page.clear()
        self._free_pages.append(p)
        if self.backing is not None:
            self.backing(p, 0)

    def adopt(self, slots: dict[int, int]) -> list[int]:
        """Marks `slots` (slot id -> class) allocated in a table that has none yet, each page
        their rows lie on taken by their class: a kept pool's blocks, re-adopted by a successor
        daemon (`kvtier.tiers.dram_keep`). A slot that is no row of its class's grid starting
        in its page, or whose row lies on a page an earlier slot's class took, is left out and
        returned (its record was wrong: nothing is adopted into it)."""
        if self.used:
            raise ValueError("adopt needs a table without allocated slots")
        page_of: dict[int, int] = {}  # page -> the class that takes it
        rows: list[tuple[int, int]] = []
        bad: list[int] = []
        pb, ids = self.page_bytes, self.ids_per_page
        end = pb * self.page_count
        for s, cls in sorted(slots.items()):
            p, j = divmod(s, ids)
            g = cls - cls % UNIT  # `geometric`, inline: a kept pool may hold millions
            start = (-(-(p * pb) // g) + j) * g if g > 0 else -1
            if not 0 <= p < self.page_count or g < self.min_stride or not 0 <= start < (
                    p + 1) * pb or start + g > end:
                bad.append(s)
                continue
            q0, q1 = start // pb, (start + g - 1) // pb
            if q0 == q1:  # a row inside one page (most)
                if page_of.setdefault(q0, cls) != cls:
                    bad.append(s)
                    continue
            else:
                span = range(q0, q1 + 1)
                if any(page_of.get(q, cls) != cls for q in span):
                    bad.append(s)
                    continue
                for q in span:
                    page_of[q] = cls
            rows.append((s, cls))
        for q in sorted(page_of):
            self._own(page_of[q], q)
        by_page: dict[int, set[int]] = {}
        free: dict[int, set[int]] = {}  # (sets: `claim`'s list removal is quadratic here)
        for s, _ in rows:
            p = s // self.ids_per_page
            if p not in free:
                free[p] = set(self._page_free.get(p, ()))
            if s in free[p]:
                free[p].discard(s)
                by_page.setdefault(p, set()).add(s)
            else:
                bad.append(s)
        for p, taken in by_page.items():  # `claim`, a page at a time
            if not taken:
                continue
            left = [s for s in self._page_free[p] if s not in taken]
            if left:
                self._page_free[p] = left
            else:
                del self._page_free[p]
            stride = self._stride[p]
            self._live[p] += len(taken)
            self._class_free[stride] -= len(taken)
            for s in taken:
                self._allocated[s] = 1
            self.used += len(taken)
            self.used_bytes += len(taken) * geometric(stride)
        for q, cls in page_of.items():  # pages no adopted row kept (a rejected one's)
            self._untake(cls, [q])
        return sorted(bad)

    # -- reclaim ---------------------------------------------------------------------------

    def live_slots(self, p: int) -> list[int]:
        """Page `p`'s own allocated slots (its link row included)."""
        base, stride = p * self.ids_per_page, self._stride[p]
        if not stride:
            return []
        return [s for s in range(base, base + self.per_page(stride, p)) if self._allocated[s]]

    def _on_page(self, p: int) -> list[int]:
        """The slots that lie (partly) on page `p`: its own, and an earlier page's link row."""
        own = [p * self.ids_per_page + j for j in range(self.per_page(self._stride[p], p))]
        p0 = self._over(p)
        return [*own, self._link_slot(p0)] if p0 >= 0 else own

    def _missing(self, want: int, p: int, st: list[int]) -> int:
        """For a wide class `want`: of the rows lying on page `p`, the fewest other pages one
        of them still needs freed (pages of other classes) once p is free."""
        page, end, g = self.page_bytes, self.page_bytes * self.page_count, geometric(want)
        rows = range(p * page // g, ((p + 1) * page - 1) // g + 1)
        return min((sum(q != p and st[q] not in (0, want) for q in self._span(want, r))
                    for r in rows if (r + 1) * g <= end), default=self.page_count)

    def evacuation(self, stride: int, movable: Callable[[int], bool],
                   want: int = 0) -> tuple[int, list[int]] | None:
        """A page of class `stride` whose live slots (an earlier page's link row on it
        included) are all `movable` and fit in the class's free slots off the page: (page,
        those live slots); None if none. Of those, the page whose release keeps most link rows:
        most gained by class `want` (the one that will take it) if it takes the page — for a
        wide `want`, the page whose row then needs fewest other pages freed —, fewest lost by
        class `stride`; then fewest live."""
        free = self._class_free.get(stride, 0)
        st = self._stride

        def counts(p: int) -> tuple[int, int]:  # (live, all) slots lying on page p
            p0 = self._over(p)
            borrowed = p0 >= 0 and bool(self._allocated[self._link_slot(p0)])
            return self._live[p] + borrowed, self.per_page(stride, p) + (p0 >= 0)

        def cost(p: int) -> tuple[int, int, int]:
            lost = (self._over(p) >= 0) + self._linked(p)
            gained = 0
            if want and self._wide(want):
                gained = -self._missing(want, p, st)
            elif want and self.inside(want, p):
                gained = self._gain(want, p, st)[0] - self.inside(want, p)
            return -gained, lost, counts(p)[0]

        fits = [p for p in self._class_pages.get(stride, ())
                if (c := counts(p))[0] <= free - (c[1] - c[0])]
        for p in sorted(fits, key=cost):
            live = [s for s in self._on_page(p) if self._allocated[s]]
            if all(map(movable, live)):
                return p, live
        return None

    def relocation(self, want: int, movable: Callable[[int], bool]) -> list[tuple[int, int]]:
        """Clears one row of a wide class `want` (rows larger than a page) by moving the blocks
        of other classes that lie on its pages into free slots of their own classes off those
        pages — taking free pages off the row for a class whose free slots do not suffice —,
        when every one of them is `movable`. Of the rows that can be cleared so, the one that
        moves fewest bytes, the highest; free pages on rows of `want` that are ready (all their
        pages free or its own) are not taken. Returns (old, new) pairs with the new slots claimed:
        the caller copies each block, repoints its owner and frees the old slot, and the row's
        pages go back. [] when no row can be cleared so (nothing changed)."""
        st, end = self._stride, self.page_bytes * self.page_count
        best: tuple[int, int, dict[int, list[int]]] | None = None
        rows = end // geometric(want)
        spans = [self._span(want, r) for r in range(rows)]
        ready = {q for span in spans if all(st[q] in (0, want) for q in span)
                 for q in span}  # free pages kept for `want`
        for r in range(rows):
            run = self._span(want, r)
            if all(st[q] in (0, want) for q in run) or any(
                    st[q] != want and self._wide(st[q]) for q in run if st[q]):
                continue
            lying: dict[int, set[int]] = {}
            for q in run:
                if st[q] not in (0, want):
                    lying.setdefault(st[q], set()).update(self._on_page(q))
            offfree = sorted(q for q in self._free_pages if q not in run and q not in ready)
            plan: dict[int, list[int]] = {}
            cost = 0
            for c, slots in lying.items():
                live = [s for s in slots if self._allocated[s]]
                if not all(map(movable, live)):
                    break
                short = len(live) - (self._class_free[c] - (len(slots) - len(live)))
                while short > 0 and offfree:
                    q = offfree.pop(0)
                    plan.setdefault(c, []).append(q)
                    short -= self.inside(c, q)
                if short > 0:
                    break
                cost += len(live) * geometric(c)
            else:
                if best is None or (cost, -r) < (best[0], -best[1]):
                    best = (cost, r, plan)
        if best is None:
            return []
        _, r, plan = best
        run = self._span(want, r)
        pairs: list[tuple[int, int]] = []
        for c in {st[q] for q in run} - {0, want}:
            for q in plan.get(c, ()):
                self._own(c, q)
            skip = {s for q in run if st[q] == c for s in self._on_page(q)}
            live = sorted(s for s in skip if self._allocated[s])
            dst = [s for p in self._class_pages[c] for s in self._page_free.get(p, ())
                   if s not in skip][:len(live)]
            assert len(dst) == len(live), "planned room"
            self.claim(dst)
            pairs.extend(zip(live, dst, strict=True))
            self._untake(c, plan.get(c, []))  # a page taken but not needed goes back
        return pairs

    def targets(self, stride: int, avoid: int, n: int) -> list[int]:
        """`n` free slots of class `stride` off page `avoid` (without allocating them)."""
        out: list[int] = []
        mine = 0 <= avoid < self.page_count and self._stride[avoid] == stride
        skip = set(self._on_page(avoid)) if mine else set()
        for p in self._class_pages.get(stride, ()):
            for s in self._page_free.get(p, ()):
                if len(out) >= n:
                    return out
                if s not in skip:
                    out.append(s)
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
            self.used_bytes += geometric(self._stride[p])

    # -- accounting -----------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def strides(self) -> set[int]:
        """The classes that hold pages."""
        return set(self._class_pages)

    def classes(self) -> list[ClassStats]:
        return [ClassStats(s, len(pages), sum(self._live[p] for p in pages),
                           sum(self.per_page(s, p) for p in pages))
                for s, pages in sorted(self._class_pages.items())]
