"""The ``blob`` command: ``app`` (the group, the error boundary, exit codes), one module
per command family (``get``, ``serve``, ``local``, ``names``; ``nat``: relay options;
``relay``; ``demo``).

``main`` is the console script. It takes Ctrl-C itself before it imports the commands (a
second or more on a loaded machine: click, trio, the store), so a Ctrl-C then ends the
process with one line and exit 130 instead of a KeyboardInterrupt traceback; once they
are loaded, ``app.main`` handles it.

Before loading the commands it offers the command line to ``light`` (get, put, publish,
resolve, catalog and status on a store that a ``blob serve`` runs on, sent to its local API
with only the standard library loaded); what that path does not take, the full program
runs.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

# app.main's exit status for Ctrl-C (p2p.cli.app.EXIT_INTERRUPTED), not imported from it:
# this module must stay light.
_EXIT_INTERRUPTED = 130


def _interrupted_while_loading(signum: int, frame: FrameType | None) -> None:
    # Nothing has started yet: nothing to clean up, so no exception (which the import
    # under way would carry up as a traceback).
    os.write(2, b"Interrupted.\n")
    os._exit(_EXIT_INTERRUPTED)


def main(argv: list[str] | None = None) -> None:
    """The ``blob`` program (``p2p.cli.app.main``), loaded with Ctrl-C held quiet."""
    signal.signal(signal.SIGINT, _interrupted_while_loading)
    from p2p.cli.light import run as run_light

    # Ctrl-C during the light path ends it like one during loading: the daemon cancels a
    # request whose client went away (p2p/daemon/server.py rule 3).
    status = run_light(sys.argv[1:] if argv is None else argv)
    if status is not None:
        sys.exit(status)
    from p2p.cli.app import main as app_main

    app_main(argv)


__all__ = ["main"]
