"""The CLI's error boundary sees through trio's exception groups."""

from __future__ import annotations

from p2p.errors import FetchFailed, NoProviders, unwrap_single


def test_single_leaf_is_unwrapped_through_nesting() -> None:
    leaf = NoProviders("none of 1 peer(s) asked holds x")
    group = ExceptionGroup("outer", [ExceptionGroup("inner", [leaf])])
    assert unwrap_single(group) is leaf


def test_several_user_errors_become_one_with_a_count() -> None:
    group = ExceptionGroup("g", [NoProviders("child a missing"), FetchFailed("child b failed")])
    error = unwrap_single(group)
    assert isinstance(error, NoProviders)
    assert str(error) == "child a missing (and 1 more failure(s))"


def test_bugs_stay_a_group() -> None:
    group = ExceptionGroup("g", [NoProviders("x"), KeyError("bug")])
    assert unwrap_single(group) is group
