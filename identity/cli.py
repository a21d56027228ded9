"""Identity commands of the ``blob`` program (filled in by the identity work)."""

from __future__ import annotations

import click


def register(group: click.Group) -> None:
    """Add the identity commands to the top-level group."""
