"""Asymmetric switching margins of the mini simulations: LRU order must beat S3-FIFO order by
TO_LRU (default 1.05) to be chosen, S3-FIFO order LRU's by TO_S3 (default 1.0); on top of
`LRU_MARGIN` since issue 29."""

import os

from bench.variants._edit import edited
from kvtier.index.policies.adaptive import minisim as pm

edited(pm.MiniSims, "feed",
       [("score(top) > score(cur) * self.margin",
         "score(top) > score(cur) * (TO_LRU if top.share >= 1.0 else TO_S3)")],
       {"TO_LRU": float(os.environ.get("TO_LRU", "1.05")),
        "TO_S3": float(os.environ.get("TO_S3", "1.0"))})
