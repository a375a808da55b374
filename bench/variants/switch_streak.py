"""Hysteresis: the mini simulations switch the order only after STREAK (default 3) epochs in a
row in which the other candidate won by the margin."""

import os
from typing import Any

from bench.variants._edit import edited
from kvtier.index.policies.adaptive import minisim as pm

STREAK = int(os.environ.get("STREAK", "3"))
_streak: dict[int, int] = {}
edited(pm.MiniSims, "feed",
       [("""
            self.best = top.share
""",
         """
            n = _streak[id(self)] = _streak.get(id(self), 0) + 1
            if n >= STREAK:
                self.best = top.share
                _streak[id(self)] = 0
        else:
            _streak[id(self)] = 0
""")],
       {"STREAK": STREAK, "_streak": _streak})
_init = pm.MiniSims.__init__


def init(self: pm.MiniSims, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    _streak[id(self)] = 0  # a new instance may reuse a freed one's id


pm.MiniSims.__init__ = init  # type: ignore[method-assign]
