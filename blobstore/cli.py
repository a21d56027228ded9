"""Local store commands of the ``blob`` program (filled in by the store work)."""

from __future__ import annotations

import click


def register(group: click.Group) -> None:
    """Add the store's commands to the top-level group."""
