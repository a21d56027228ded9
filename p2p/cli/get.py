"""``blob get``: a blob, a collection (or the files of it that ``--include`` names) or named
tensors, from the local store or over the network.

Everything that can be checked without the network is checked before a node starts:
addresses, output paths, tag names, a named peer with our own peer ID, and whether the
command names anywhere to fetch from at all. Named peers are dialled first, so a failure
says which peer and why.

The command's options are the rows of p2p.fetch.options (the light path's parser reads the
same table; ``check_table`` refuses a command that differs from it). The command line
becomes one FetchRequest (p2p.node.request: options checked, the reference parsed or the
name resolved, once), which the rest reads and which goes to the daemon or the node.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import trio

from blobstore import BlobNotFound, Store
from blobstore.errors import StoreError
from blobstore.options import json_option
from p2p.blob.pacing import MIN_UPLOAD_LIMIT
from p2p.cli.common import (
    Interrupted,
    Rate,
    bootstrap_option,
    check_listen_addrs,
    check_peer_addrs,
    daemon_of,
    fetch_listen,
    key_path_of,
    load_key,
    node_config,
    own_cpu_seconds,
    run_interruptible,
    setup_logging,
    store_of,
    upload_limit_option,
    upload_rate,
    verbose_option,
    write_output,
)
from p2p.cli.nat import (
    get_nat_options,
    load_certificate,
)
from p2p.cli.status import fetch_via_daemon
from p2p.fetch.options import (
    COUNT,
    FLAG,
    GET_OPTIONS,
    MULTI,
    NUMBER,
    PATH,
    RATE,
    VALUE,
    Option,
)
from p2p.node.request import BadRequest, FetchOptions, FetchRequest, Reference

if TYPE_CHECKING:
    from identity import MachineKey
    from p2p.fetch.download_parts import Progress
    from p2p.node.node import Node

# A second fetch of a blob into one store waits for the process already fetching it, and
# gives up only when that process has verified nothing new for this long: a fetch that
# progresses is worth waiting for however long it takes, a stuck one is not.
WRITER_STALL_TIMEOUT = 120.0
# How often a waiting fetch looks at the writer's lock and bitmap (a flock probe and a
# small file read), and how often it says what it waits for.
WRITER_POLL_S = 0.2
WRITER_NOTE_EVERY = 10.0
# Waits for other writers one get makes before it gives up: a collection's files may each
# be fetched by another process, and a writer can finish one file and start the next.
MAX_WRITER_WAITS = 256


class ProgressBar:
    """A tqdm bar on stderr fed by the downloader's progress callback. On a resumed fetch
    it starts at the bytes already held, and its rate counts only bytes fetched now."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None

    def __call__(self, progress: Progress) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            # The bytes held when this fetch began: the downloader's rate counts only the
            # bytes since, so done - rate * elapsed recovers them exactly.
            start = max(
                0, round(progress.done_bytes - progress.rate_bytes_per_s * progress.elapsed)
            )
            self.bar = tqdm(
                total=progress.total_bytes,
                initial=start,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=progress.blob_id[:12],
                file=sys.stderr,
                leave=True,
            )
            self.bar.start_t -= progress.elapsed  # the fetch's clock, not the bar's
        self.bar.n = progress.done_bytes
        active = sum(1 for s in progress.peers.values() if not s.banned and not s.dropped)
        self.bar.set_postfix_str(f"peers={active}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _locally_complete(store: Store, blob_id: str, include: Sequence[str]) -> bool:
    """Whether ``blob_id`` (and the collection files wanted) are all in the store."""
    if not store.has(blob_id):
        return False
    if not store.is_collection(blob_id):
        return True
    from blobstore.export import select_entries

    try:
        wanted = select_entries(store, blob_id, include)
    except BlobNotFound:
        return True  # nothing matches: reported when exporting
    return all(store.has(child) for _path, child in wanted)


# The decorators of options `blob get` shares with other commands (p2p.fetch.options'
# ``shared`` rows); get_nat_options declares two rows.
SHARED_OPTIONS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "bootstrap_option": bootstrap_option,
    "upload_limit_option": upload_limit_option,
    "get_nat_options": get_nat_options,
    "json_option": json_option(),
    "verbose_option": verbose_option,
}


