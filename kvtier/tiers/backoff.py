"""Up/down state of a remote dependency, with exponential backoff between reconnect attempts.

Pure logic with an injected clock. While up, every call may go through. The first failure takes
it down (`failed` returns True once, so the caller logs one warning per outage); while down,
`ready` turns true once per backoff interval (one probe: the next call) and each failed probe
doubles the interval up to `max_s`. A success brings it back up (`succeeded` returns True once,
for one recovery line) and resets the interval.

Thread-safe: one lock; several threads may probe at once after the interval (harmless: each is
one bounded-wait request).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Backoff:
    def __init__(
        self, first_s: float = 0.5, max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"backoff needs 0 < first_s <= max_s, got {first_s}, {max_s}")
        self.first_s = first_s
        self.max_s = max_s
        self._clock = clock
        self._lock = threading.Lock()
        self._up = True
        self._delay = first_s
        self._retry_at = 0.0
        self.outages = 0

    @property
    def up(self) -> bool:
        return self._up

    def ready(self) -> bool:
        """Whether a request should be tried now (up, or the backoff interval has passed)."""
        with self._lock:
            return self._up or self._clock() >= self._retry_at

    def retry_in(self) -> float:
        """Seconds until the next probe (0 while up or due)."""
        with self._lock:
            return 0.0 if self._up else max(0.0, self._retry_at - self._clock())

    def failed(self) -> bool:
        """Records a failed request; True when it took the dependency down (a new outage)."""
        with self._lock:
            was_up = self._up
            if was_up:
                self._up = False
                self._delay = self.first_s
                self.outages += 1
            else:
                self._delay = min(self.max_s, self._delay * 2)
            self._retry_at = self._clock() + self._delay
            return was_up

    def succeeded(self) -> bool:
        """Records a successful request; True when it ended an outage."""
        with self._lock:
            was_down = not self._up
            self._up = True
            self._delay = self.first_s
            return was_down
