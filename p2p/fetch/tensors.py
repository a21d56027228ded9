"""Named tensors of a safetensors blob, fetched without the rest of the file.

Theory of operation
A safetensors file is an 8-byte little-endian length N, N bytes of JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``), then
the tensors' bytes, their offsets counted from the end of the header. So which chunks of
the blob a tensor lives in follows from the header alone:

1. The manifest comes from the local store (a complete or partial blob) or from the first
   provider whose answer hashes to the blob ID (``p2p.fetch.download_probes.fetch_manifest``).
2. The chunk holding the 8-byte length, then the chunks spanning the header, are fetched;
   the header is parsed and checked against the blob's size.
3. Only the chunks spanning the tensors asked for are fetched, with the blob protocol's
   own ``get`` requests (``p2p.blob.shell.BlobClient``), from each provider in turn until none
   is missing.

Every chunk goes into the store's partial blob for this ID through
``PartialBlob.write_chunk``, which checks it against the manifest's hash before writing,
and is read back through ``PartialBlob.read_chunk``, which checks it again: no unverified
byte reaches a tensor. The chunks stay in the partial blob, so a later full ``blob get``
resumes from them instead of fetching them again (``blob gc`` removes an abandoned one).
A complete local blob is read from the store directly, with no node needed.

4. Of a sharded model's collection, the files the model's ``*.safetensors.index.json``
   names for the tensors (its ``weight_map``) are read first, so only their headers are
   fetched; the others are read only if a tensor is not where the index says (an index is
   a hint: every tensor still comes from a header that says where it is).
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from blobstore import BlobExists, BlobNotFound, CorruptChunk, Manifest, Store
from blobstore.collection import COLLECTION_MAGIC, MAX_COLLECTION_SIZE, looks_like_collection
from blobstore.exitcodes import ExitCode
from p2p.blob import messages
from p2p.blob.shell import BlobClient, StreamLost, reset_quietly
from p2p.errors import FetchFailed, NoProviders

if TYPE_CHECKING:
    import numpy as np

    from blobstore import PartialBlob

HEADER_LENGTH_BYTES = 8
# safetensors itself refuses headers over 100 MB (its MAX_HEADER_SIZE); so do we, before
# fetching them.
MAX_HEADER_BYTES = 100_000_000
# safetensors dtype -> numpy dtype. BF16 has no numpy type: it is widened to float32,
# exactly (a bfloat16 is the top half of a float32).
NUMPY_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "u1",
    "BOOL": "?",
}
# A header's shapes are decoded by numpy: more dimensions than numpy 1.x's NPY_MAXDIMS, or
# extents whose non-zero product is past what any array could hold (even for a tensor
# with a zero extent, which holds no bytes), would raise inside numpy instead of being
# refused as bad data. Real model tensors have at most ~5 dimensions.
MAX_NDIM = 32
MAX_EXTENT_PRODUCT = 1 << 48
# One request may not run longer than this plus its bytes at MIN_RATE: a provider slower
# than that loses the rest of the job to the next one.
REQUEST_GRACE = 15.0
MIN_RATE_BYTES_PER_S = 1024 * 1024
# A sharded model's index of tensors (rule 4). Hugging Face's name for it ends so; an index
# larger than this is not read (a model of a million tensors has an index of ~100 MB, and
# the headers then cost no more).
INDEX_SUFFIX = ".safetensors.index.json"
MAX_INDEX_BYTES = 32 * 1024 * 1024


class BadSafetensors(Exception):
    """The blob is not a well-formed safetensors file (bad data)."""

    exit_code = ExitCode.BAD_DATA


class TensorNotFound(BlobNotFound):
    """The safetensors header names no such tensor."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def _chunks_covering(manifest: Manifest, begin: int, end: int) -> range:
    """Indices of the chunks holding bytes ``[begin, end)`` (empty for an empty span)."""
    if end <= begin:
        return range(0)
    return range(begin // manifest.chunk_size, (end - 1) // manifest.chunk_size + 1)


def parse_header(raw: bytes, data_start: int, file_size: int) -> dict[str, TensorInfo]:
    """The tensors a safetensors header describes, each checked to lie inside the file,
    to hold exactly ``prod(shape)`` elements of its dtype, to have a shape numpy can hold,
    and not to overlap another (as ``safetensors`` itself refuses)."""
    import numpy as np

    try:
        header = json.loads(raw)
    except RecursionError:
        raise BadSafetensors("safetensors header is nested too deeply to be one") from None
    except ValueError as exc:  # also UnicodeDecodeError, and integers of 4,300+ digits
        raise BadSafetensors(f"safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise BadSafetensors("safetensors header is not a JSON object")
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise BadSafetensors(f"tensor {name!r}: malformed header entry") from None
        ok_shape = (
            isinstance(shape, list)
            and len(shape) <= MAX_NDIM
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            and math.prod(d for d in shape if d) <= MAX_EXTENT_PRODUCT
        )
        if not isinstance(dtype, str) or dtype not in NUMPY_DTYPES or not ok_shape:
            raise BadSafetensors(f"tensor {name!r}: unsupported dtype {dtype!r} or bad shape")
        itemsize = np.dtype(NUMPY_DTYPES[dtype]).itemsize
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise BadSafetensors(f"tensor {name!r}: bad data_offsets")
        if end - begin != math.prod(shape) * itemsize or data_start + end > file_size:
            raise BadSafetensors(f"tensor {name!r}: its offsets do not match its shape or file")
        out[name] = TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)
    spans = sorted((t.begin, t.end, t.name) for t in out.values() if t.end > t.begin)
    for (_, end_a, name_a), (begin_b, _, name_b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise BadSafetensors(f"tensors {name_a!r} and {name_b!r} overlap in the file")
    return out


def decode_tensor(info: TensorInfo, data: bytes) -> np.ndarray:
    """The tensor's bytes as a numpy array of its shape (BF16 widened to float32)."""
    import numpy as np

    array = np.frombuffer(data, dtype=np.dtype(NUMPY_DTYPES[info.dtype]))
    if info.dtype == "BF16":
        array = (array.astype("<u4") << 16).view("<f4")
    return array.reshape(info.shape).copy()


class ChunkSource:
    """Verified chunks of one blob: from the complete blob in the store, or fetched into
    its partial blob from providers on demand."""

    def __init__(
        self,
        store: Store,
        manifest: Manifest,
        partial: PartialBlob | None,
        network: Any = None,
        peers: Sequence[str] = (),
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.partial = partial
        self.network = network
        self.peers = list(peers)
        self.fetched_chunks = 0

    def _held(self, index: int) -> bool:
        return self.partial is None or self.partial.has_chunk(index)

    async def ensure(self, indices: Iterable[int]) -> None:
        """Fetch the chunks among ``indices`` that the store does not hold yet."""
        todo = sorted({i for i in indices if not self._held(i)})
        failures: list[str] = []
        for peer in self.peers:
            if not todo:
                break
            reason = await self._fetch_from(peer, todo)
            if reason is not None:
                failures.append(f"{peer}: {reason}")
            todo = [i for i in todo if not self._held(i)]
        if todo:
            blob = self.manifest.blob_id[:12]
            if not self.peers:
                raise NoProviders(f"no provider to fetch {len(todo)} chunk(s) of {blob} from")
            raise FetchFailed(
                f"{len(todo)} chunk(s) of {blob} could not be fetched from "
                f"{len(self.peers)} peer(s)" + (f" ({'; '.join(failures)})" if failures else "")
            )

    async def _fetch_from(self, peer: str, todo: list[int]) -> str | None:
        """Ask ``peer`` for ``todo``; None if it answered, else why it failed."""
        assert self.partial is not None
        partial = self.partial
        stream = None

        async def on_chunk(index: int, data: memoryview) -> None:
            # Raises CorruptChunk (nothing written) if the bytes do not match the manifest.
            if await trio.to_thread.run_sync(partial.write_chunk, index, data):
                self.fetched_chunks += 1

        try:
            stream = await self.network.open_blob_stream(peer)
            client = BlobClient(stream, lambda i: self.manifest.chunk_span(i)[1])
            for ranges, count in _requests(todo):
                timeout = REQUEST_GRACE + count * self.manifest.chunk_size / MIN_RATE_BYTES_PER_S
                with trio.fail_after(timeout):
                    reply = await client.get(self.manifest.blob_id, ranges, on_chunk)
                if isinstance(reply, messages.ErrorResponse):
                    return f"answered {reply.code.name.lower()}"
        except CorruptChunk:
            return "sent a chunk that does not match its hash"
        except trio.TooSlowError:
            return "too slow"
        except (StreamLost, messages.ProtocolError, OSError) as exc:
            return str(exc) or type(exc).__name__
        finally:
            if stream is not None:
                await reset_quietly(stream)
        return None

    async def read(self, begin: int, end: int) -> bytes:
        """Bytes ``[begin, end)`` of the blob, every chunk verified on the way."""
        indices = _chunks_covering(self.manifest, begin, end)
        await self.ensure(indices)
        pieces = []
        for index in indices:
            if self.partial is None:
                chunk = await trio.to_thread.run_sync(
                    self.store.read_chunk, self.manifest.blob_id, index
                )
            else:
                chunk = await trio.to_thread.run_sync(self.partial.read_chunk, index)
            offset = index * self.manifest.chunk_size
            pieces.append(chunk[max(0, begin - offset) : max(0, end - offset)])
        return b"".join(pieces)


def _requests(indices: list[int]) -> Iterable[tuple[tuple[tuple[int, int], ...], int]]:
    """Sorted chunk indices as ``get`` requests within the protocol's limits: ``(ranges,
    chunk count)`` each, runs of consecutive indices as half-open ranges."""
    runs: list[tuple[int, int]] = []
    count = 0
    for index in indices:
        if runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            if len(runs) == messages.MAX_RANGES_PER_REQUEST:
                yield tuple(runs), count
                runs, count = [], 0
            runs.append((index, index + 1))
        count += 1
        if count == messages.MAX_CHUNKS_PER_REQUEST:
            yield tuple(runs), count
            runs, count = [], 0
    if runs:
        yield tuple(runs), count


async def read_header(source: ChunkSource) -> dict[str, TensorInfo]:
    size = source.manifest.size
    if size < HEADER_LENGTH_BYTES:
        raise BadSafetensors(f"blob {source.manifest.blob_id[:12]} is too short for safetensors")
    (length,) = struct.unpack("<Q", await source.read(0, HEADER_LENGTH_BYTES))
    if length > MAX_HEADER_BYTES or HEADER_LENGTH_BYTES + length > size:
        raise BadSafetensors(
            f"blob {source.manifest.blob_id[:12]} is not safetensors "
            f"(its header would be {length} bytes)"
        )
    raw = await source.read(HEADER_LENGTH_BYTES, HEADER_LENGTH_BYTES + length)
    return parse_header(raw, HEADER_LENGTH_BYTES + length, size)


@dataclass
class TensorFetch:
    """What :func:`fetch_tensors` returns: the arrays, where each came from (the blob ID,
    or the file's path in a collection), and how many chunks it fetched of how many in
    the files it read."""

    tensors: dict[str, np.ndarray]
    infos: dict[str, TensorInfo]
    files: dict[str, str]
    fetched_chunks: int
    num_chunks: int

    def merge(self, other: TensorFetch) -> None:
        self.tensors.update(other.tensors)
        self.infos.update(other.infos)
        self.files.update(other.files)
        self.fetched_chunks += other.fetched_chunks
        self.num_chunks += other.num_chunks


async def fetch_tensors(
    node: Any, blob_id: str, names: Sequence[str], *, peers: Sequence[str] = ()
) -> TensorFetch:
    """Tensors ``names`` of safetensors blob ``blob_id`` (or of the ``*.safetensors``
    files of a collection, a sharded model): read from the store if the blob
    is complete there, else fetching only the chunks they need from ``peers`` (peer IDs,
    already connected) and the node's connected peers. ``node`` is a
    ``p2p.node.node.Node`` (or anything with its ``store``, ``connected_peers`` and
    ``open_blob_stream``)."""
    return await _fetch_tensors(node.store, node, blob_id, names, peers)


async def read_local_tensors(store: Store, blob_id: str, names: Sequence[str]) -> TensorFetch:
    """Tensors ``names`` of a complete local safetensors blob (no network)."""
    return await _fetch_tensors(store, None, blob_id, names, ())


async def _fetch_tensors(
    store: Store, network: Any, blob_id: str, names: Sequence[str], peers: Sequence[str]
) -> TensorFetch:
    candidates: list[str] = []
    if network is not None:
        candidates = list(dict.fromkeys([*peers, *network.connected_peers()]))
    async with _open_source(store, network, blob_id, candidates) as source:
        size = source.manifest.size
        head = await source.read(0, min(size, len(COLLECTION_MAGIC)))
        if not looks_like_collection(head) or size > MAX_COLLECTION_SIZE:
            return await _extract(source, names, names)
        await source.ensure(range(source.manifest.num_chunks))  # a listing: small
    return await _from_collection(store, network, blob_id, names, candidates)


async def _from_collection(
    store: Store, network: Any, blob_id: str, names: Sequence[str], peers: Sequence[str]
) -> TensorFetch:
    """The tensors from whichever ``*.safetensors`` files of collection ``blob_id`` hold
    them: each file's header is read (its first chunks only) until every name is found."""
    entries = await trio.to_thread.run_sync(store.read_collection, blob_id)
    entries = await _index_first(store, network, entries, names, peers)
    result = TensorFetch({}, {}, {}, 0, 0)
    for entry in entries:
        missing = [n for n in names if n not in result.tensors]
        if not missing:
            break
        if not entry.path.endswith(".safetensors"):
            continue
        async with _open_source(store, network, entry.blob_id, peers) as source:
            part = await _extract(source, missing, (), where=entry.path)
        result.merge(part)
    missing = [n for n in names if n not in result.tensors]
    if missing:
        raise TensorNotFound(
            f"no safetensors file of collection {blob_id[:12]} has tensor {missing[0]!r}"
        )
    return result


async def _index_first(
    store: Store, network: Any, entries: list[Any], names: Sequence[str], peers: Sequence[str]
) -> list[Any]:
    """``entries`` with the files that the collection's index names for ``names`` first
    (rule 4); as they were when there is no usable index."""
    index = next((e for e in entries if e.path.endswith(INDEX_SUFFIX)), None)
    if index is None or index.size > MAX_INDEX_BYTES:
        return entries
    try:
        async with _open_source(store, network, index.blob_id, peers) as source:
            await source.ensure(range(source.manifest.num_chunks))
            raw = await source.read(0, source.manifest.size)
    except (BlobNotFound, NoProviders, FetchFailed):
        return entries  # not to be had: the headers say the same, one by one
    try:
        weight_map = json.loads(raw)["weight_map"]
    except (ValueError, TypeError, KeyError):
        return entries  # not an index after all: every header is read
    if not isinstance(weight_map, dict):
        return entries
    folder = index.path.rpartition("/")[0]
    named = {
        f"{folder}/{weight_map[n]}" if folder else weight_map[n]
        for n in names
        if isinstance(weight_map.get(n), str)
    }
    return [e for e in entries if e.path in named] + [e for e in entries if e.path not in named]


@asynccontextmanager
async def _open_source(
    store: Store, network: Any, blob_id: str, peers: Sequence[str]
) -> AsyncIterator[ChunkSource]:
    """Chunks of ``blob_id``: the complete blob in the store, else its partial blob, fed
    from ``peers`` and published if it happens to become complete."""
    if await trio.to_thread.run_sync(store.has, blob_id):
        manifest = await trio.to_thread.run_sync(store.manifest, blob_id)
        yield ChunkSource(store, manifest, None)
        return
    if network is None:
        raise BlobNotFound(f"no complete blob {blob_id} in this store")
    manifest = await _manifest(store, network, blob_id, peers)
    try:
        partial = await trio.to_thread.run_sync(store.begin_partial, manifest)
    except BlobExists:  # completed meanwhile
        yield ChunkSource(store, manifest, None)
        return
    try:
        yield ChunkSource(store, manifest, partial, network, peers)
        if partial.is_complete:
            await trio.to_thread.run_sync(partial.publish)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(partial.close)


async def _manifest(store: Store, network: Any, blob_id: str, peers: Sequence[str]) -> Manifest:
    from p2p.fetch.download_probes import fetch_manifest

    try:
        return await trio.to_thread.run_sync(store.manifest, blob_id)  # a partial's
    except BlobNotFound:
        pass
    for peer in peers:
        manifest = await fetch_manifest(network, blob_id, peer)
        if manifest is not None:
            return manifest
    if not peers:
        raise NoProviders(f"no provider found for {blob_id}")
    raise NoProviders(f"none of {len(peers)} peer(s) asked holds {blob_id}")


async def _extract(
    source: ChunkSource, names: Sequence[str], required: Sequence[str], where: str = ""
) -> TensorFetch:
    """The tensors among ``names`` that this file holds; a name in ``required`` that it
    does not hold is TensorNotFound."""
    infos = await read_header(source)
    unknown = [n for n in required if n not in infos]
    if unknown:
        known = sorted(infos)
        shown = ", ".join(known[:6]) + (f" ... ({len(known)} in all)" if len(known) > 6 else "")
        raise TensorNotFound(
            f"blob {source.manifest.blob_id[:12]} has no tensor {unknown[0]!r}; "
            f"it has: {shown or 'none'}"
        )
    wanted = [infos[n] for n in dict.fromkeys(names) if n in infos]
    # One pass over the union of chunks first, so every provider gets one job.
    await source.ensure(
        i for t in wanted for i in _chunks_covering(source.manifest, t.begin, t.end)
    )
    tensors = {t.name: decode_tensor(t, await source.read(t.begin, t.end)) for t in wanted}
    return TensorFetch(
        tensors=tensors,
        infos={t.name: t for t in wanted},
        files={t.name: where or source.manifest.blob_id for t in wanted},
        fetched_chunks=source.fetched_chunks,
        num_chunks=source.manifest.num_chunks,
    )