def _click_option(option: Option) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """One row of the option table as a click option."""
    kwargs: dict[str, Any] = {"help": option.help, "metavar": option.metavar}
    if option.kind == FLAG:
        kwargs["is_flag"] = True
    elif option.kind == MULTI:
        kwargs["multiple"] = True
    elif option.kind == COUNT:
        kwargs["count"] = True
    elif option.value == PATH:
        kwargs["type"] = click.Path()
    elif option.value == RATE:
        kwargs["type"] = Rate(min=MIN_UPLOAD_LIMIT / 1e6)
    elif option.value == NUMBER:
        bounded = option.low is not None or option.high is not None
        kwargs["type"] = click.FloatRange(min=option.low, max=option.high) if bounded else float
    if option.default is not None:
        kwargs["default"] = option.default
        kwargs["show_default"] = option.show_default
    return click.option(*option.names, option.dest, **kwargs)


def with_options(
    table: Sequence[Option],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options of ``table`` on a click command, in the table's order; each shared
    decorator once, where its first row stands."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        decorators: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = []
        shared: set[str] = set()
        for option in table:
            if option.shared is None:
                decorators.append(_click_option(option))
            elif option.shared not in shared:
                shared.add(option.shared)
                decorators.append(SHARED_OPTIONS[option.shared])
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return decorate


def check_table(command: click.Command, table: Sequence[Option]) -> None:
    """Whether ``command``'s options are ``table``'s, name, destination and kind (a shared
    decorator changed apart from its row would make the light path read another option
    than the full one): a RuntimeError when they are not, as the command is built."""
    declared = {}
    for param in command.params:
        # The app's --store and --key (p2p.cli.app.add_global_options) arrive in no keyword.
        if isinstance(param, click.Option) and param.expose_value:
            kind = (
                FLAG if param.is_flag else MULTI if param.multiple
                else COUNT if param.count else VALUE
            )  # fmt: skip
            declared[param.name] = (tuple(sorted(param.opts)), kind)
    wanted = {o.dest: (tuple(sorted(o.names)), o.kind) for o in table}
    if declared != wanted:
        differ = sorted(
            str(d) for d in declared.keys() | wanted.keys() if declared.get(d) != wanted.get(d)
        )
        raise RuntimeError(f"blob get's options differ from p2p.fetch.options: {differ}")


def fetch_request(
    ctx: click.Context, ref: str, given: dict[str, Any]
) -> tuple[Store, FetchRequest]:
    """``blob get``'s command line as a request, and the store it reads: options checked,
    then addresses, then the store opened and the reference read (a name resolved) once
    (p2p.node.request)."""
    values: dict[str, Any] = {
        k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in given.items()
    }
    output = values.pop("output")
    certificate = load_certificate(values.pop("certificate_path"))
    try:
        options = FetchOptions(
            **values,
            output=None if output is None else Path(output),
            into_dir=output is not None and output.endswith("/"),
            certificate=certificate,
        )
    except BadRequest as exc:
        raise click.UsageError(str(exc)) from None
    check_peer_addrs(options.peers, "--peer")
    check_peer_addrs(options.bootstrap, "--bootstrap")
    check_listen_addrs(options.listen)
    store = store_of(ctx)
    from p2p.names.record import is_name_ref

    if not is_name_ref(ref):
        return store, FetchRequest(Reference.parse(ref, store.resolve), options)
    from p2p.cli.names import resolve_name

    blob_id = resolve_name(
        ctx,
        ref,
        peers=options.peers,
        bootstrap=options.bootstrap,
        listen=options.listen,
        no_dht=options.no_dht,
        verbose=options.verbose,
    )
    return store, FetchRequest(Reference.named(ref, blob_id), options)


@click.command()
@click.argument("ref")
@with_options(GET_OPTIONS)
@click.pass_context
def get(ctx: click.Context, /, ref: str, **given: Any) -> None:
    """Get a blob by ID, 8+ character prefix, tag or ticket: from the local store if it is
    there, else from the network (named peers, a ticket's peers, the DHT through
    --bootstrap peers).

    With -o the blob (or a collection's directory) is written to PATH. Providers behind
    NAT (circuit addresses) are reached through their relay and hole-punched; the blob
    crosses the direct connection, or, with --via-relay, the relay when the punch fails.
    """
    setup_logging(given["verbose"])
    started_at = time.time()
    store, request = fetch_request(ctx, ref, given)
    opts = request.options
    blob_id, out = request.blob_id, opts.output
    # -o onto an existing file: compared now when the blob's manifest is here (nothing is
    # fetched before a refusal), else once the blob has arrived; `kept` when the file
    # holds the blob's bytes already (nothing to write).
    compare_later = out is not None and not opts.tensors and not opts.link and not opts.force
    kept = False
    if compare_later and out is not None and not opts.into_dir and _manifest_known(store, blob_id):
        kept = _check_not_overwriting(store, blob_id, out, fetched=False)
        compare_later = False
    stats: dict[str, Any] = {"source": "local"}
    if opts.tensors:
        _get_tensors(ctx, store, request)
        return
    # A lease keeps gc off what this get still needs (a collection's children included),
    # however long the fetch and the export take.
    with store.lease([blob_id]):
        fetched = False

        def finish(stats: dict[str, Any], fetched: bool) -> None:
            """Tag, write -o and print the result line. Links into the store are pinned
            as `blob export` pins them, when --tag names no pin of the user's own."""
            target = None if out is None else _target(store, blob_id, ref, out, opts.into_dir)
            pin = opts.tag_name
            if opts.link and pin is None and target is not None:
                from blobstore.export import export_tag

                pin = export_tag(target)
                click.echo(
                    f"blob: links pinned by tag {pin} (blob untag {pin} once you remove {target})",
                    err=True,
                )
            if pin is not None:
                store.tag(pin, blob_id)
            if out is not None and target is not None:
                same = kept or (
                    compare_later
                    and _check_not_overwriting(store, blob_id, target, fetched=fetched)
                )
                if not same:
                    # What was just fetched was verified chunk by chunk on arrival: no
                    # second hash.
                    with _directory_for(out, made=target != out):
                        write_output(
                            store,
                            blob_id,
                            target,
                            opts.include,
                            opts.link,
                            show_progress=not opts.as_json,
                            verify=not fetched,
                        )
            if opts.as_json:
                where = str(target) if target else None
                click.echo(json.dumps({"id": blob_id, "path": where, "tag": pin, **stats}))
            else:
                click.echo(f"{blob_id}  {target if target else store.path(blob_id)}")
            sys.stdout.flush()

        named = request.providers
        if named and store.has(blob_id) and store.verify(blob_id):
            # Sources were named, so a rotten local copy is repaired from them instead of
            # being exported (verify has quarantined it; only its bad chunks travel).
            click.echo(
                f"blob: note: the local copy of {blob_id[:12]} is corrupt (quarantined); "
                "repairing it from the named peers",
                err=True,
            )
        _wait_for_writer(store, blob_id)
        if not _locally_complete(store, blob_id, opts.include):
            # A `blob serve` on this store fetches on its warm connections and DHT table.
            bar_on = not opts.no_progress and not opts.as_json and sys.stderr.isatty()
            by_daemon = None if opts.own_node else fetch_via_daemon(daemon_of(ctx), request, bar_on)
            if by_daemon is not None:
                finish(by_daemon, True)
                return
            if not named and not opts.use_dht:
                raise click.UsageError(
                    f"{blob_id[:12]} is not complete in this store, and nothing says where to "
                    "fetch it from: give --peer MADDR, --bootstrap MADDR or a ticket"
                )
            key_path = key_path_of(ctx)
            key = load_key(key_path)
            from p2p.fetch.sched_records import SchedulerConfig
            from p2p.node.dial import check_not_self

            check_not_self([*named, *opts.bootstrap], key.peer_id, key_path)
            config = node_config(
                fetch_listen(opts.listen, [*named, *opts.bootstrap]),
                opts.bootstrap,
                opts.use_dht,
                discovery_timeout=opts.discovery_timeout,
                upload=not opts.no_upload,
                upload_limit=upload_rate(opts.upload_limit),
                download_limit=upload_rate(opts.download_limit),
                relayed_fetch=opts.via_relay,
                certificate=opts.certificate,
                punch_timeout=opts.punch_timeout,
                # A one-shot get's node ends with its fetch: while fellows still ask it
                # for chunks it stays a little (p2p.blob.swarm rule 5), so the tail of the
                # swarm is not left to the seeder alone.
                scheduler=SchedulerConfig(linger_while_asked=not opts.no_upload),
                dht_server=False,  # gone in a moment: servers must not keep it in their tables
            )
            bar = ProgressBar(enabled=bar_on)
            seed = None if opts.seed_for is None else Seeding(opts.seed_for, bar, finish)
            try:
                for waits in range(MAX_WRITER_WAITS + 1):
                    try:
                        stats = _fetch(store, key, config, request, bar, started_at, seed)
                        fetched = True
                        break
                    except BaseException as exc:
                        # Another process fetches this blob (or one of the collection's
                        # files) into this store: wait for it, then take what it got (or,
                        # if it died, go on from its partial).
                        busy = _busy_blob(exc)
                        if busy is None or waits == MAX_WRITER_WAITS:
                            raise
                        _wait_for_writer(store, busy)
                        if _locally_complete(store, blob_id, opts.include):
                            break
            except Interrupted as exc:
                if seed is None or not seed.started:
                    raise
                # The get itself succeeded (its result line is out): ending the seeding is
                # a server's normal end.
                click.echo(f"stopping on {exc.signal_name}", err=True)
                return
            finally:
                bar.close()
            if seed is not None:
                return  # finished inside, before seeding
        elif opts.seed_for is not None:
            click.echo(
                f"blob: note: {blob_id[:12]} was already here; nothing fetched, so nothing "
                "to seed (blob serve serves it)",
                err=True,
            )
        finish(stats, fetched)


check_table(get, GET_OPTIONS)


def _manifest_known(store: Store, blob_id: str) -> bool:
    """Whether the blob's manifest is here: the blob complete, or a partial of it."""
    try:
        store.manifest(blob_id)
    except BlobNotFound:
        return False
    return True


def _check_not_overwriting(store: Store, blob_id: str, path: Path, *, fetched: bool) -> bool:
    """``-o`` onto an existing file replaces it only with the same bytes (a re-run, or a
    copy made by other means) or with --force, so that a typo in -o cannot destroy an
    unrelated file. True when ``path`` holds the blob's bytes already (nothing to write):
    compared by size first, then chunk by chunk against the manifest (``Store.holds``),
    following a symlink. A directory, or a collection's output, is the export's to judge."""
    path = path.expanduser()
    if not (path.is_file() or path.is_symlink()):
        return False
    if store.has(blob_id) and store.is_collection(blob_id):
        return False
    real = path.resolve()
    if store.holds(blob_id, real):
        return True
    size = store.manifest(blob_id).size
    if not real.is_file():
        what = "is not a file"
    else:
        have = real.stat().st_size
        what = (
            f"holds other bytes than {blob_id[:12]} ({have} bytes; the blob is {size})"
            if have != size
            else f"holds other bytes than {blob_id[:12]} (the same size, {size} bytes)"
        )
    here = f" ({blob_id[:12]} is in the store now: -o elsewhere writes it)" if fetched else ""
    raise StoreError(
        f"{path} already exists and {what}; give --force to replace it, or another -o{here}"
    )


def _target(store: Store, blob_id: str, ref: str, out: Path, into_dir: bool) -> Path:
    """Where -o writes: OUT itself, or for ``-o OUT/`` and a one-file blob OUT/NAME, NAME
    being the last part of a published name, the tag, or else the blob ID (a collection
    is the directory OUT itself)."""
    if not into_dir or store.is_collection(blob_id):
        return out
    from p2p.names.record import is_name_ref

    if is_name_ref(ref):
        name = ref.rsplit("/", 1)[-1]  # a name's segments are plain file names
    elif ref in store.tags():
        name = ref  # a tag is a plain file name (blobstore.catalog.TAG_NAME_RE)
    else:
        name = blob_id
    return out / name


@contextlib.contextmanager
def _directory_for(out: Path, *, made: bool) -> Iterator[None]:
    """With ``made``, ``out`` is a directory a file is written into: created if missing,
    and removed again if the write fails, so that a failed get leaves nothing."""
    if not made:
        yield
        return
    created = not out.exists()
    try:
        out.mkdir(exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot make directory {out}: {exc.strerror or exc}") from None
    try:
        yield
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise


def _busy_blob(exc: BaseException) -> str | None:
    """The blob another process is writing, if that is what ``exc`` (or the one error in
    a group of them) says."""
    from blobstore.errors import PartialBusy
    from p2p.errors import unwrap_single

    error = unwrap_single(exc) if isinstance(exc, BaseExceptionGroup) else exc
    return error.blob_id if isinstance(error, PartialBusy) else None


def _wait_for_writer(store: Store, blob_id: str) -> None:
    """While another process writes ``blob_id``'s partial into this store, wait (saying
    so on stderr now and then); return when it has finished or died. A writer that
    verifies nothing new for WRITER_STALL_TIMEOUT is reported instead (exit 5)."""
    from blobstore import bitmap
    from blobstore.errors import PartialBusy

    writer = store.partial_writer(blob_id)
    if writer is None:
        return

    def held() -> tuple[int, int]:
        try:
            bits = store.chunk_bitmap(blob_id)
            return bitmap.count_bits(bits), store.manifest(blob_id).num_chunks
        except StoreError:
            return 0, 0

    count, total = held()
    changed = said = time.monotonic()
    click.echo(
        f"blob: waiting for {writer}, which is fetching {blob_id[:12]} into this store "
        f"({count} of {total} chunks so far)",
        err=True,
    )
    while writer is not None:
        time.sleep(WRITER_POLL_S)
        now = time.monotonic()
        latest, total = held()
        if latest != count:
            count, changed = latest, now
        elif now - changed > WRITER_STALL_TIMEOUT:
            raise PartialBusy(
                f"blob {blob_id[:12]} is being written by {writer}, which has verified no "
                f"chunk for {WRITER_STALL_TIMEOUT:.0f} s; stop that process and fetch again",
                blob_id,
            )
        if now - said >= WRITER_NOTE_EVERY:
            said = now
            click.echo(f"blob: still waiting for {writer} ({count} of {total} chunks)", err=True)
        writer = store.partial_writer(blob_id)


def _get_tensors(ctx: click.Context, store: Store, request: FetchRequest) -> None:
    """``blob get REF --tensor NAME...``: only those tensors, saved with numpy."""
    from p2p.fetch.tensors import TensorFetch, fetch_tensors, read_local_tensors

    blob_id, named, names = request.blob_id, request.providers, request.options.tensors
    output, as_json = request.options.output, request.options.as_json

    if output is not None and output.suffix not in (".npy", ".npz"):
        raise click.UsageError("--tensor writes numpy files: give -o NAME.npy or -o NAME.npz")
    if output is not None and output.suffix == ".npy" and len(set(names)) > 1:
        raise click.UsageError("several --tensor go to one -o NAME.npz")
    result: TensorFetch
    if not named:
        source = "local"
        if not store.has(blob_id):
            raise click.UsageError(
                f"{blob_id[:12]} is not complete in this store: --tensor fetches from "
                "--peer MADDR or a ticket's peers"
            )
        result = run_interruptible(lambda: read_local_tensors(store, blob_id, names))
    else:
        source = "network"
        key_path = key_path_of(ctx)
        key = load_key(key_path)
        from p2p.node.dial import check_not_self, dial_named, peer_id_of, unreachable_error
        from p2p.node.node import open_node

        check_not_self(named, key.peer_id, key_path)
        config = node_config(request.options.listen, (), False)

        async def main() -> TensorFetch:
            async with open_node(store, key=key, config=config) as node:
                dialled = await dial_named(node, named)
                if not dialled.reached:
                    raise unreachable_error(dialled.failures)
                peers = [peer_id_of(a) for a in dialled.usable]
                return await fetch_tensors(node, blob_id, names, peers=peers)

        result = run_interruptible(main)
    if output is not None:
        _save_arrays(output, result.tensors)
    info: dict[str, dict[str, Any]] = {
        name: {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "bytes": t.end - t.begin,
            "file": result.files[name],
        }
        for name, t in result.infos.items()
    }
    if as_json:
        click.echo(
            json.dumps(
                {
                    "id": blob_id,
                    "path": str(output) if output else None,
                    "source": source,
                    "tensors": info,
                    "fetched_chunks": result.fetched_chunks,
                    "chunks": result.num_chunks,
                }
            )
        )
        return
    for name, t in info.items():
        shape = "x".join(map(str, t["shape"])) or "scalar"
        click.echo(f"{name}  {t['dtype']} {shape}  {t['file']}")
    where = f" into {output}" if output is not None else ""
    click.echo(
        f"fetched {result.fetched_chunks} of {result.num_chunks} chunks of {blob_id[:12]}" + where,
        err=True,
    )


def _save_arrays(output: Path, arrays: dict[str, Any]) -> None:
    """One array to NAME.npy, or all of them to NAME.npz, renamed into place."""
    import secrets

    import numpy as np

    staging = output.absolute().parent / f".{output.name}.blobnet-{secrets.token_hex(6)}"
    try:
        with staging.open("wb") as handle:
            if output.suffix == ".npy":
                np.save(handle, next(iter(arrays.values())))
            else:
                np.savez(handle, **arrays)
        staging.replace(output)
    except OSError as exc:
        staging.unlink(missing_ok=True)
        raise StoreError(f"cannot write {output}: {exc.strerror or exc}") from None


class Seeding:
    """``get --seed-for``: once fetched, ``finish`` (tag, -o, result line) runs inside
    the node, which then serves fellow fetchers for ``seconds``."""

    def __init__(
        self,
        seconds: float,
        bar: ProgressBar,
        finish: Callable[[dict[str, Any], bool], None],
    ) -> None:
        self.seconds = seconds
        self.bar = bar
        self.finish = finish
        self.started = False

    async def run(self, node: Node, blob_id: str, stats: dict[str, Any]) -> None:
        self.bar.close()
        await trio.to_thread.run_sync(self.finish, stats, True)
        self.started = True
        click.echo(
            f"seeding {blob_id[:12]} for {self.seconds:g} s as {node.peer_id} (Ctrl-C stops)",
            err=True,
        )
        await trio.sleep(self.seconds)


def _fetch(
    store: Store,
    key: MachineKey,
    config: Any,
    request: FetchRequest,
    bar: ProgressBar,
    started_at: float | None = None,
    seed: Seeding | None = None,
) -> dict[str, Any]:
    """Dial the named peers, then fetch the request's blob (and the wanted files of a
    collection); the fetch's figures for ``--json``. A failed hole punch is one note on
    stderr (the fetch goes on with other providers) and part of the error when no
    provider is left. With ``seed``, it finishes and seeds inside the node."""
    from p2p.errors import P2PError
    from p2p.node.dial import dial_named, unreachable_error
    from p2p.node.node import open_node

    final: list[Progress] = []
    # This process's CPU seconds (all threads) from the fetch's start to its end, for
    # benchmarks: start-up and imports excluded.
    cpu_marks: list[float] = []
    first_byte_at: list[float] = []
    done_at: list[float] = []  # wall clock when the blob was complete (before any linger)
    said: set[str] = set()

    def on_progress(progress: Progress) -> None:
        bar(progress)
        if not first_byte_at and sum(progress.new_bytes.values()) > 0:
            first_byte_at.append(time.time())
        if progress.finished:
            cpu_marks.append(own_cpu_seconds())
            final.append(progress)
            done_at.append(time.time())

    def note_punches(node: Node) -> None:
        for reasons, then in (
            (node.punches.failures, "fetching from other providers"),
            (node.punches.relayed, "fetching through its relay (--via-relay)"),
        ):
            for reason in reasons:
                if reason not in said:
                    said.add(reason)
                    click.echo(f"blob: note: {reason}; {then}", err=True)

    async def main() -> None:
        async with open_node(store, key=key, config=config) as node:
            try:
                # The first named peer to answer starts the fetch; if none can, say why.
                dialled = await dial_named(node, request.providers)
                if dialled.failures and not dialled.reached and not config.dht:
                    raise unreachable_error(dialled.failures)
                if dialled.failures and request.options.verbose:
                    for line in dialled.failures:
                        click.echo(f"blob: note: cannot reach {line}", err=True)
                note_punches(node)
                cpu_marks.append(own_cpu_seconds())
                # A one-shot fetcher does not announce: it is gone once the blob is here.
                await _fetch_wanted(node, request, dialled.usable, on_progress)
            except P2PError as exc:
                punches = [r for r in node.punches.failures if r not in str(exc)]
                if not punches:
                    raise
                # Why the NATed providers were no use is the part the user needs.
                raise type(exc)(f"{exc}; " + "; ".join(punches)) from None
            note_punches(node)
            if seed is not None:
                stats = _fetch_stats(final, cpu_marks, first_byte_at, started_at, done_at)
                await seed.run(node, request.blob_id, stats)

    run_interruptible(main)
    return _fetch_stats(final, cpu_marks, first_byte_at, started_at, done_at)


def _fetch_stats(
    final: list[Progress],
    cpu_marks: list[float],
    first_byte_at: list[float],
    started_at: float | None,
    done_at: Sequence[float] = (),
) -> dict[str, Any]:
    stats: dict[str, Any] = {"source": "network"}
    if final:
        stats["rate_bytes_per_s"] = final[-1].rate_bytes_per_s
        stats["transfer_rate_bytes_per_s"] = final[-1].transfer_rate_bytes_per_s
        stats["seconds"] = final[-1].elapsed
        stats["duplicate_bytes"] = final[-1].duplicate_bytes
        stats["cpu_s"] = round(cpu_marks[-1] - cpu_marks[0], 3)
        stats["peers"] = {
            peer: {"bytes": final[-1].new_bytes.get(peer, 0), "banned": s.banned}
            for peer, s in final[-1].peers.items()
        }
    if first_byte_at:
        # Wall clock, so a caller can count from its own start of this process too.
        stats["first_byte_at"] = first_byte_at[0]
        if started_at is not None:
            stats["first_byte_s"] = round(first_byte_at[0] - started_at, 3)
    if done_at:
        # Wall clock too: a swarm bench takes the last worker's (p2p.blob.swarm rule 5: a
        # fetcher may linger after this, serving fellows).
        stats["done_at"] = done_at[0]
    return stats


# Files of a collection fetched at once with --include (as the node does for whole ones).
INCLUDE_PARALLELISM = 4


async def _fetch_wanted(
    node: Node,
    request: FetchRequest,
    providers: Sequence[str],
    on_progress: Callable[[Progress], None],
) -> None:
    """The request's blob, or with --include its collection's matching files, from
    ``providers`` (the named ones dialled, the ticket's among them)."""
    blob_id, include, reference = request.blob_id, request.options.include, request.reference
    if not include:
        await node.fetch(reference, providers=providers, progress=on_progress, announce=False)
        return
    await node.fetch(reference, providers=providers, recursive=False, announce=False)
    if not await trio.to_thread.run_sync(node.store.is_collection, blob_id):
        raise click.UsageError(f"--include picks files of a collection; {blob_id[:12]} is a file")
    from blobstore.export import select_entries

    wanted = await trio.to_thread.run_sync(select_entries, node.store, blob_id, include)
    limiter = trio.CapacityLimiter(INCLUDE_PARALLELISM)

    async def child(child_id: str) -> None:
        async with limiter:
            await node.fetch(
                Reference.of(child_id), providers=providers, progress=on_progress, recursive=False,
                announce=False,
            )  # fmt: skip

    async with trio.open_nursery() as nursery:
        for child_id in dict.fromkeys(c for _path, c in wanted):
            nursery.start_soon(child, child_id)
