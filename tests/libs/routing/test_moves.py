"""kvmesh.routing.moves: a turn away from its session's previous endpoint is a move, and the
table that says so stays bounded whatever session ids clients send."""

from __future__ import annotations

import pytest

from kvmesh.routing.moves import SessionMoves


def test_a_turn_elsewhere_is_a_move_and_home_is_not() -> None:
    m = SessionMoves()
    assert not m.observe("s", "a")        # a first turn has nowhere to move from
    assert not m.observe("s", "a")
    assert m.observe("s", "b")
    assert not m.observe("s", "b")        # the new endpoint is its home now
    assert not m.observe("t", "a")        # sessions are apart
    assert not m.observe("", "a") and not m.observe("", "b")   # no session id: never a move
    assert len(m) == 2


def test_the_previous_endpoint_is_read_without_counting_a_turn() -> None:
    m = SessionMoves(capacity=2)
    assert m.previous("s") == "" and m.previous("") == ""
    m.observe("s1", "a")
    m.observe("s2", "b")
    assert m.previous("s1") == "a" and m.previous("s2") == "b"
    m.observe("s3", "c")                  # a read did not make s1 the more recent: it goes first
    assert m.previous("s1") == "" and m.previous("s2") == "b"
    assert not m.observe("s2", "b")       # a read is not a turn: still home


def test_the_least_recently_routed_session_is_forgotten_first() -> None:
    m = SessionMoves(capacity=2)
    m.observe("s1", "a")
    m.observe("s2", "a")
    m.observe("s1", "a")                  # s1 is the more recent now
    m.observe("s3", "a")                  # evicts s2
    assert len(m) == 2
    assert not m.observe("s2", "b")       # forgotten: a first turn again, not a move
    assert m.observe("s3", "b") is True   # s3 was kept ...
    assert not m.observe("s1", "b")       # ... and s1 went out when s2 came back


def test_hostile_session_ids_stay_bounded() -> None:
    m = SessionMoves(capacity=100)
    for i in range(10_000):
        m.observe(f"x{i}", "a")
    assert len(m) == 100


@pytest.mark.parametrize("capacity", [0, -1])
def test_a_capacity_below_one_is_refused(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        SessionMoves(capacity=capacity)
