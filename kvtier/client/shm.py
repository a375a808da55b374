"""A client's mapping of the daemon's DRAM segment (shared by `kvtier.client.sync_client` and
`kvtier.client.async_client`): attach/re-attach by the daemon's `SegmentInfo`, slot numbers from
offsets, and the `SlotBuffer` zero-copy engines copy through.

Lifetime: a `MappedSegment` belongs to one pool generation; a reply naming another generation
(the daemon restarted) replaces it (`adopt`) and the old mapping is closed — its memory stays
valid while arrays over it are referenced (the unmap waits for them), but it no longer is the
daemon's pool. A pool that could not be mapped (its fd fetch refused, timed out or crowded out)
leaves the client on the streaming path only until the next try: `uses_shm` tries again once
`RETRY_FIRST_S` has passed, then after twice as long each time up to `RETRY_MAX_S`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvtier._proto import kvtier_pb2 as pb
from kvtier.client.mapping import DramClient
from kvtier.core.segment import VERSION as SEGMENT_VERSION
from kvtier.core.segment import SegmentHandle, StaleSegment, fd_socket_path, slot_array

U8 = npt.NDArray[np.uint8]

log = logging.getLogger(__name__)
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0


class SlotBuffer(NamedTuple):
    """The mapped DRAM segment for zero-copy engines: slot i is the `slot_bytes` bytes at
    `segment[data_offset + i * slot_stride:]`. `array()` is the [slot_count, slot_bytes] view
    (`kvtier.core.segment.slot_array`) a `TransferEngine` takes; rows are `Loaded.slots` /
    `StoreTx.slot_ids`. No copy: it shares memory with the mapping. `generation` names the
    daemon's pool; indices from a call answered by another generation do not apply to it.
    """

    segment: U8
    data_offset: int
    slot_count: int
    slot_bytes: int
    slot_stride: int
    generation: int

    def array(self) -> U8:
        return slot_array(self.segment, self.data_offset, self.slot_count, self.slot_bytes,
                          self.slot_stride)


@dataclass(slots=True)
class MappedSegment:
    info: pb.SegmentInfo
    dram: DramClient | None = None
    failed: bool = False
    retry_in: float = 0.0  # after a failure: the wait before the next try, and the next one's
    retry_at: float = 0.0

    def retry_due(self) -> bool:
        """A mapping that failed may be tried again now."""
        return self.failed and time.monotonic() >= self.retry_at

    def slot(self, offset: int) -> int:
        return (offset - self.info.data_offset) // self.info.slot_stride

    def slots(self, offsets: Iterable[int]) -> list[int]:
        """`slot` of each offset."""
        start, stride = self.info.data_offset, self.info.slot_stride
        return [(o - start) // stride for o in offsets]

    def view(self, offset: int, nbytes: int) -> U8:
        assert self.dram is not None
        return self.dram.view_at(offset, nbytes)

    def views(self, offsets: Sequence[int], nbytes: int) -> list[U8]:
        """`view` of each offset."""
        if not offsets:
            return []
        assert self.dram is not None
        return self.dram.views_at(offsets, nbytes)

    def buffer(self) -> SlotBuffer | None:
        if self.dram is None:
            return None
        i = self.info
        return SlotBuffer(self.dram.buffer, i.data_offset, i.slot_count, i.slot_bytes,
                          i.slot_stride, i.generation)


def segment_handle(info: pb.SegmentInfo) -> SegmentHandle:
    """The header `info` describes; StaleSegment for another segment format (an older daemon
    sends format 0 = one slot size: its slot numbers mean something else)."""
    if info.format_version != SEGMENT_VERSION:
        raise StaleSegment(
            f"the daemon's DRAM segment has format {info.format_version or 1}; this client "
            f"reads format {SEGMENT_VERSION} (upgrade the daemon and its clients together)")
    return SegmentHandle(info.name, info.size, info.generation, info.pool_slot_bytes,
                         info.pool_slot_stride, info.pool_slot_count, info.data_offset,
                         info.shm_dir or "/dev/shm", info.page_bytes, info.page_count)


def adopt(current: MappedSegment | None, info: pb.SegmentInfo, streaming: bool,
          fd_source: tuple[str, str] | None = None) -> MappedSegment:
    """`current` if it maps the pool `info` names, else a new mapping of it (the old one closed);
    with `streaming`, or when the segment cannot be mapped, one without `dram`. A pool with
    tenants (`info.by_fd`) is mapped from the fd its fd socket hands out: `fd_source` is
    (the daemon's Unix socket path, this client's token)."""
    again = current is not None and (current.info.name, current.info.generation) == (
        info.name, info.generation)
    if again and current is not None and not current.retry_due():
        current.info = info  # the same pool seen as another layout's size class
        return current
    if current is not None and current.dram is not None:
        current.dram.close()
    seg = MappedSegment(info)
    if again and current is not None:  # its mapping failed before: the backoff goes on
        seg.retry_in = min(2 * current.retry_in, RETRY_MAX_S)
    if not streaming:
        try:
            if not info.by_fd:
                seg.dram = DramClient.attach(segment_handle(info))
            elif fd_source is None:
                raise StaleSegment("the daemon hands its pool out by fd: that needs its Unix "
                                   "socket and a token")
            else:
                seg.dram = DramClient.attach_fd(
                    segment_handle(info), fd_socket_path(fd_source[0]), fd_source[1])
        except (OSError, StaleSegment) as exc:
            seg.failed = True
            seg.retry_in = seg.retry_in or RETRY_FIRST_S
            seg.retry_at = time.monotonic() + seg.retry_in
            (log.info if again else log.warning)(
                "cannot map the daemon's DRAM segment (%s); using the streaming path, trying "
                "again in %g s", exc, seg.retry_in)
    return seg


class SegmentHolder:
    """The segment state both clients share: the current mapping (None until registered or on
    the streaming path) and what a caller may ask of it. Not thread-safe, like the clients."""

    force_streaming: bool
    target: str
    _token: str = ""  # for the fd socket of a daemon with tenants
    _segment: MappedSegment | None

    def _adopt(self, info: pb.SegmentInfo) -> MappedSegment:
        self._segment = adopt(self._segment, info, self.force_streaming, self._fd_source())
        return self._segment

    def _fd_source(self) -> tuple[str, str] | None:
        """(socket path, token) for a pool handed out by fd; None off a Unix socket."""
        if not self.target.startswith("unix:") or not self._token:
            return None
        return self.target.removeprefix("unix:"), self._token

    @property
    def uses_shm(self) -> bool:
        """Whether calls go through the mapped pool; a pool that could not be mapped is tried
        again here once its backoff is due (module docstring)."""
        seg = self._segment
        if seg is not None and seg.retry_due():
            seg = self._adopt(seg.info)
        return seg is not None and seg.dram is not None

    def register_cuda(self) -> bool:
        """Pins the mapped segment and maps it into the device address space (cudaHostRegister
        Portable|Mapped), so DMA and kernels reach every slot; False without shm, cupy or a GPU.

        Registration belongs to the current mapping: call again after a daemon restart.
        """
        seg = self._segment
        return seg is not None and seg.dram is not None and seg.dram.register_cuda()

    def slot_buffer(self) -> SlotBuffer | None:
        """The mapped segment as a `SlotBuffer` (None on the streaming path); rows are
        `Loaded.slots`. It stays valid memory while referenced; after a daemon restart the client
        maps the new pool, and a later call returns its buffer (compare `generation`)."""
        seg = self._segment
        return seg.buffer() if seg is not None else None

    def _close_segment(self) -> None:
        if self._segment is not None and self._segment.dram is not None:
            self._segment.dram.close()
        self._segment = None
