"""The ``blob`` program.

It lives here, in the highest package that needs no torch, and gathers the commands of
the packages it stands on (``blobstore.cli``, ``identity.cli``) by import, and those of the
packages above it (``training``) through the ``blobnet.cli`` entry-point group, loaded only
when one of their commands is asked for, so ``blob put`` never imports torch.

Global options: ``--store``, ``--key``, ``--json`` and ``-v`` may come before the
subcommand or after it (``blob ls --store X``). ``--store`` and ``--key`` are added to every
command that has no option of that name (at load time, so entry-point groups get them
too); ``--json`` and ``-v`` before the subcommand become the defaults of the subcommand's
own ``--json`` and ``-v`` options through click's ``default_map``.

Error boundary: every user-facing error class in blobnet carries an integer ``exit_code``
class attribute. ``main`` turns such an error into one line on stderr and that exit status,
with no traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import signal
import sys
import threading
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import click

from blobstore import cli as blobstore_cli
from blobstore.exitcodes import ExitCode
from blobstore.options import json_option
from identity import cli as identity_cli
from p2p.cli import get as get_cli
from p2p.cli import local as local_cli
from p2p.cli import names as names_cli
from p2p.cli import relay as relay_cli
from p2p.cli import serve as serve_cli
from p2p.cli import status as status_cli
from p2p.cli.light import default_key_path, default_store_root
from p2p.errors import unwrap_single

# Documented exit codes (README "Exit codes"); the packages' error classes use these values.


# The options any command accepts after its name, whether or not it declares them: the
# parameter name in the root context's ``obj`` and the option's help.
_GLOBAL_PATH_OPTIONS = {
    "--store": ("store_root", "Store directory (same as before the command)."),
    "--key": ("key_path", "Machine key file (same as before the command)."),
}
# Per-command options that a global flag before the subcommand sets the default of.
_GLOBAL_FLAG_PARAMS = ("as_json", "verbose")


def _set_root(name: str) -> Any:
    def callback(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
        if value is not None:
            ctx.find_root().ensure_object(dict)[name] = value

    return callback


def add_global_options(command: click.Command) -> click.Command:
    """Give ``command`` (and, for a group, every command in it) the ``--store`` and
    ``--key`` options where it lacks them. Idempotent."""
    if getattr(command, "_blobnet_globals", False):
        return command
    taken = {opt for param in command.params for opt in getattr(param, "opts", ())}
    for flag, (name, help_text) in _GLOBAL_PATH_OPTIONS.items():
        if flag in taken:
            continue
        command.params.append(
            click.Option(
                [flag],
                type=click.Path(path_type=Path, dir_okay=name == "store_root"),
                expose_value=False,
                callback=_set_root(name),
                help=help_text,
            )
        )
    command._blobnet_globals = True  # type: ignore[attr-defined]
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            add_global_options(sub)
    return command


def _flag_defaults(command: click.Command, values: dict[str, Any]) -> dict[str, Any]:
    """A ``default_map`` for ``command``: ``values`` for the parameters it has, nested
    for a group's commands."""
    out: dict[str, Any] = {
        param.name: values[param.name]
        for param in command.params
        if param.name in values and isinstance(param, click.Option)
    }
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            nested = _flag_defaults(sub, values)
            if nested:
                out[name] = nested
    return out


class BlobGroup(click.Group):
    """A group that also lists and loads the entry-point command groups lazily, and gives
    every command the global options (see the module docstring)."""

    def _plugins(self) -> dict[str, Any]:
        return {ep.name: ep for ep in entry_points(group="blobnet.cli")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._plugins()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return add_global_options(command)
        plugin = self._plugins().get(cmd_name)
        if plugin is None:
            return None
        try:
            loaded = plugin.load()
        except ImportError as exc:
            return _unavailable(cmd_name, exc)
        return add_global_options(loaded) if isinstance(loaded, click.Command) else None


class CommandUnavailable(Exception):
    """A command group could not be loaded (an optional extra is not installed)."""

    exit_code = ExitCode.LOCAL_IO


def _unavailable(name: str, exc: ImportError) -> click.Command:
    message = (
        f"`blob {name}` is unavailable: {exc} (install the train extra into this checkout: "
        "`make install`, or `pip install -e '.[train]'`)"
    )

    @click.command(
        name, context_settings={"ignore_unknown_options": True}, help=message, add_help_option=False
    )
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args: tuple[str, ...]) -> None:
        raise CommandUnavailable(message)

    return command


