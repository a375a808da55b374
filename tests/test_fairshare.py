"""Fair shares with guaranteed minimums (kvtier.core.fairshare), pure."""

from __future__ import annotations

from kvtier.core.fairshare import room_plan, shares


def test_share_is_an_equal_split_or_the_guarantee() -> None:
    assert shares("b", {"a": 240}, {}, 256) == {"a": 128, "b": 128}
    assert shares("b", {"a": 240}, {"a": 192}, 256) == {"a": 192, "b": 128}
    assert shares("a", {"a": 10, "c": 0}, {}, 256) == {"a": 256}  # idle tenants do not count


def test_a_tenant_within_its_share_takes_from_those_over_theirs_first() -> None:
    plan = room_plan("b", 16, 16, {"a": 240, "b": 16}, {}, 256)
    assert plan == [("a", 112), ("b", 16)]


def test_a_tenant_over_its_share_recycles_its_own_blocks_first() -> None:
    plan = room_plan("b", 16, 16, {"a": 120, "b": 136}, {}, 256)
    assert plan == [("b", 16)]  # a is within its share: never asked


def test_nobody_is_taken_below_its_guarantee() -> None:
    plan = room_plan("b", 16, 16, {"a": 200, "b": 56}, {"a": 192}, 256)
    assert plan == [("a", 8), ("b", 16)]
    assert room_plan("b", 16, 16, {"a": 192, "b": 64}, {"a": 192}, 256) == [("b", 16)]
