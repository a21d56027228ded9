"""The ``blob`` command: ``app`` (the group, the error boundary, exit codes), one module
per command family (``net``: put, get, serve, share and the store commands that need a
node; ``names``; ``nat``: relay options; ``relay``; ``demo``).
"""

from p2p.cli.app import main

__all__ = ["main"]
