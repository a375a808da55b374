"""Rates per tenant: what one tenant's engines report never moves another tenant's plans.

Clients report realized copy times (Release, Commit) and prefills (ReportPrefill). Each sample goes
to the reporting tenant's own `RateBook` (a `fork` of the node's seeds, made at its first sample or
plan) and to the node's book, which feeds the `kvtier_rate_*` gauges. A tenant's plans use its own
DRAM copy and prefill rates and the SSD read rates the daemon measured itself (`plan_rates`), so a
tenant reporting absurd prefills or copies only misleads its own planner.

Thread-safe (a lock around the table; each `RateBook` locks itself).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvtier.core.planner import PlanRates
from kvtier.daemon.rates import Link, RateBook


class TenantRates:
    def __init__(self, node: RateBook) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._books: dict[str, RateBook] = {}

    def book(self, tenant: str) -> RateBook:
        with self._lock:
            book = self._books.get(tenant)
            if book is None:
                book = self._books[tenant] = self.node.fork()
            return book

    def observe(self, tenant: str, sample: Callable[[RateBook], bool]) -> bool:
        """Feeds one client-reported sample to the node's book and the tenant's; whether the
        tenant's book kept it."""
        sample(self.node)
        return sample(self.book(tenant))

    def plan_rates(self, tenant: str) -> PlanRates:
        own, node = self.book(tenant), self.node
        return PlanRates(own.bandwidth(Link.DRAM_READ), own.latency(Link.DRAM_READ),
                         node.bandwidth(Link.SSD_READ), node.latency(Link.SSD_READ),
                         own.prefill_flops_per_s(), node.bandwidth(Link.REMOTE_READ),
                         node.latency(Link.REMOTE_READ))
