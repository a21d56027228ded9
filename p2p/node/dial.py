"""Dialling the peers a command names, before any transfer starts, so that a failure is
one line that says which peer failed and why (refused, timed out, another peer answered)
instead of a generic "no provider" once discovery gives up.

Also the check that needs no network at all: a named peer whose ID is this process's own.
Every local ``blob`` process uses the same default machine key, so two of them have one
peer ID; libp2p cannot tell them apart and DHT lookups between them fail silently.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from blobstore.exitcodes import ExitCode
from p2p.blob.ticket import validate_peer_addr
from p2p.errors import P2PError, PeerUnreachable

# py-libp2p's Noise handshake names the peer that answered in this message (0.8.1:
# PeerIDMismatchesPubkey, "...remote_peer_id_from_pubkey=<id>").
_ANSWERED_AS = re.compile(r"remote_peer_id_from_pubkey=(\w+)")
# Nested causes walked when explaining a failed dial; libp2p wraps a refused TCP connect
# about six levels deep, so this is plenty and bounds a cyclic chain.
MAX_CAUSE_DEPTH = 32


class OwnPeerId(P2PError):
    """A named peer has this process's own peer ID (both use one machine key)."""

    exit_code = ExitCode.USAGE


def peer_id_of(addr: str) -> str:
    """The ``/p2p/<id>`` part of a validated peer address."""
    peer = validate_peer_addr(addr).value_for_protocol("p2p")
    return str(peer)


def check_not_self(addrs: Sequence[str], own_peer_id: str, key_path: Path | None) -> None:
    """Refuse, before any dial, an address that carries our own peer ID."""
    for addr in addrs:
        if peer_id_of(addr) == own_peer_id:
            key = f"the machine key {key_path}" if key_path is not None else "one machine key"
            raise OwnPeerId(
                f"peer {addr} has this process's own peer ID {own_peer_id} (both use {key}): "
                "give each local node its own key with --key FILE"
            )


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and everything it wraps: causes, contexts (even suppressed ones: libp2p's
    dial errors are re-raised ``from None`` by callers), exception groups and
    py-libp2p's ``MultiError`` (which keeps its errors in ``args[0]``)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo and len(seen) < MAX_CAUSE_DEPTH:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        inner: list[Any] = list(getattr(current, "exceptions", None) or ())
        if current.args and isinstance(current.args[0], list):
            inner.extend(current.args[0])
        inner.extend((current.__cause__, current.__context__))
        todo.extend(e for e in inner if isinstance(e, BaseException))


def describe_dial_failure(exc: BaseException, addr: str, timeout: float | None = None) -> str:
    """Why dialling ``addr`` failed, in a few words."""
    expected = peer_id_of(addr)
    reason: str | None = None
    for cause in _causes(exc):
        answered = _ANSWERED_AS.search(str(cause))
        if answered is not None and answered.group(1) != expected:
            return f"peer ID mismatch: the node there is {answered.group(1)}, not {expected}"
        if reason is not None:
            continue
        if isinstance(cause, trio.TooSlowError):
            reason = "timed out" + (f" after {timeout:.0f} s" if timeout else "")
        elif isinstance(cause, ConnectionRefusedError):
            reason = "connection refused (is `blob serve` running there?)"
        elif isinstance(cause, OSError) and cause.errno in (
            errno.EHOSTUNREACH,
            errno.ENETUNREACH,
            errno.ETIMEDOUT,
            errno.EADDRNOTAVAIL,
        ):
            reason = cause.strerror or str(cause)
    return reason or str(exc) or type(exc).__name__


@dataclass
class Dialled:
    """What :func:`dial_named` found: addresses that answered, those still being dialled
    when it returned, and one line per address that failed (``"ADDR: why"``)."""

    reached: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def usable(self) -> list[str]:
        """Addresses worth handing to a fetch: reached, then still pending."""
        return [*self.reached, *self.pending]


async def dial_named(node: Any, addrs: Sequence[str]) -> Dialled:
    """Dial every address at once through ``node.connect`` and return as soon as one
    answers (the others are left to the fetch, which dials its providers itself: a peer
    that accepts TCP and never handshakes delays nobody) or all have failed."""
    # libp2p (seconds): this module's checks run before any node, on commands that may
    # never start one; by the time a dial runs, a node has imported it already.
    from p2p.node.connections import DIAL_TIMEOUT

    timeout = DIAL_TIMEOUT  # for the message only
    unique = list(dict.fromkeys(addrs))
    reached: set[str] = set()
    failures: dict[str, str] = {}

    async with trio.open_nursery() as nursery:

        async def dial(addr: str) -> None:
            try:
                await node.connect(addr, lanes=True)
            except PeerUnreachable as exc:
                if nursery.cancel_scope.cancel_called:
                    return  # our own cancel, dressed as a dial error by libp2p: pending
                failures[addr] = f"{addr}: {describe_dial_failure(exc, addr, timeout)}"
            else:
                reached.add(addr)
                nursery.cancel_scope.cancel()

        for addr in unique:
            nursery.start_soon(dial, addr)
    return Dialled(
        reached=[a for a in unique if a in reached],
        pending=[a for a in unique if a not in reached and a not in failures],
        failures=[failures[a] for a in unique if a in failures],
    )


def unreachable_error(failures: Sequence[str]) -> PeerUnreachable:
    """The error for a fetch none of whose named peers could be dialled."""
    if len(failures) == 1:
        return PeerUnreachable(f"cannot reach peer {failures[0]}")
    return PeerUnreachable(f"cannot reach any of {len(failures)} peers: " + "; ".join(failures))
