"""Local store commands of the ``blob`` program: put, get, cat, ls, stat, tag, untag, rm,
gc, verify, store-mode.

Errors are raised as the store's typed errors (each has an ``exit_code``); the ``blob``
main turns them into one line on stderr and that exit status. ``REF`` is a full blob ID,
a unique prefix of 8+ hex characters, or a tag name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from blobstore.catalog import BlobInfo
from blobstore.collection import CollectionEntry
from blobstore.errors import BadCollection, CorruptChunk, StoreCorrupt, StoreError
from blobstore.manifest import DEFAULT_CHUNK_SIZE, check_chunk_size
from blobstore.options import json_option
from blobstore.removal import DEFAULT_GC_GRACE
from blobstore.store import Store

PROGRESS_MIN_BYTES = 32 * 1024 * 1024
"""Below this a put or get finishes in well under a second: no bar, no flicker."""

_SIZE_RE = re.compile(r"(\d+)\s*([kmg]?)(i?b)?", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """'65536', '64K', '64KiB', '1M', '4MiB', '1MB' -> bytes (units are binary)."""
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a size: {text!r} (try 1M, 4MiB or 65536)")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


class ChunkSize(click.ParamType[int]):
    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            size = value
        else:
            try:
                size = parse_size(str(value))
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
        try:
            check_chunk_size(size)
        except StoreError as exc:
            self.fail(str(exc), param, ctx)
        return size


def human_size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _store_root(ctx: click.Context) -> Path:
    root = ctx.ensure_object(dict).get("store_root")
    if root is None:
        raise click.UsageError("no store directory: pass --store DIR or set BLOBNET_STORE")
    return Path(root)


def _open_store(ctx: click.Context) -> Store:
    return Store.open(_store_root(ctx))


def _emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2))


@contextlib.contextmanager
def progress_bar(total: int, desc: str, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A tqdm byte bar on stderr (bytes, rate, ETA), or None when quiet/small/not a tty."""
    if not enabled or total < PROGRESS_MIN_BYTES or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm  # about 0.1 s to import: only a command that draws a bar pays it

    bar = tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        leave=False,
        dynamic_ncols=True,
    )
    last = 0

    def update(done: int) -> None:
        nonlocal last
        bar.update(done - last)
        last = done

    try:
        yield update
    finally:
        bar.close()


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, name))
    return total


@click.command("put")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--tag", "tag_name", metavar="NAME", help="Tag the blob (one PATH only).")
@click.option(
    "--chunk-size",
    type=ChunkSize(),
    default=DEFAULT_CHUNK_SIZE,
    show_default="1MiB",
    help="Chunk size: a power of two from 64KiB to 16MiB (e.g. 4MiB).",
)
@click.option("--move", is_flag=True, help="Move files into the store instead of copying.")
@click.option(
    "--follow-symlinks",
    is_flag=True,
    help="In a directory, follow symbolic links (refused by default: they may point outside).",
)
@json_option()
@click.pass_context
def put_cmd(
    ctx: click.Context,
    paths: tuple[Path, ...],
    tag_name: str | None,
    chunk_size: int,
    move: bool,
    follow_symlinks: bool,
    as_json: bool,
) -> None:
    """Add files (or directories, as collections) to the store; prints ID  PATH."""
    if tag_name is not None and len(paths) > 1:
        raise click.UsageError("--tag names one blob: give a single PATH with it")
    store = _open_store(ctx)
    results = []
    with store.lease() as lease:  # no gc between publishing and tagging
        for path in paths:
            is_dir = path.is_dir()
            if is_dir and move:
                raise click.UsageError(f"--move takes files, and {path} is a directory")
            total = _tree_size(path) if is_dir else (path.stat().st_size if path.is_file() else 0)
            with progress_bar(total, path.name, not as_json) as progress:
                if is_dir:
                    blob_id = store.put_dir(
                        path,
                        chunk_size=chunk_size,
                        progress=progress,
                        follow_symlinks=follow_symlinks,
                        lease=lease,
                    )
                else:
                    blob_id = store.put_path(
                        path, chunk_size=chunk_size, move=move, progress=progress, lease=lease
                    )
            if tag_name is not None:
                store.tag(tag_name, blob_id)
            size = store.manifest(blob_id).size
            results.append(
                {
                    "id": blob_id,
                    "path": str(path),
                    "size": size,
                    "collection": is_dir,
                    "tag": tag_name,
                }
            )
            if not as_json:
                click.echo(f"{blob_id}  {_safe(str(path))}")
    if as_json:
        _emit_json(results)


