"""The ``blob`` program.

It lives here, in the highest package that needs no torch, and gathers the commands of
the packages it stands on (``blobstore.cli``, ``identity.cli``) by import, and those of the
packages above it (``training``) through the ``blobnet.cli`` entry-point group, loaded only
when one of their commands is asked for, so ``blob put`` never imports torch.

Error boundary: every user-facing error class in blobnet carries an integer ``exit_code``
class attribute. ``main`` turns such an error into one line on stderr and that exit status,
with no traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import click

from blobstore import cli as blobstore_cli
from identity import cli as identity_cli
from p2p import net_cli
from p2p.errors import unwrap_single

# Documented exit codes (README "Exit codes"); the packages' error classes use these values.
EXIT_OK = 0
EXIT_INTERRUPTED = 130


def default_store_root() -> Path:
    """``$XDG_DATA_HOME/blobnet/store`` (``~/.local/share/blobnet/store`` by default)."""
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "blobnet" / "store"


def default_key_path() -> Path:
    """``$XDG_CONFIG_HOME/blobnet/machine.key`` (``~/.config/blobnet/machine.key``)."""
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "blobnet" / "machine.key"


class BlobGroup(click.Group):
    """A group that also lists and loads the entry-point command groups lazily."""

    def _plugins(self) -> dict[str, Any]:
        return {ep.name: ep for ep in entry_points(group="blobnet.cli")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._plugins()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        plugin = self._plugins().get(cmd_name)
        if plugin is None:
            return None
        try:
            loaded = plugin.load()
        except ImportError as exc:
            return _unavailable(cmd_name, exc)
        return loaded if isinstance(loaded, click.Command) else None


class CommandUnavailable(Exception):
    """A command group could not be loaded (an optional extra is not installed)."""

    exit_code = 5


def _unavailable(name: str, exc: ImportError) -> click.Command:
    message = f"`blob {name}` is unavailable: {exc} (install blobnet[train])"

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
@click.version_option(package_name="blobnet")
@click.pass_context
def cli(ctx: click.Context, store_root: Path | None, key_path: Path | None) -> None:
    """blobnet: verified, content-addressed blobs over libp2p for decentralised training."""
    obj = ctx.ensure_object(dict)
    obj["store_root"] = store_root or default_store_root()
    obj["key_path"] = key_path or default_key_path()


blobstore_cli.register(cli)
identity_cli.register(cli)
net_cli.register(cli)  # after blobstore: its networked `get` replaces the local-only one


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``blob`` console script."""
    try:
        result = cli.main(args=argv, prog_name="blob", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except BaseException as exc:
        # trio wraps errors from concurrent tasks (and Ctrl-C inside them) in groups.
        error: BaseException = exc
        if isinstance(exc, BaseExceptionGroup):
            if exc.subgroup(KeyboardInterrupt) is not None:
                click.echo("Interrupted.", err=True)
                sys.exit(EXIT_INTERRUPTED)
            error = unwrap_single(exc)
        code = getattr(type(error), "exit_code", None)
        if not isinstance(error, Exception) or not isinstance(code, int):
            raise
        click.echo(f"blob: error: {error}", err=True)
        sys.exit(code)
    sys.exit(result if isinstance(result, int) else EXIT_OK)


if __name__ == "__main__":
    main()
