"""`HOT_HITS` (accesses from which a block enters a queue at the top frequency) = HOT
(default 5)."""

import os

from kvtier.index.policies.adaptive import queue

queue.HOT_HITS = int(os.environ.get("HOT", "5"))