@click.group(cls=BlobGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--store",
    "store_root",
    envvar="BLOBNET_STORE",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Store directory (env BLOBNET_STORE; default under $XDG_DATA_HOME/blobnet).",
)
@click.option(
    "--key",
    "key_path",
    envvar="BLOBNET_KEY",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Machine key file (env BLOBNET_KEY; default $XDG_CONFIG_HOME/blobnet/machine.key).",
)
@click.option(
    "--api",
    "api_addr",
    envvar="BLOBNET_API",
    metavar="IP:PORT",
    default=None,
    help="Reach the daemon's local API on TCP here (serve --api-listen) instead of the "
    "store's socket (env BLOBNET_API).",
)
@click.option(
    "--api-token",
    "api_token",
    envvar="BLOBNET_API_TOKEN",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The token file for --api (env BLOBNET_API_TOKEN; default STORE/api.token).",
)
@json_option("Machine-readable output (any command).")
@click.option("-v", "--verbose", count=True, help="More logging on stderr (network commands).")
@click.version_option(package_name="blobnet")
@click.pass_context
def cli(
    ctx: click.Context,
    store_root: Path | None,
    key_path: Path | None,
    api_addr: str | None,
    api_token: Path | None,
    as_json: bool,
    verbose: int,
) -> None:
    """blobnet: verified, content-addressed blobs over libp2p for decentralised training."""
    obj = ctx.ensure_object(dict)
    obj["store_root"] = store_root or default_store_root()
    obj["key_path"] = key_path or default_key_path()
    obj["api_addr"] = api_addr
    obj["api_token"] = api_token
    obj["as_json"] = as_json
    given = zip(_GLOBAL_FLAG_PARAMS, (as_json, verbose), strict=True)
    flags = {name: value for name, value in given if value}
    sub_name = ctx.invoked_subcommand
    if flags and sub_name is not None:
        sub = cli.get_command(ctx, sub_name)
        if sub is not None:
            ctx.default_map = {sub_name: _flag_defaults(sub, flags)}


blobstore_cli.register(cli)
identity_cli.register(cli)
for family in (serve_cli.serve, serve_cli.share, get_cli.get, *local_cli.COMMANDS):
    cli.add_command(family)
names_cli.register(cli)
cli.add_command(relay_cli.relay)
cli.add_command(status_cli.status)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``blob`` console script."""
    try:
        if threading.current_thread() is threading.main_thread():
            # From here on Ctrl-C is a KeyboardInterrupt this boundary turns into exit 130
            # (p2p.cli.main held it quiet while the commands loaded).
            signal.signal(signal.SIGINT, signal.default_int_handler)
        result = cli.main(args=argv, prog_name="blob", standalone_mode=False)
    except click.exceptions.Abort:
        # click's word for a Ctrl-C it caught (during parsing, a prompt or plain code); the
        # same word as every other moment of Ctrl-C.
        click.echo("Interrupted.", err=True)
        sys.exit(ExitCode.INTERRUPTED)
    except click.UsageError as exc:
        # One line, like every other error; the command's --help has the rest.
        where = exc.ctx.command_path if exc.ctx is not None else "blob"
        click.echo(f"{where}: error: {exc.format_message()} (see `{where} --help`)", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        # Not click's "Error: ...": the one line every error gets. A file that cannot be
        # opened is local I/O (exit 5) in the README's table, not click's generic 1.
        file_error = isinstance(exc, click.FileError)
        click.echo(f"blob: error: {exc.format_message()}", err=True)
        sys.exit(ExitCode.LOCAL_IO if file_error else exc.exit_code)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(ExitCode.INTERRUPTED)
    except BaseException as exc:
        # trio wraps errors from concurrent tasks (and Ctrl-C inside them) in groups.
        error: BaseException = exc
        if isinstance(exc, BaseExceptionGroup):
            if exc.subgroup(KeyboardInterrupt) is not None:
                click.echo("Interrupted.", err=True)
                sys.exit(ExitCode.INTERRUPTED)
            error = unwrap_single(exc)
        code = getattr(type(error), "exit_code", None)
        if not isinstance(error, Exception) or not isinstance(code, int):
            raise
        if code == ExitCode.INTERRUPTED:
            click.echo("Interrupted.", err=True)
            sys.exit(code)
        click.echo(f"blob: error: {error}", err=True)
        sys.exit(code)
    sys.exit(result if isinstance(result, int) else ExitCode.OK)