@click.command("cat")
@click.argument("ref")
@click.pass_context
def cat_cmd(ctx: click.Context, ref: str) -> None:
    """Write a blob's raw bytes to stdout (each chunk verified on the way)."""
    store = _open_store(ctx)
    blob_id = store.resolve(ref)
    out = sys.stdout.buffer
    try:
        for piece in store.iter_verified(blob_id):
            out.write(piece)
        out.flush()
    except BrokenPipeError:
        # The reader went away (`blob cat X | head`): not an error. Point stdout at
        # devnull so the interpreter's final flush does not complain.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\\\u2028\u2029\u202a-\u202e\u2066-\u2069\udc80-\udcff]")


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    if char == "\\":
        return "\\\\"
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte of a local file name
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _safe(text: str) -> str:
    """Text that may come from a peer (collection paths) as one inert terminal line:
    control characters, escape sequences, newlines, bidi overrides and backslashes
    shown as backslash escapes. --json output carries the raw text instead."""
    return _UNSAFE.sub(_escape_char, text)


@dataclass
class _Listing:
    """Which blobs are children of which collections in this store."""

    collections: dict[str, list[CollectionEntry]] = field(default_factory=dict)
    malformed: dict[str, str] = field(default_factory=dict)
    parents: dict[str, list[tuple[str, str]]] = field(default_factory=dict)


def _read_collections(store: Store, rows: list[BlobInfo]) -> _Listing:
    listing = _Listing()
    for r in rows:
        if not r.complete:
            continue
        try:
            entries = store.collection_entries(r.blob_id)
            if entries is None:
                continue
        except (BadCollection, CorruptChunk) as exc:
            listing.malformed[r.blob_id] = str(exc)
            continue
        listing.collections[r.blob_id] = entries
        for e in entries:
            listing.parents.setdefault(e.blob_id, []).append((r.blob_id, e.path))
    return listing


def _state(r: BlobInfo) -> str:
    if r.quarantined:
        return "quarantined"
    return "complete" if r.complete else f"partial {r.verified_chunks}/{r.num_chunks}"


@click.command("ls")
@json_option()
@click.pass_context
def ls_cmd(ctx: click.Context, as_json: bool) -> None:
    """List the blobs in the store; a collection's files are listed under it."""
    store = _open_store(ctx)
    rows = store.list_blobs()
    listing = _read_collections(store, rows)
    if as_json:
        out = []
        for r in rows:
            info = _info_dict(r)
            entries = listing.collections.get(r.blob_id)
            info["collection"] = (
                None
                if entries is None
                else {"files": len(entries), "size": sum(e.size for e in entries)}
            )
            info["parents"] = [
                {"id": parent, "path": path} for parent, path in listing.parents.get(r.blob_id, [])
            ]
            out.append(info)
        _emit_json(out)
        return
    by_id = {r.blob_id: r for r in rows}
    for r in rows:
        if r.blob_id in listing.parents:
            continue  # shown under its collection(s)
        tags = ",".join(r.tags)
        kind = ""
        entries = listing.collections.get(r.blob_id)
        if entries is not None:
            total = sum(e.size for e in entries)
            kind = f"collection of {len(entries)} files, {human_size(total)}"
        elif r.blob_id in listing.malformed:
            kind = "malformed collection"
        line = f"{r.blob_id}  {human_size(r.size):>10}  {_state(r):<16} {kind}"
        click.echo(f"{line}  {tags}".rstrip() if tags else line.rstrip())
        for e in entries or []:
            child = by_id.get(e.blob_id)
            state = "missing" if child is None else _state(child)
            child_tags = ",".join(child.tags) if child is not None else ""
            click.echo(
                f"  {e.blob_id}  {human_size(e.size):>10}  {state:<16} {_safe(e.path)}"
                + (f"  {child_tags}" if child_tags else "")
            )


