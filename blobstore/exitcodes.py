"""The ``blob`` program's exit statuses (README "Exit codes"), one table for every
package: each package's errors name theirs as a class attribute ``exit_code``, and
``p2p.cli.app.main`` turns such an error into one line on stderr and that status."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """The ``blob`` program's exit statuses (README "Exit codes"), one for every package."""

    OK = 0
    REJECTED = 1  # a check said no: corruption found, evidence rejected, another digest
    USAGE = 2  # bad option or argument, nowhere to fetch from, an unsafe setting
    NOT_FOUND = 3  # unknown blob ID, prefix or tag, missing file or key
    BAD_DATA = 4  # corrupt chunk, malformed manifest, ticket, certificate or key file
    LOCAL_IO = 5  # disk full, permission denied, store busy
    NETWORK = 6  # no provider, peer unreachable, transfer failed
    NO_QUORUM = 7  # an outer-loop worker stopped: fewer of its run than the quorum came
    INTERRUPTED = 130  # Ctrl-C or SIGTERM


__all__ = ["ExitCode"]
