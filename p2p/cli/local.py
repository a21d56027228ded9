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
from blobstore.options import json_option
from p2p.blob.ticket import Ticket
from p2p.cli.common import (
    check_peer_addrs,
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
@click.option(
    "--tag",
    "tag_name",
    metavar="NAME",
    help="Pin what the links point at with this tag (default: export-<DEST's name>-<hash of "
    "its path>); blob untag it when you remove DEST.",
)
@json_option()
@click.pass_context
def export_cmd(
    ctx: click.Context,
    ref: str,
    dest: Path,
    copy: bool,
    include: Sequence[str],
    tag_name: str | None,
    as_json: bool,
) -> None:
    """Write a blob from the store to DEST without copying it: symlinks to the store's
    read-only files (a collection becomes a directory of them), which
    transformers' from_pretrained(DEST) and safetensors load as they are. The links are
    pinned by a tag, so blob gc never leaves them dangling; of a collection fetched in
    part (get --include), the files that are here are exported."""
    from blobstore.catalog import check_tag_name
    from blobstore.export import export_files, export_tag, present_entries, select_entries

    check_output(dest)
    if tag_name is not None:
        check_tag_name(tag_name)
    store = store_of(ctx)
    blob_id = store.resolve(ref)
    pin = None if copy else (tag_name or export_tag(dest))
    # The lease keeps gc off the blobs between the links' making and the tag's.
    with store.lease([blob_id]):
        missing: list[str] = []
        if store.is_collection(blob_id):
            files = select_entries(store, blob_id, include)
            present, missing = present_entries(store, files)
            if missing and include:
                export_files(store, files, dest, link=not copy)  # names the first missing
            if missing and not present:
                raise BlobNotFound(
                    f"none of the files of collection {blob_id[:12]} is in this store "
                    f"(it lists {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})"
                )
            export_files(store, present, dest, link=not copy)
        else:
            write_output(store, blob_id, dest, include, link=not copy)
        if pin is not None:
            store.tag(pin, blob_id)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        click.echo(
            f"blob: note: {len(missing)} file(s) of {blob_id[:12]} are not in this store and "
            f"were left out: {shown}",
            err=True,
        )
    if pin is not None and not as_json:
        click.echo(f"blob: pinned by tag {pin} (blob untag {pin} once you remove {dest})", err=True)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "id": blob_id,
                    "path": str(dest),
                    "linked": not copy,
                    "tag": pin,
                    "missing": missing,
                }
            )
        )
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
@json_option()
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
@json_option("Print the results as JSON.")
def demo(size_mib: int, keep: bool, as_json: bool) -> None:
    """Three nodes as separate processes on 127.0.0.1: a generated safetensors checkpoint
    is put on node 1, fetched by node 2, then by node 3 from nodes 1 and 2 at once,
    verified and memory-mapped from the store."""
    from p2p.cli.demo import run_demo

    run_demo(size_mib=size_mib, keep=keep, as_json=as_json)


COMMANDS = (export_cmd, ticket, demo)