def _info_dict(r: BlobInfo) -> dict[str, Any]:
    return {
        "id": r.blob_id,
        "size": r.size,
        "chunk_size": r.chunk_size,
        "chunks": r.num_chunks,
        "complete": r.complete,
        "verified_chunks": r.verified_chunks,
        "tags": list(r.tags),
        "quarantined": r.quarantined,
    }


@click.command("stat")
@click.argument("ref")
@json_option()
@click.pass_context
def stat_cmd(ctx: click.Context, ref: str, as_json: bool) -> None:
    """Show one blob: size, chunks, state, tags, path, collection entries."""
    store = _open_store(ctx)
    blob_id = store.resolve(ref)
    manifest = store.manifest(blob_id)
    complete = store.has(blob_id)
    bits = store.chunk_bitmap(blob_id)
    verified = int.from_bytes(bits, "little").bit_count()
    tags = [name for name, target in store.tags().items() if target == blob_id]
    quarantine = store.quarantine_reason(blob_id) if not complete else None
    info: dict[str, Any] = {
        "id": blob_id,
        "size": manifest.size,
        "chunk_size": manifest.chunk_size,
        "chunks": manifest.num_chunks,
        "complete": complete,
        "verified_chunks": verified,
        "tags": tags,
        "path": str(store.path(blob_id)) if complete else None,
        "quarantined": quarantine,
        "collection": None,
        "collection_size": None,
        "collection_error": None,
    }
    try:
        entries = store.collection_entries(blob_id) if complete else None
        if entries is not None:
            info["collection"] = [
                {"path": e.path, "id": e.blob_id, "size": e.size} for e in entries
            ]
            info["collection_size"] = sum(e.size for e in entries)
    except (BadCollection, CorruptChunk) as exc:
        info["collection_error"] = str(exc)
    if as_json:
        _emit_json(info)
        return
    click.echo(f"id:       {blob_id}")
    if info["collection"] is not None:
        total = info["collection_size"]
        click.echo(f"size:     {total} ({human_size(total)}) in {len(info['collection'])} files")
        click.echo(f"listing:  {manifest.size} ({human_size(manifest.size)})")
    else:
        click.echo(f"size:     {manifest.size} ({human_size(manifest.size)})")
    click.echo(f"chunks:   {manifest.num_chunks} x {human_size(manifest.chunk_size)}")
    if quarantine is not None:
        state = f"quarantined ({_safe(quarantine)})"
    else:
        state = "complete" if complete else f"partial ({verified}/{manifest.num_chunks} verified)"
    click.echo(f"state:    {state}")
    click.echo(f"tags:     {', '.join(tags) or '-'}")
    if info["path"]:
        click.echo(f"path:     {info['path']}")
    if info["collection_error"] is not None:
        click.echo(f"collection: refused: {_safe(info['collection_error'])}")
    if info["collection"] is not None:
        click.echo(f"collection of {len(info['collection'])} files:")
        for e in info["collection"]:
            click.echo(f"  {e['id']}  {human_size(e['size']):>10}  {_safe(e['path'])}")


@click.command("tag")
@click.argument("name")
@click.argument("ref")
@json_option()
@click.pass_context
def tag_cmd(ctx: click.Context, name: str, ref: str, as_json: bool) -> None:
    """Point tag NAME at a blob (tags protect blobs from gc)."""
    store = _open_store(ctx)
    blob_id = store.resolve(ref)
    previous = store.tags().get(name)
    store.tag(name, blob_id)
    if as_json:
        _emit_json({"tag": name, "id": blob_id, "previous": previous})


@click.command("untag")
@click.argument("name")
@json_option()
@click.pass_context
def untag_cmd(ctx: click.Context, name: str, as_json: bool) -> None:
    """Remove tag NAME (the blob stays until rm or gc)."""
    store = _open_store(ctx)
    previous = store.tags().get(name)
    store.untag(name)
    if as_json:
        _emit_json({"tag": name, "id": previous})


