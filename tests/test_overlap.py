"""The one overlap check, on hand-written windows: it must see every overlap and nothing else,
or every suite and the demo that rely on it would be blind (or cry wolf) together."""

from __future__ import annotations

from celery_redlock.testing import Hold, Overlap, find_overlaps


def test_holds_back_to_back_do_not_overlap_and_one_inside_another_does() -> None:
    # b starts the instant a ends (touching: fine); c starts inside b; d comes long after.
    a, b, c, d = (
        Hold("r", 0.0, 1.0, "a"),
        Hold("r", 1.0, 2.0, "b"),
        Hold("r", 1.5, 1.6, "c"),
        Hold("r", 3.0, 4.0, "d"),
    )
    assert find_overlaps([a, b, d]) == []
    [overlap] = find_overlaps([d, c, b, a])  # the input's order does not matter
    assert overlap == Overlap(b, c)
    assert abs(overlap.seconds - 0.1) < 1e-9
    assert str(overlap) == "r: c acquired 100.0 ms before the window of b ended"


def test_a_long_window_is_compared_with_every_later_hold() -> None:
    # b and c both start inside a's window, though b ends before c starts.
    holds = [Hold("r", 0.0, 3.0, "a"), Hold("r", 1.0, 1.2, "b"), Hold("r", 1.5, 1.8, "c")]
    assert [(o.first.owner, o.second.owner) for o in find_overlaps(holds)] == [("a", "b"), ("a", "c")]


def test_resources_are_checked_separately() -> None:
    assert find_overlaps([Hold("x", 0.0, 1.0), Hold("y", 0.5, 1.5)]) == []


def test_the_callers_record_comes_back_with_the_overlap() -> None:
    first, second = {"id": 1}, {"id": 2}  # unhashable: info takes no part in equality
    [overlap] = find_overlaps([Hold("r", 0.0, 1.0, info=first), Hold("r", 0.5, 1.5, info=second)])
    assert (overlap.first.info, overlap.second.info) == (first, second)
