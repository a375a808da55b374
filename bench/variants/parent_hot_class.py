"""A fourth prefix-hit class for the predictor: the parent block was accessed PH (default 8) or
more times (besides none / first reuse / reused before): 768 buckets instead of 576."""

import os

from bench.variants._edit import edited
from kvtier.index.policies.adaptive import policy as pa
from kvtier.index.policies.adaptive import predictor

predictor.BUCKETS = 8 * 3 * 4 * 4 * 2
edited(pa.AdaptivePolicy, "admit",
       [("hit = 0 if parent is None else 1 if parent.stamp & HITS_MAX <= 2 else 2",
         "ph = 0 if parent is None else parent.stamp & HITS_MAX\n"
         "    hit = 0 if parent is None else 1 if ph <= 2 else 2 if ph < PH else 3"),
        ("* 3 + hit) * 4", "* 4 + hit) * 4")],
       {"PH": int(os.environ.get("PH", "8"))})
