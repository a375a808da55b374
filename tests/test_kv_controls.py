"""`kv_controls.same_up_to_ties`: long greedy outputs compared up to near-ties (pure, no engine)."""

from __future__ import annotations

from tests import kv_controls as kc

STEP = {10: -1.0, 11: -1.005, 12: -3.0}
"""Tokens 10 and 11 tie within TOLERANCE; 12 is far below."""


def test_identical_outputs_are_the_same() -> None:
    assert kc.same_up_to_ties([10, 10], [STEP, STEP], [10, 10], [STEP, STEP])


def test_outputs_parting_at_a_tie_are_the_same() -> None:
    other = {11: -1.0, 10: -1.005, 12: -3.0}
    assert kc.same_up_to_ties([10, 11, 5], [STEP, other, STEP], [10, 10, 7], [STEP, STEP, {}])


def test_outputs_parting_where_no_tie_is_are_not() -> None:
    far = {12: -1.0, 10: -2.0, 11: -2.5}
    assert not kc.same_up_to_ties([10, 12], [STEP, far], [10, 10], [STEP, STEP])


def test_logprobs_moved_before_the_parting_are_not() -> None:
    moved = {10: -1.1, 11: -1.2, 12: -3.0}  # wrong KV moves them past TOLERANCE
    assert not kc.same_up_to_ties([10, 10], [moved, STEP], [10, 10], [STEP, STEP])


def test_missing_steps_or_lengths_are_not() -> None:
    assert not kc.same_up_to_ties([10], [], [10], [STEP])
    assert not kc.same_up_to_ties([10], [STEP], [10, 10], [STEP, STEP])
    assert not kc.same_up_to_ties([], [], [], [])
