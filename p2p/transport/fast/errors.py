"""Errors of the fast data path, split by whose fault they are (see STYLE.md section 4).

A `RemoteProtocolError` means the peer sent something the Noise or yamux specs forbid: the
connection is closed and the peer is to blame. A `LocalProtocolError` means our own code misused
the API (a bug). Both carry `exit_code` 6 (network), the project's code for network failures.
"""

from __future__ import annotations

from blobstore.exitcodes import ExitCode


class FastPathError(Exception):
    """Base class of every error raised by `p2p.transport.fast`."""

    exit_code = ExitCode.NETWORK


class RemoteProtocolError(FastPathError):
    """The peer broke the wire protocol; the connection is closed."""


class NoiseProtocolError(RemoteProtocolError):
    """A Noise transport message failed: bad tag, impossible length, or a closed cipher."""


class YamuxProtocolError(RemoteProtocolError):
    """A yamux frame broke the spec: bad version or type, window overrun, bad stream ID."""

    def __init__(self, message: str, go_away_code: int | None = 1) -> None:
        super().__init__(message)
        # The GO_AWAY code we send back before closing (1 = protocol error, per the spec), or
        # None when the peer itself ended the session and nothing more is owed.
        self.go_away_code = go_away_code


class LocalProtocolError(FastPathError):
    """Our own misuse of the API: writing after close, a nonce counter that ran out."""
