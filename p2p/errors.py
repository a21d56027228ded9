"""Errors of the network layer, each with the exit status the ``blob`` program reports."""

from __future__ import annotations

from blobstore.exitcodes import ExitCode


class P2PError(Exception):
    """Base of the network layer's user-facing errors."""

    exit_code = ExitCode.NETWORK


class NoProviders(P2PError):
    """No reachable peer holds (a usable copy of) the blob."""


class FetchFailed(P2PError):
    """A download could not complete; the message says why and what was tried."""


class PeerUnreachable(P2PError):
    """A named peer could not be dialled."""


class ListenFailed(P2PError):
    """The node could not listen on any of the addresses asked for."""

    exit_code = ExitCode.LOCAL_IO


class BadAddress(P2PError):
    """A multiaddr given by the user is malformed: a usage error, as the README's table
    has it (``get --peer`` and ``serve --listen`` alike)."""

    exit_code = ExitCode.USAGE


class BadTicket(BadAddress):
    """A ticket string is malformed: bad data (a truncated or mistyped copy)."""

    exit_code = ExitCode.BAD_DATA


def unwrap_single(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one meaningful error inside a (nested) exception group from trio nurseries, or
    the group itself when several tasks failed for different reasons."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    if len(leaves) == 1:
        return leaves[0]
    # Several tasks failed (children of a collection, say): if every failure is a
    # user-facing one, report the first and count the rest.
    if all(isinstance(getattr(type(leaf), "exit_code", None), int) for leaf in leaves):
        first = leaves[0]
        try:
            return type(first)(f"{first} (and {len(leaves) - 1} more failure(s))")
        except TypeError:
            return first
    return group
