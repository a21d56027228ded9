"""Commands that read the store and need no node: ``blob export`` (a collection as a
directory) and ``blob ticket`` (a blob ID with addresses to fetch it from), and ``blob
demo``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from blobstore import BlobNotFound, parse_blob_id
from blobstore.export import check_output
from p2p.blob.ticket import Ticket
from p2p.cli.common import (
    check_peer_addrs,
    json_option,
    store_of,
    write_output,
)

if TYPE_CHECKING:
    pass


@click.command("export")
@click.argument("ref")
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--copy", is_flag=True, help="Verified copies instead of symlinks into the store.")
@click.option(
    "--include", "include", multiple=True, metavar="GLOB", help="Only matching files (fnmatch)."
)
@json_option
@click.pass_context
def export_cmd(
    ctx: click.Context, ref: str, dest: Path, copy: bool, include: Sequence[str], as_json: bool
) -> None:
    """Write a blob from the store to DEST without copying it: symlinks to the store's
    read-only files (a collection becomes a directory of them), which
    transformers' from_pretrained(DEST) and safetensors load as they are."""
    check_output(dest)
    store = store_of(ctx)
    blob_id = store.resolve(ref)
    write_output(store, blob_id, dest, include, link=not copy)
    if as_json:
        click.echo(json.dumps({"id": blob_id, "path": str(dest), "linked": not copy}))
    else:
        click.echo(f"{blob_id}  {dest}")


@click.command()
@click.argument("ref")
@click.option(
    "--addr",
    "addrs",
    multiple=True,
    required=True,
    metavar="MADDR",
    help="Provider address ending in /p2p/<peer id> (repeatable).",
)
@json_option
@click.pass_context
def ticket(ctx: click.Context, ref: str, addrs: Sequence[str], as_json: bool) -> None:
    """Print a ticket: the blob ID and provider addresses in one copyable string."""
    check_peer_addrs(addrs, "--addr")
    store = store_of(ctx)
    try:
        blob_id = store.resolve(ref)
    except BlobNotFound:
        blob_id = parse_blob_id(ref)
    text = Ticket(blob_id, tuple(addrs)).encode()
    if as_json:
        click.echo(json.dumps({"id": blob_id, "addrs": list(addrs), "ticket": text}))
    else:
        click.echo(text)


@click.command()
@click.option("--size-mib", default=256, show_default=True, help="Checkpoint size.")
@click.option("--keep", is_flag=True, help="Keep the temp stores and print where.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def demo(size_mib: int, keep: bool, as_json: bool) -> None:
    """Three nodes as separate processes on 127.0.0.1: a generated safetensors checkpoint
    is put on node 1, fetched by node 2, then by node 3 from nodes 1 and 2 at once,
    verified and memory-mapped from the store."""
    from p2p.cli.demo import run_demo

    run_demo(size_mib=size_mib, keep=keep, as_json=as_json)


COMMANDS = (export_cmd, ticket, demo)
