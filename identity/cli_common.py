"""What the identity commands share, and what the commands of the packages above them
use to verify identities: the machine key and input files, and the options that name
trust (``--authority``, ``--revoked``), hardware (``--require-hardware``) and admissions.

Each option is declared here once; a command picks its help line, never its own copy.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import click

from .certificate import RevocationList, TrustStore
from .errors import (
    BadPublicKey,
    BadRevocationList,
    KeyExists,
    KeyFileIOError,
    KeyNotFound,
    NotFound,
    PassphraseRequired,
)
from .keyfile import ScryptCost, create_key_file, load_key_file
from .keys import MachineKey, parse_public_key

PASSPHRASE_ENV = "BLOBNET_PASSPHRASE"
DEFAULT_VALID_DAYS = 30
# Certificates start this long before "now" so a verifier whose clock is a little behind
# the authority's does not reject a fresh certificate as not yet valid.
CLOCK_SKEW_ALLOWANCE_S = 300
# Revocation lists are text, one entry a line; 16 MiB is ~300 000 peer IDs.
MAX_REVOCATION_LIST_SIZE = 16 << 20


def echo_json(obj: Any) -> None:
    """Print ``obj`` as the indented JSON of every ``--json`` output."""
    click.echo(json.dumps(obj, indent=2))


def env_passphrase() -> str | None:
    """The passphrase in $BLOBNET_PASSPHRASE, or None."""
    return os.environ.get(PASSPHRASE_ENV) or None


def load_key(path: Path) -> MachineKey:
    """The key at ``path``, unlocked by $BLOBNET_PASSPHRASE or a prompt on a terminal."""
    try:
        return load_key_file(path, env_passphrase())
    except PassphraseRequired:
        if not sys.stdin.isatty():
            raise
    passphrase: str = click.prompt(f"Passphrase for {path}", hide_input=True, err=True)
    return load_key_file(path, passphrase)


def scrypt_cost(ctx: click.Context) -> ScryptCost:
    """The scrypt cost of key files these commands seal: the root context's
    ``scrypt_cost`` when its caller sets one (a test: a cheaper, still valid cost), else
    the default."""
    cost = ctx.ensure_object(dict).get("scrypt_cost")
    return cost if isinstance(cost, ScryptCost) else ScryptCost()


def _key_path(ctx: click.Context) -> Path:
    path = ctx.ensure_object(dict).get("key_path")
    if path is None:
        raise click.UsageError("no machine key path: give --key FILE")
    return Path(path)


def machine_key(ctx: click.Context) -> tuple[MachineKey, Path, bool]:
    """The machine key, created (and said so on stderr) on first use."""
    path = _key_path(ctx)
    try:
        return load_key(path), path, False
    except KeyNotFound:
        pass
    try:
        key = create_key_file(path, env_passphrase(), cost=scrypt_cost(ctx))
    except KeyExists:  # created by another process in between
        return load_key(path), path, False
    click.echo(f"blob: created a new machine key {path} (peer ID {key.peer_id})", err=True)
    return key, path, True


def read_input(path: Path, what: str, max_size: int) -> bytes:
    """At most ``max_size + 1`` bytes of the ``what`` file at ``path`` (the caller compares
    the length with its limit); a missing file is :class:`NotFound`."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_size + 1)
    except FileNotFoundError:
        raise NotFound(f"no {what} file at {path}") from None
    except OSError as exc:
        raise KeyFileIOError(f"cannot read {what} file {path}: {exc.strerror}") from exc
    return data


def authority_key(value: str) -> bytes:
    """A public key given as 64 hex digits or as the path of a ``.pub`` file."""
    try:
        return parse_public_key(value)
    except BadPublicKey:
        pass
    data = read_input(Path(value), "authority public key", 1024)
    try:
        return parse_public_key(data.decode("ascii", errors="replace"))
    except BadPublicKey as exc:
        raise BadPublicKey(f"{value}: {exc}") from None


def make_trust_options(
    *,
    required: bool = True,
    revoked: bool = True,
    authority_help: str = "Trusted authority public key: 64 hex digits or a .pub file "
    "(repeatable).",
    revoked_help: str = "Revocation list: one certificate serial or peer ID a line.",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ``--authority`` (repeatable) and, unless not ``revoked``, ``--revoked`` options
    of a command that verifies certificates (values ``authorities`` and ``revoked_path``);
    pair with :func:`load_trust`."""

    def apply(command: Callable[..., Any]) -> Callable[..., Any]:
        if revoked:
            command = click.option(
                "--revoked",
                "revoked_path",
                type=click.Path(path_type=Path, dir_okay=False),
                default=None,
                help=revoked_help,
            )(command)
        return click.option(
            "--authority",
            "authorities",
            multiple=True,
            required=required,
            metavar="KEY",
            help=authority_help,
        )(command)

    return apply


trust_options = make_trust_options()
"""The trust options of a command that needs at least one authority."""


def load_trust(authorities: Iterable[str], revoked_path: Path | None) -> TrustStore:
    """The trust store named by :func:`trust_options`' values."""
    trusted = frozenset(authority_key(a) for a in authorities)
    revoked = RevocationList()
    if revoked_path is not None:
        raw = read_input(revoked_path, "revocation list", MAX_REVOCATION_LIST_SIZE)
        if len(raw) > MAX_REVOCATION_LIST_SIZE:
            raise BadRevocationList(f"{revoked_path} is larger than 16 MiB")
        revoked = RevocationList.parse(
            raw.decode("utf-8", errors="replace"), name=str(revoked_path)
        )
    return TrustStore(trusted, revoked)


def fields_error(exc: ValueError) -> click.UsageError:
    """A malformed field given on the command line, as click's usage error."""
    return click.UsageError(str(exc))


# What an admission names, shared by `blob admit` and `blob tpm admit`.
operator_option = click.option(
    "--operator", required=True, help="Who runs the machine (a person or org)."
)
kernel_class_option = click.option(
    "--kernel-class", required=True, help="The machine's kernel class."
)
authority_key_option = click.option(
    "--authority",
    "authority_path",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Authority private key file (from `blob authority new`).",
)
days_option = click.option(
    "--days",
    type=click.IntRange(min=1, max=3650),
    default=DEFAULT_VALID_DAYS,
    show_default=True,
    help="Validity in days from now.",
)


def require_hardware_option(help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ``--require-hardware`` flag (value ``require_hardware``) of a command that checks
    or makes TPM co-signed attestations; ``help`` says what it refuses there."""
    return click.option("--require-hardware", is_flag=True, help=help)
