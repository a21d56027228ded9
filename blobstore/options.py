"""Options every package's commands share: ``--json``, declared here once.

Each command that prints a result or a listing has a ``--json`` form (its parameter is
``as_json``); ``blob --json CMD`` sets its default (``p2p.cli.app``). Only the help line
differs between commands, so it is the one argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

JSON_HELP = "Print the result as JSON."


def json_option(help: str = JSON_HELP) -> Callable[[F], F]:
    """The ``--json`` flag (parameter ``as_json``) with this command's ``help`` line."""
    return click.option("--json", "as_json", is_flag=True, help=help)


__all__ = ["JSON_HELP", "json_option"]
