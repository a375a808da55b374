"""Another 1-in-16 key sample for the mini simulations: bits SHIFT..SHIFT+7 of the fingerprint
(default 40) instead of its top byte (how much of a cell's figure is the luck of the sample)."""

import os

from kvtier.index.policies.adaptive import policy as pa

pa.AdaptivePolicy.sample_shift = int(os.environ.get("SHIFT", "40"))