@click.command("rm")
@click.argument("refs", nargs=-1, required=True)
@json_option()
@click.pass_context
def rm_cmd(ctx: click.Context, refs: tuple[str, ...], as_json: bool) -> None:
    """Remove blobs (and the tags that point at them)."""
    store = _open_store(ctx)
    removed = []
    for blob_id in [store.resolve(ref) for ref in refs]:
        tags = [name for name, target in store.tags().items() if target == blob_id]
        store.rm(blob_id)
        removed.append({"id": blob_id, "tags": tags})
        if not as_json:
            click.echo(f"removed {blob_id}")
    if as_json:
        _emit_json({"removed": removed})


@click.command("gc")
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=DEFAULT_GC_GRACE,
    show_default=True,
    metavar="SECONDS",
    help="Keep untagged blobs touched within this many seconds.",
)
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
@json_option()
@click.pass_context
def gc_cmd(ctx: click.Context, grace: float, dry_run: bool, as_json: bool) -> None:
    """Delete untagged blobs and abandoned partials older than the grace period."""
    removed = _open_store(ctx).gc(grace, dry_run=dry_run)
    if as_json:
        _emit_json({"would_remove" if dry_run else "removed": removed})
        return
    verb = "would remove" if dry_run else "removed"
    for blob_id in removed:
        click.echo(f"{verb} {blob_id}")
    click.echo(f"gc: {verb} {len(removed)} blob(s)", err=True)


@click.command("verify")
@click.argument("refs", nargs=-1)
@json_option()
@click.pass_context
def verify_cmd(ctx: click.Context, refs: tuple[str, ...], as_json: bool) -> None:
    """Re-hash blobs (all by default); exit status 1 names each corrupt one."""
    store = _open_store(ctx)
    ids = [store.resolve(ref) for ref in refs] if refs else store.blob_ids()
    report = []
    for blob_id in ids:
        entry: dict[str, Any] = {"id": blob_id, "ok": True, "bad_chunks": [], "error": None}
        try:
            bad = store.verify(blob_id)  # a rotten complete blob is quarantined here
        except StoreCorrupt as exc:
            entry.update(ok=False, error=str(exc))
        else:
            entry.update(ok=not bad, bad_chunks=bad)
        entry["quarantined"] = store.quarantine_reason(blob_id) is not None
        report.append(entry)
        if not as_json:
            if entry["ok"]:
                click.echo(f"ok       {blob_id}")
            elif entry["error"]:
                click.echo(f"CORRUPT  {blob_id}  {entry['error']}")
            else:
                chunks = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
                held = "  (quarantined)" if entry["quarantined"] else ""
                click.echo(f"CORRUPT  {blob_id}  chunks {chunks}{held}")
    if as_json:
        _emit_json(report)
    corrupt = [e["id"] for e in report if not e["ok"]]
    if corrupt:
        raise StoreCorrupt(
            f"{len(corrupt)} of {len(report)} blob(s) corrupt: {', '.join(corrupt)}; "
            "quarantined (no longer served): put the originals again or fetch them "
            "again (blob get ID --peer ...) to repair them; links to them (blob export, "
            "get --link) dangle until then"
        )


@click.command("store-mode")
@click.argument("mode", required=False, type=click.Choice(["private", "shared"]))
@json_option()
@click.pass_context
def store_mode_cmd(ctx: click.Context, mode: str | None, as_json: bool) -> None:
    """Show or set who may read the store: private (only you; the default) or shared
    (other users may read blobs, never write or lock anything)."""
    shared = None if mode is None else mode == "shared"
    store = Store.open(_store_root(ctx), shared=shared)
    now = "shared" if store.shared else "private"
    if as_json:
        _emit_json({"store": str(store.root), "mode": now})
    else:
        click.echo(f"{now}  {store.root}")


def register(group: click.Group) -> None:
    """Add the store's commands to the top-level group."""
    for command in (
        put_cmd,
        cat_cmd,
        ls_cmd,
        stat_cmd,
        tag_cmd,
        untag_cmd,
        rm_cmd,
        gc_cmd,
        verify_cmd,
        store_mode_cmd,
    ):
        group.add_command(command)
