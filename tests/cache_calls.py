"""Tests that drive a `Cache` in-process call it as the transports do: `run` awaits a call
(`Cache.lookup_async`, `acquire_async`, `allocate_async`) on an event loop, so its waits (SSD and
remote reads, page-move copies) run on the loop's worker threads without the cache lock, as in
the daemon. `Gate` stops such a step on its worker thread, so a test can act between the steps.

The loop is one per test (the main thread's), closed after it by tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_runner: asyncio.Runner | None = None


def run(call: Coroutine[Any, Any, T]) -> T:
    """`call` awaited to its end on the test's event loop (main thread only)."""
    global _runner
    assert threading.current_thread() is threading.main_thread(), "run on the test's thread"
    if _runner is None:
        _runner = asyncio.Runner()
    return _runner.run(call)


def close() -> None:
    """Closes the test's loop, if it made one (its worker threads joined)."""
    global _runner
    if _runner is not None:
        runner, _runner = _runner, None
        runner.close()


async def until(done: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Waits on the loop until `done()` (checked between the loop's other callbacks)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.001)


class Gate:
    """Holds the first call of `owner.<name>` (a step the cache runs on a worker thread, such
    as `DramPool.copy_moves` or `Residency.read_claimed`) before it runs, until `open`; later
    calls pass. As a context manager it opens on exit, so a failed test never leaves the worker
    waiting."""

    def __init__(self, owner: object, name: str, lock: Any = None) -> None:
        """`lock`: the cache lock (an RLock); `locked` then says whether the held call's thread
        held it (a step that must run without it)."""
        self.reached = threading.Event()
        self.args: tuple[Any, ...] = ()
        self.locked = False
        self.on_loop = False  # the call ran on the loop's thread (it is not held then)
        self._open = threading.Event()
        self._first = threading.Lock()
        real = getattr(owner, name)

        def held(*args: Any, **kwargs: Any) -> Any:
            if self._first.acquire(blocking=False):
                self.args = args
                self.locked = lock is not None and lock._is_owned()
                self.on_loop = threading.current_thread() is threading.main_thread()
                self.reached.set()
                if not self.on_loop:
                    self._open.wait()
            return real(*args, **kwargs)

        setattr(owner, name, held)

    async def wait(self) -> tuple[Any, ...]:
        """Until a call reached the gate (on a thread other than the loop's, without the
        `lock`); its arguments."""
        await asyncio.to_thread(self.reached.wait, 60.0)
        assert self.reached.is_set(), "no call reached the gate"
        assert not self.on_loop, "the call ran on the event loop's thread"
        assert not self.locked, "the held call's thread holds the cache lock"
        return self.args

    def open(self) -> None:
        self._open.set()

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()


async def not_done_within(task: Awaitable[object], seconds: float) -> bool:
    """Whether `task` is still running after `seconds` (a wait that can only show it waits)."""
    done, _ = await asyncio.wait({asyncio.ensure_future(task)}, timeout=seconds)
    return not done
