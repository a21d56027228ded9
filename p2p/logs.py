"""Keeping library loggers quiet unless asked, whenever the library is imported.

py-libp2p configures its own ``libp2p`` logger on import (no handlers, no propagation,
level WARNING, unless ``LIBP2P_DEBUG`` is set), so its records fall through to Python's
``logging.lastResort`` handler, which prints WARNING and above on stderr: routine dial
failures and stream resets of a busy network. Setting the logger's level after the import
worked, but forced every command to import py-libp2p (about a second) before it could
configure logging, even one that ends up asking a daemon. A filter on ``lastResort`` holds
whatever the import order, and costs nothing.
"""

from __future__ import annotations

import logging

# The libraries whose records are dropped unless asked for (-vv, or LIBP2P_DEBUG, which
# gives py-libp2p handlers of its own and so never reaches lastResort).
QUIET_LIBRARIES = ("libp2p", "multiaddr", "aioquic", "httpx")


class _DropLibraries(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        return not any(name == lib or name.startswith(lib + ".") for lib in QUIET_LIBRARIES)


_FILTER = _DropLibraries()
# Whether the program chose (``quiet_libraries`` was called): then nodes leave it alone.
_chosen = False


def quiet_libraries(quiet: bool = True) -> None:
    """Drop (``quiet``) or show the quiet libraries' records that reach ``lastResort``:
    the program's choice, which nodes then leave alone."""
    global _chosen
    _chosen = True
    _apply(quiet)


def quiet_unless_chosen() -> None:
    """What a node does when it starts: quiet, unless the program chose otherwise (the
    CLI's -vv; an embedding program that called ``quiet_libraries(False)``)."""
    if not _chosen:
        _apply(True)


def _apply(quiet: bool) -> None:
    handler = logging.lastResort
    if handler is None:
        return
    if quiet:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
    else:
        handler.removeFilter(_FILTER)
    for lib in QUIET_LIBRARIES:
        if quiet:
            logging.getLogger(lib).setLevel(logging.CRITICAL)


def no_handler_of_our_own() -> None:
    """What a node does on import: py-libp2p's logger and ours get a NullHandler, so a
    program that embeds a node and configures no logging is not written to (the
    last-resort handler would print py-libp2p's routine churn, dozens of lines a
    minute). With ``quiet_libraries`` this covers either import order. ``LIBP2P_DEBUG``
    (py-libp2p's own handlers) and ``blob -vv`` (which lets them propagate) still show
    them; a program that configures logging sees ours."""
    for name in ("libp2p", "p2p"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(logging.NullHandler())
