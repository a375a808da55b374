"""Lease table: TTL expiry with an injected clock, renew, exactly-once removal."""

from __future__ import annotations

import pytest

from kvtier.daemon.cache.leases import LeaseKind, LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lease_expires_after_its_ttl_and_only_then() -> None:
    clock = Clock()
    table = LeaseTable(clock)
    lease = table.grant("t", LeaseKind.READ, 5.0, payload=[1, 2])
    clock.now = 104.9
    assert table.expired() == []
    clock.now = 105.0
    (gone,) = table.expired()
    assert gone.id == lease.id and gone.payload == [1, 2]
    assert table.get(lease.id) is None and len(table) == 0
    assert table.expired() == []  # exactly once


def test_renew_moves_the_deadline() -> None:
    clock = Clock()
    table = LeaseTable(clock)
    lease = table.grant("t", LeaseKind.WRITE, 5.0, payload=None)
    clock.now = 104.0
    table.renew(lease.id, 5.0)  # new deadline 109
    clock.now = 106.0
    assert table.expired() == []
    clock.now = 109.0
    assert [x.id for x in table.expired()] == [lease.id]


def test_pop_removes_so_expiry_never_returns_it() -> None:
    clock = Clock()
    table = LeaseTable(clock)
    a = table.grant("t", LeaseKind.READ, 1.0, payload=None)
    b = table.grant("u", LeaseKind.WRITE, 2.0, payload=None)
    assert table.pop(a.id) is a
    assert table.pop(a.id) is None
    clock.now = 200.0
    assert [x.id for x in table.expired()] == [b.id]


def test_ids_are_unique_and_unguessable_hex() -> None:
    table = LeaseTable(Clock())
    ids = {table.grant("t", LeaseKind.READ, 1.0, None).id for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_counts_next_deadline_and_pop_all() -> None:
    clock = Clock()
    table = LeaseTable(clock)
    assert table.next_deadline() is None
    table.grant("t", LeaseKind.READ, 3.0, None)
    w = table.grant("t", LeaseKind.WRITE, 1.0, None)
    assert table.count(LeaseKind.READ) == 1 and table.count(LeaseKind.WRITE) == 1
    assert table.next_deadline() == 101.0
    table.pop(w.id)
    assert table.next_deadline() == 103.0
    assert len(table.pop_all()) == 1 and len(table) == 0


def test_heap_stays_bounded_under_renew_churn() -> None:
    clock = Clock()
    table = LeaseTable(clock)
    lease = table.grant("t", LeaseKind.READ, 10.0, None)
    for _ in range(10_000):
        table.renew(lease.id, 10.0)
        table.expired()
    assert len(table._heap) < 200


def test_non_positive_ttl_is_refused() -> None:
    with pytest.raises(ValueError):
        LeaseTable(Clock()).grant("t", LeaseKind.READ, 0.0, None)


def test_a_session_ends_its_live_leases_only() -> None:
    clock = Clock()
    t = LeaseTable(clock)
    s1, s2 = t.open_session("alice"), t.open_session("alice")
    assert t.session_open(s1, "alice") and not t.session_open(s1, "bob") and s1 != s2
    a = t.grant("alice", LeaseKind.READ, 10, "a", session=s1)
    b = t.grant("alice", LeaseKind.WRITE, 10, "b", session=s1)
    other = t.grant("alice", LeaseKind.READ, 10, "c", session=s2)
    plain = t.grant("alice", LeaseKind.READ, 10, "d")
    assert t.pop(a.id) is a  # released before the session ended: not ended twice
    assert t.pop_session(s1) == [b] and not t.session_open(s1, "alice")
    assert t.pop_session(s1) == [] and t.get(other.id) and t.get(plain.id)
    clock.now += 11
    assert {lease.id for lease in t.expired()} == {other.id, plain.id}
    assert t.pop_session(s2) == []  # expired leases left their session too
