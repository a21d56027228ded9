"""``blob serve``'s configuration file (TOML): what the command line takes, kept in a file.

Rules
1. The file is ``--config FILE``, else ``$XDG_CONFIG_HOME/blobnet/config.toml``
   (``~/.config/blobnet/config.toml``) when it exists. Its ``[serve]`` table holds the
   keys of ``SERVE_KEYS``, each the long option's name (``upload-limit`` or
   ``upload_limit``); a repeatable option takes a list.
2. Flags win: the file's values become the defaults of the command's options (click's
   ``default_map``), so an option given on the command line replaces the file's value,
   and global flags before the subcommand (``blob -v serve``) win over both.
3. A file that cannot be read or parsed (or is not a regular file: a FIFO would hang the
   read), an unknown table or key, or a value of the wrong type or out of range (``nan``
   for a rate) is a usage error naming the file and the key, before anything starts; a
   file that does not exist is not found (exit 3).
4. ``--print-config`` prints the merged result as TOML and exits: what the serve would
   run with, in the form the file takes.
"""

from __future__ import annotations

import os
import stat
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from blobstore.errors import PathNotFound

# Config key -> the serve command's parameter name (rule 1).
SERVE_KEYS = {
    "listen": "listen",
    "bootstrap": "bootstrap",
    "no_dht": "no_dht",
    "verify_reads": "verify_reads",
    "upload_limit": "upload_limit",
    "download_limit": "download_limit",
    "relay": "relays",
    "certificate": "certificate_path",
    "assume_private": "assume_private",
    "authority": "authorities",
    "metrics": "metrics",
    "api_listen": "api_listen",
    "api_allow_remote": "api_allow_remote",
    "api_put_dir": "api_put_dirs",
}
# A configuration file is a few hundred bytes; anything far larger is not one.
MAX_CONFIG_BYTES = 1 << 20


def default_config_path() -> Path:
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "blobnet" / "config.toml"


def _read_regular(path: Path) -> bytes:
    """At most MAX_CONFIG_BYTES + 1 bytes of the regular file ``path``. Opened without
    blocking and checked before reading: a FIFO (or a device) given as the file would
    otherwise hang the command until something writes to it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PathNotFound(f"no configuration file at {path}") from None  # README: exit 3
    except OSError as exc:
        raise click.BadParameter(
            f"cannot read {path}: {exc.strerror}", param_hint="--config"
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise click.BadParameter(f"{path} is not a regular file", param_hint="--config")
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as handle:
            return handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise click.BadParameter(
            f"cannot read {path}: {exc.strerror}", param_hint="--config"
        ) from None
    finally:
        os.close(fd)


def read_config(path: Path) -> dict[str, Any]:
    """The ``[serve]`` table of ``path`` as parameter defaults (rules 1 and 3)."""
    raw = _read_regular(path)
    if len(raw) > MAX_CONFIG_BYTES:
        raise click.BadParameter(f"{path} is over {MAX_CONFIG_BYTES} bytes", param_hint="--config")
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise click.BadParameter(
            f"{path} is not valid TOML: {exc}", param_hint="--config"
        ) from None
    except RecursionError:
        # tomllib parses nested arrays and tables recursively: a file of thousands of
        # brackets (well under MAX_CONFIG_BYTES) runs out of stack. No option nests.
        raise click.BadParameter(
            f"{path} is not valid TOML: its arrays or tables nest too deeply",
            param_hint="--config",
        ) from None
    unknown = sorted(set(doc) - {"serve"})
    if unknown:
        raise click.BadParameter(
            f"{path}: unknown table(s) {', '.join(unknown)} (known: serve)", param_hint="--config"
        )
    table = doc.get("serve", {})
    if not isinstance(table, dict):
        raise click.BadParameter(f"{path}: serve must be a table", param_hint="--config")
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = SERVE_KEYS.get(key.replace("-", "_"))
        if name is None:
            known = ", ".join(k.replace("_", "-") for k in SERVE_KEYS)
            raise click.BadParameter(
                f"{path}: unknown key serve.{key} (known: {known})", param_hint="--config"
            )
        out[name] = value
    return out


def _check_types(command: click.Command, path: Path, values: dict[str, Any]) -> None:
    """Rule 3: a repeatable option takes a list, a flag a boolean, anything else a scalar."""
    params = {p.name: p for p in command.params if isinstance(p, click.Option)}
    for name, value in values.items():
        param = params.get(name)
        if param is None:
            continue
        key = next(k for k, v in SERVE_KEYS.items() if v == name).replace("_", "-")
        if param.multiple and not (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        ):
            raise click.BadParameter(
                f"{path}: serve.{key} takes a list of strings", param_hint="--config"
            )
        if param.is_flag and not isinstance(value, bool):
            raise click.BadParameter(
                f"{path}: serve.{key} takes true or false", param_hint="--config"
            )
        if not param.multiple and not param.is_flag and isinstance(value, list | dict):
            raise click.BadParameter(f"{path}: serve.{key} takes one value", param_hint="--config")


def _load(ctx: click.Context, _param: click.Parameter, value: Path | None) -> Path | None:
    """``--config``'s callback (eager): the file's values become defaults (rule 2)."""
    path = value
    if path is None:
        candidate = default_config_path()
        path = candidate if candidate.is_file() else None
    if path is None:
        return None
    values = read_config(path)
    _check_types(ctx.command, path, values)
    ctx.default_map = {**values, **(ctx.default_map or {})}
    return path


def to_toml(values: dict[str, Any]) -> str:
    """The ``[serve]`` table for ``values`` (parameter names), None values left out."""
    lines = ["[serve]"]
    for key, name in SERVE_KEYS.items():
        value = values.get(name)
        if value is None or value == () or value is False:
            continue
        lines.append(f"{key.replace('_', '-')} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def config_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--config FILE`` and ``--print-config``; the command gets ``print_config``."""
    command = click.option(
        "--print-config",
        "print_config",
        is_flag=True,
        help="Print the configuration in effect (file and flags merged) as TOML and exit.",
    )(command)
    return click.option(
        "--config",
        "config_path",
        type=click.Path(path_type=Path, dir_okay=False),
        is_eager=True,
        expose_value=False,
        callback=_load,
        help="TOML file with a [serve] table of these options (default: "
        "$XDG_CONFIG_HOME/blobnet/config.toml if it exists); flags win.",
    )(command)
