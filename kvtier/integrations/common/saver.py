"""An engine's background stores (`Saver`) and its prefill clock (`PrefillClock`), on the
worker side (vLLM's connector workers use them).

    Saver          staged blocks (copied out of the engine's KV cache on its own thread: vLLM's
                   `wait_for_save`) are stored by one "kvtier-save" thread, in submission order
                   (a chain's parent is committed before its children). At most `max_bytes`
                   staged bytes wait: a step that would exceed it waits for the saves before it
                   (backpressure, never a drop). A store that fails is one warning and a future
                   miss (an unreachable daemon: the link's one warning per outage; later stores
                   are skipped until it is back), and the request's later saves are skipped
                   (their parent is not stored, the daemon would refuse them). With
                   `background=False` everything runs on the caller's thread. How a staged job
                   reaches the slots is the engine's (`store`, given by the owner); a job
                   skipped for a broken chain goes to `discard` instead (to end the lease of
                   an Allocate made before it was staged: a prefill's hand-off).
    PrefillClock   times the steps that compute one prompt chunk (wall clock on CPU, CUDA events
                   on a GPU) and hands out the latest at most every `every_s` seconds (for the
                   daemon planner's ReportPrefill).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.integrations.common.link import DaemonLink, unreachable

log = logging.getLogger("kvtier.integrations.common")


@dataclass(slots=True)
class Staged:
    req_id: str
    keys: list[bytes]
    parent: bytes
    blocks: torch.Tensor
    """[chunks, len(keys), chunk_bytes] uint8 (CPU): chunk c of every block, the bytes a slot
    holds at [c * chunk_bytes, (c + 1) * chunk_bytes) (vLLM: `integrations/vllm/pages.py`)."""
    ready: Any = None
    """A CUDA event to synchronize before reading `blocks` (filled by an async copy)."""
    pin_s: float = 0.0
    """A request's pin hint: once stored, pin `chain` (its keys up to these) this long."""
    chain: list[bytes] = field(default_factory=list)
    allocated: Any = None
    """The daemon's reply to an Allocate of `keys` made before the job was queued (a
    hand-off's: the keys pending from then on), or None (the store allocates)."""
    verify: Any = None
    """Shadow verification: what the engine's `store` compares first (the engine's own)."""


@dataclass(slots=True)
class _Report:
    tokens: int
    seconds: float
    context: int


class Saver:
    def __init__(self, link: DaemonLink, store: Callable[[Staged], None], max_bytes: int,
                 background: bool, report_failed: Callable[[int, float, int], None],
                 discard: Callable[[Staged], None] | None = None) -> None:
        self.link = link
        self.store = store
        self.discard = discard
        self.report_failed = report_failed
        self.max_bytes = max_bytes
        self.background = background
        self._cond = threading.Condition()
        self._queue: deque[Staged | _Report | None] = deque()
        self._bytes = 0
        self._busy = False
        self._broken: OrderedDict[str, None] = OrderedDict()
        """Requests whose chain a failed save broke (the latest 1,024)."""
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="kvtier-save", daemon=True)
            self._thread.start()

    def submit(self, staged: Staged) -> None:
        if not self.background:
            self._run(staged)
            return
        n = staged.blocks.numel()
        with self._cond:
            while self._bytes and self._bytes + n > self.max_bytes:
                self._cond.wait()
            self._bytes += n
            self._queue.append(staged)
            self._cond.notify_all()

    def report_prefill(self, tokens: int, seconds: float, context: int) -> None:
        report = _Report(tokens, seconds, context)
        if not self.background:
            self._run(report)
            return
        with self._cond:
            self._queue.append(report)
            self._cond.notify_all()

    def broken(self, req_id: str) -> bool:
        """Whether a failed save broke the request's chain (its later saves are skipped)."""
        return req_id in self._broken

    def mark_broken(self, req_id: str) -> None:
        self._broken[req_id] = None
        while len(self._broken) > 1024:
            self._broken.popitem(last=False)

    def idle(self, timeout: float) -> bool:
        """Waits until every submitted save is done (or `timeout`); whether it is."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self, item: Staged | _Report) -> None:
        try:
            if isinstance(item, _Report):
                client = self.link.client()
                if client is not None:
                    client.report_prefill(item.tokens, item.seconds, item.context)
            elif item.req_id not in self._broken:
                self.store(item)
            elif self.discard is not None:
                self.discard(item)
        except Exception as exc:
            if isinstance(item, _Report):  # offered again at the next step
                self.report_failed(item.tokens, item.seconds, item.context)
                if unreachable(exc):
                    self.link.failed(exc, "ReportPrefill")
                else:
                    log.debug("kvtier: ReportPrefill failed: %s", exc)
            else:
                self.mark_broken(item.req_id)
                self.link.failed(exc, "store")

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                item = self._queue.popleft()
                self._busy = item is not None
            if item is None:
                return
            self._run(item)
            with self._cond:
                if isinstance(item, Staged):
                    self._bytes -= item.blocks.numel()
                self._busy = False
                self._cond.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        """Finishes the queued saves (up to `timeout`), then stops the thread."""
        if self._thread is None:
            return
        self.idle(timeout)
        with self._cond:
            self._queue.append(None)
            self._cond.notify_all()
        self._thread.join(timeout=1.0)


class PrefillClock:
    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.cuda = False
        self._t0: float | torch.cuda.Event | None = None
        self._events: deque[tuple[torch.cuda.Event, torch.cuda.Event, int, int]] = deque()
        self._latest: tuple[int, float, int] | None = None
        self._next = 0.0

    def start(self) -> None:
        if self.every_s <= 0:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ev.record()
            self._t0 = ev
        else:
            self._t0 = time.perf_counter()

    def stop(self, tokens: int, context: int) -> None:
        t0, self._t0 = self._t0, None
        if t0 is None:
            return
        if isinstance(t0, float):
            self._latest = (tokens, time.perf_counter() - t0, context)
            return
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record()
        self._events.append((t0, end, tokens, context))
        while len(self._events) > 8:
            self._events.popleft()

    def retry(self, tokens: int, seconds: float, context: int) -> None:
        """A report did not reach the daemon: offer it again at the next step (unless a newer
        sample came meanwhile)."""
        if self._latest is None:
            self._latest = (tokens, seconds, context)
        self._next = 0.0

    def due(self) -> tuple[int, float, int] | None:
        """(tokens, seconds, context tokens) of the latest timed step, if it is time to report."""
        while self._events and self._events[0][1].query():  # type: ignore[no-untyped-call]
            begin, end, tokens, context = self._events.popleft()
            self._latest = (tokens, begin.elapsed_time(end) / 1e3, context)
        if self._latest is None or time.monotonic() < self._next:
            return None
        self._next = time.monotonic() + self.every_s
        latest, self._latest = self._latest, None
        return latest
