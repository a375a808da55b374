"""Mini simulations sampling 1 key in RATE (default 8, the policy's default since the fourth pass;
it was 16 before)."""

import os

from kvtier.index.policies.adaptive import minisim as pm

_init = pm.MiniSims.__init__
_defaults = list(_init.__defaults__ or ())
_defaults[0] = int(os.environ.get("RATE", "8"))
_init.__defaults__ = tuple(_defaults)
