"""Announcements are re-sent on change, then with exponential back-off (issue 17: every
announcement every second was 7x the update bytes)."""

from __future__ import annotations

from training.outer_announce import Announcer


def test_resends_back_off_and_a_change_restarts_them() -> None:
    a = Announcer(first=1.0, cap=8.0)
    assert a.set("update", b"u1", now=0.0)
    assert not a.set("update", b"u1", now=0.5)  # unchanged: nothing to publish
    sent = []
    t = 0.0
    while t <= 30.0:
        if a.due(t):
            sent.append(t)
        t += 0.25
    assert sent == [1.0, 3.0, 7.0, 15.0, 23.0]  # +1, +2, +4, +8, then every 8 s
    assert a.set("update", b"u2", now=30.0)  # changed: publish now, back-off restarts
    assert a.next_due() == 31.0
    a.drop("update")
    assert a.due(100.0) == []
    assert a.next_due() == float("inf")


def test_thirty_seconds_cost_five_resends_not_thirty() -> None:
    a = Announcer()
    a.set("hello", b"h", now=0.0)
    count = sum(len(a.due(float(t))) for t in range(1, 31))
    assert count <= 6
