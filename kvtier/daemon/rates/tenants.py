"""Rates per tenant: what one tenant's engines report never moves another tenant's plans.

Clients report realized copy times (Release, Commit) and prefills (ReportPrefill). Each sample goes
to the reporting tenant's own `RateBook` (a `fork` of the node's seeds, made at its first sample or
plan) and to the node's book, which feeds the `kvtier_rate_*` gauges. A tenant's plans use its own
DRAM copy and prefill rates and the SSD read rates the daemon measured itself (`plan_rates`), so a
tenant reporting absurd prefills or copies only misleads its own planner.

Seeds kept from before a restart (`kvtier.daemon.rates.kept`) seed a tenant's book when it is made;
`books()` is what is kept in turn.

Thread-safe (a lock around the table; each `RateBook` locks itself).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from kvtier.core.planner import PlanRates
from kvtier.daemon.rates.book import Link, Measured, RateBook


class TenantRates:
    def __init__(self, node: RateBook) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._books: dict[str, RateBook] = {}
        self._seeds: dict[str, Measured] = {}

    def seed(self, seeds: Mapping[str, Measured]) -> None:
        """Seeds for tenants' books made from now on (kept rates, before serving starts)."""
        with self._lock:
            self._seeds.update(seeds)

    def book(self, tenant: str) -> RateBook:
        with self._lock:
            book = self._books.get(tenant)
            if book is None:
                seed = self._seeds.get(tenant)
                book = self.node.fork() if seed is None else self.node.reseeded(seed)
                self._books[tenant] = book
            return book

    def books(self) -> dict[str, RateBook]:
        """Every tenant's book so far (a copy of the table)."""
        with self._lock:
            return dict(self._books)

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
